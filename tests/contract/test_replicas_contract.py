"""The stage document's `replicas` section (several pipelines), from both sides: what
`build_pipeline_configs` writes, the worker parses into the same peers the in-process maths
uses (`replicas.arithmetic.segment_peers`), and the replica links it names connect,
authenticated by the certificates minted for each (pipeline, stage); invalid sections name
the field."""

from __future__ import annotations

import copy
import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from relaytrain_contract import ConfigError, FleetDocument, StageConfig
from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_operator.domain.stage_config import (
    StageEndpoints,
    build_pipeline_configs,
    build_stage_configs,
    fleet_document,
    local_endpoints,
)
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.jobs import Job
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.transport import Link
from relaytrain_worker.replicas.arithmetic import Slice, segment_peers
from relaytrain_worker.replicas.links import ReplicaLinks, added_peers, peer_slices

pytestmark = pytest.mark.contract

REPO = Path(__file__).resolve().parents[2]
SPLITS = [[(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)], [(0, 30)]]
SHARES = [3, 2, 1]


THREE = (
    Job.example("finetunejob-lora").pipeline(stages="auto", replicas=3).training(micro_batches=6)
)
"""The lora example as 3 pipelines, 6 micro-batches a step."""


def _endpoints(splits: list[list[tuple[int, int]]]) -> list[list[StageEndpoints]]:
    out = []
    for p, split in enumerate(splits):
        ends = local_endpoints(len(split), 30000 + 100 * p, 9400 + 100 * p)
        out.append(
            [
                StageEndpoints(
                    e.listen,
                    e.next,
                    e.metrics_port,
                    replica_listen=f"0.0.0.0:{31000 + 100 * p + k}" if p else None,
                    replica_address=f"host-p{p}-s{k}:{31000 + 100 * p + k}" if p else None,
                )
                for k, e in enumerate(ends)
            ]
        )
    return out


@pytest.fixture(scope="module")
def documents() -> list[list[dict[str, Any]]]:
    return build_pipeline_configs(parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), SHARES)


def test_the_worker_reads_back_every_document_and_the_peers_the_maths_uses(
    documents: list[list[dict[str, Any]]],
) -> None:
    assert [len(d) for d in documents] == [2, 3, 1]
    for p, row in enumerate(documents):
        for k, document in enumerate(row):
            cfg = StageConfig.from_json(json.dumps(document))
            assert cfg.to_dict() == document
            assert cfg.replicas is not None
            assert cfg.replicas.pipeline == p and list(cfg.replicas.shares) == SHARES
            assert cfg.links.identity == f"relaytrain://default/smollm-lora/p{p}/s{k}"
            assert (cfg.replicas.listen is None) == (p == 0)
            # The peers the document lists are the ones the in-process group links to, and
            # the worker reads what each holds as the maths does.
            peers = [(x.pipeline, x.stage) for x in cfg.replicas.peers]
            assert peers == segment_peers(SPLITS, p, k)
            slices = peer_slices(cfg)
            for q, j in peers:
                want = Slice.of(SPLITS[q], j)
                assert slices[(q, j)].first == want.first
                assert (slices[(q, j)].start, slices[(q, j)].end) == (want.start, want.end)
                if cfg.stage.is_last:
                    assert slices[(q, j)].last == want.last
            for peer in cfg.replicas.peers:
                q, j = peer.pipeline, peer.stage
                assert peer.identity == f"relaytrain://default/smollm-lora/p{q}/s{j}"
                # Each stage dials the peers of higher pipelines; the lower ones dial it.
                assert peer.address == (f"host-p{q}-s{j}:{31000 + 100 * q + j}" if q > p else None)


def test_stages_started_before_a_pipeline_was_added_find_the_peers_its_documents_list(
    documents: list[list[dict[str, Any]]],
) -> None:
    # The job started as pipelines 0 and 1; pipeline 2 (one stage) is added. The fleet
    # document gives each earlier stage exactly the peers in pipeline 2 that a document of
    # the three-pipeline plan lists, so both sides link the same pairs.
    job = parse_job(THREE.build())
    before = build_pipeline_configs(job, SPLITS[:2], _endpoints(SPLITS[:2]), [3, 3])
    raw = json.dumps(fleet_document(job, SPLITS, _endpoints(SPLITS), added=[2], shares=[2, 2, 2]))
    fleet = FleetDocument.from_json(raw)
    assert [(a.pipeline, len(a.stages)) for a in fleet.added] == [(2, 1)]
    for p, row in enumerate(before):
        for k, document in enumerate(row):
            cfg = StageConfig.from_json(json.dumps(document))
            now = StageConfig.from_json(json.dumps(documents[p][k]))
            assert now.replicas is not None
            want = [peer for peer in now.replicas.peers if peer.pipeline == 2]
            assert added_peers(cfg, fleet, known=2) == want != []
            assert added_peers(cfg, fleet, known=3) == []  # taken in already
            # Its share as the grown plan gives it, in the marks its first stage makes.
            links = ReplicaLinks(cfg, None, fleet=lambda: fleet)  # type: ignore[arg-type]
            assert links.share == 3
            assert set(links.follow()) == {(q.pipeline, q.stage) for q in want}
            assert links.share == 2


FLEET_INVALID = [
    ("stages-out-of-order", lambda a: a["stages"].reverse(), "added[0].stages: must be stages 0"),
    ("no-address", lambda a: a["stages"][0].update(address=None), "added[0].stages: p1/s0 has"),
    ("a-gap", lambda a: a["stages"][1].update(layerStart=16), "added[0].stages: p1/s1 starts"),
    ("unknown-field", lambda a: a.update(share=2), "added[0].share: unknown field"),
    ("no-stages", lambda a: a.update(stages=[]), "added[0].stages: must list"),
]


@pytest.mark.parametrize(
    ("case", "change", "message"), FLEET_INVALID, ids=[c[0] for c in FLEET_INVALID]
)
def test_an_invalid_fleet_document_is_refused_naming_the_field(
    case: str, change: Any, message: str
) -> None:
    doc = fleet_document(parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), added=[1])
    change(doc["added"][0])
    with pytest.raises(ConfigError) as refused:
        FleetDocument.from_json(doc)
    assert message in str(refused.value), str(refused.value)
    twice = fleet_document(parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), [1, 2])
    twice["added"].reverse()
    with pytest.raises(ConfigError, match=r"added: must list each pipeline once, in order"):
        FleetDocument.from_json(twice)
    grown = fleet_document(parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), [1, 2], [2, 2, 2])
    with pytest.raises(ConfigError, match=r"shares: must give every pipeline a share, up to "):
        FleetDocument.from_json({**grown, "shares": [3, 3]})
    with pytest.raises(ConfigError, match=r"shares\[2\]: should be greater than or equal to 1"):
        FleetDocument.from_json({**grown, "shares": [3, 3, 0]})


def test_one_pipeline_has_no_replicas_section() -> None:
    job = parse_job(THREE.build())
    ends = local_endpoints(2, 29500, 9400)
    (row,) = build_pipeline_configs(job, [SPLITS[0]], [ends], [6])
    assert row == build_stage_configs(job, SPLITS[0], ends)
    assert all("replicas" not in d for d in row)


def test_the_builder_refuses_shares_that_do_not_fill_the_step() -> None:
    with pytest.raises(ValueError, match=r"add up to at least spec.training.microBatches \(6\)"):
        build_pipeline_configs(parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), [2, 2, 1])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        build_pipeline_configs(parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), [4, 2, 0])


def test_shares_past_the_step_are_weights_of_a_job_grown_past_a_pipeline_out() -> None:
    """A job grown while pipeline 1 was out keeps its share as the weight it comes back with:
    the planned shares of the pipelines training fill the step (4 + 2), pipeline 1's 3 more."""
    documents = build_pipeline_configs(
        parse_job(THREE.build()), SPLITS, _endpoints(SPLITS), [4, 3, 2]
    )
    for row in documents:
        for document in row:
            cfg = StageConfig.from_json(json.dumps(document))
            assert cfg.replicas is not None and cfg.replicas.shares == (4, 3, 2)


def _edit(document: dict[str, Any], change: Any) -> dict[str, Any]:
    out = copy.deepcopy(document)
    change(out["replicas"])
    return out


INVALID = [
    (
        "shares-do-not-fill-the-step",
        lambda r: r.update(shares=[2, 2, 1]),
        "replicas.shares: must add up to at least training.microBatches (6), got [2, 2, 1]",
    ),
    (
        "one-share",
        lambda r: r.update(shares=[6], pipeline=0),
        "replicas.shares: must list at least two",
    ),
    ("zero-share", lambda r: r.update(shares=[3, 3, 0]), "replicas.shares[2]"),
    ("pipeline-out-of-range", lambda r: r.update(pipeline=3), "replicas.pipeline: must be below"),
    (
        "listen-on-pipeline-0",
        lambda r: r.update(pipeline=0),
        "replicas.listen: must be null on pipeline 0",
    ),
    ("no-listen-elsewhere", lambda r: r.update(listen=None), "replicas.listen"),
    (
        "peer-missing",
        lambda r: r.update(peers=r["peers"][1:]),
        "replicas.peers: pipeline 0's stages",
    ),
    (
        "peer-of-own-pipeline",
        lambda r: r["peers"][2].update(pipeline=1),
        "replicas.peers: a peer's pipeline must be another of the 3 pipelines",
    ),
    (
        "peers-out-of-order",
        lambda r: r.update(peers=r["peers"][::-1]),
        "replicas.peers: must be listed once each",
    ),
    (
        "a-gap-between-peers",
        lambda r: r["peers"][1].update(layerStart=16),
        "replicas.peers: pipeline 0's stages must be consecutive",
    ),
    (
        "dial-address-on-a-lower-peer",
        lambda r: r["peers"][0].update(address="h:1"),
        "replicas.peers: the address of p0/s0",
    ),
    ("empty-peer-layers", lambda r: r["peers"][0].update(layerEnd=0), "replicas.peers[0].layerEnd"),
    (
        "stage-0-not-at-layer-0",
        lambda r: r["peers"][1].update(stage=0),
        "replicas.peers[1].layerStart: must be 0 exactly on a pipeline's stage 0",
    ),
    ("unknown-field", lambda r: r.update(outer="nesterov"), "replicas.outer: unknown field"),
    (
        "lora-merge-word",
        lambda r: r.update(sync={"mode": "periodic", "everySteps": 4, "loraMerge": "mean"}),
        "replicas.sync.loraMerge",
    ),
    (
        "periodic-without-every",
        lambda r: r.update(sync={"mode": "periodic"}),
        "replicas.sync.everySteps: must be set exactly when mode is periodic",
    ),
    (
        "every-one-step",
        lambda r: r.update(sync={"mode": "periodic", "everySteps": 1}),
        "replicas.sync.everySteps",
    ),
    (
        "an-outer-code-without-outer-steps",
        lambda r: r.update(sync={"mode": "synchronous", "outerCode": "int2"}),
        "replicas.sync.outerCode: is int2, but only periodic sync has outer steps",
    ),
    (
        "an-unknown-outer-code",
        lambda r: r.update(sync={"mode": "periodic", "everySteps": 4, "outerCode": "int3"}),
        "replicas.sync.outerCode",
    ),
]


@pytest.mark.parametrize(("case", "change", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_an_invalid_replicas_section_is_refused_naming_the_field(
    documents: list[list[dict[str, Any]]], case: str, change: Any, message: str
) -> None:
    # Stage 1 of pipeline 1 (layers 10-19): its peers are p0/s0, p0/s1 and p2/s0.
    document = _edit(documents[1][1], change)
    with pytest.raises(ConfigError) as refused:
        StageConfig.from_json(json.dumps(document))
    assert message in str(refused.value), str(refused.value)


def test_the_replica_links_connect_with_the_minted_certificates() -> None:
    # Two pipelines, [0-1 | 2-3] and [0-3]: p1/s0 shares layers with both stages of p0.
    splits = [[(0, 2), (2, 4)], [(0, 4)]]
    job = parse_job(THREE.training(micro_batches=3).build())
    ends = [
        [StageEndpoints(None, "127.0.0.1:1", 0), StageEndpoints("127.0.0.1:1", None, 0)],
        [StageEndpoints(None, None, 0, f"127.0.0.1:{(port := free_port())}", f"127.0.0.1:{port}")],
    ]  # fmt: skip
    docs = build_pipeline_configs(job, splits, ends, [2, 1])
    pki = mint_link_credentials("default", "smollm-lora", [2, 1], now=datetime.now(UTC))
    stages = {}
    for p, row in enumerate(docs):
        for k, document in enumerate(row):
            cfg = StageConfig.from_json(json.dumps(document))
            replicas = ReplicaLinks(cfg, LinkCredentials(*stage_pem(pki, p, k)))
            replicas.open()
            stages[(p, k)] = replicas
    got: dict[tuple[int, int], dict[tuple[int, int], Link]] = {}
    resumed: dict[tuple[int, int], int | None] = {}
    errors: list[BaseException] = []

    def run(me: tuple[int, int]) -> None:
        try:
            _, links = stages[me].connect(60, lambda: None, lambda _: None)
            got[me] = links
            if me[0] == 0:
                stages[me].send_resume(links, 12)
            else:
                resumed[me] = stages[me].recv_resume(links, 60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(me,)) for me in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        assert sorted(got[(1, 0)]) == [(0, 0), (0, 1)]
        assert sorted(got[(0, 0)]) == sorted(got[(0, 1)]) == [(1, 0)]
        for me, links in got.items():
            for (q, j), link in links.items():
                assert link.peer_identity == f"relaytrain://default/smollm-lora/p{q}/s{j}", me
        assert resumed == {(1, 0): 12}  # pipeline 0's agreed step reaches pipeline 1
    finally:
        for links in got.values():
            for link in links.values():
                link.close()
        for replicas in stages.values():
            replicas.close()


def test_an_exact_merge_of_a_qlora_job_is_refused_naming_the_field(
    documents: list[list[dict[str, Any]]],
) -> None:
    # A 4-bit frozen weight cannot take the exact merge's fold: the stage document says so
    # before the stage loads anything (the FineTuneJob's admission refuses it first).
    document = _edit(documents[1][1], lambda r: r.update(
        sync={"mode": "periodic", "everySteps": 4, "loraMerge": "exact"}))  # fmt: skip
    document["method"]["type"] = "qlora"
    with pytest.raises(ConfigError) as refused:
        StageConfig.from_json(json.dumps(document))
    assert "replicas.sync.loraMerge: exact merges fold into the frozen weights" in str(
        refused.value
    )
    document["replicas"]["sync"]["loraMerge"] = "auto"
    StageConfig.from_json(json.dumps(document))
