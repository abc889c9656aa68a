"""`relaytrain run --local` with several pipelines, without stage processes: how the job and
the flags become pipelines (stage counts, splits, micro-batch shares), and what each stage
process is handed (its document, its (pipeline, stage) certificate, its ports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from relaytrain_contract import LINK_CERT_FILE, FleetDocument, StageConfig
from relaytrain_operator.cli.local_run import LocalRun, local_layout
from relaytrain_operator.cli.local_run.grow import add_pipeline
from relaytrain_operator.cli.local_run.layout import grown_layout
from relaytrain_operator.spec import FineTuneJob, SpecError, parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.unit


PIPES = Job("pipes").pipeline(stages=2).training(micro_batches=3)
"""Two stages, 3 micro-batches a step."""


def _on_disk(job: Job, tmp_path: Path) -> FineTuneJob:
    """`job` with its model a 4-layer config.json in `tmp_path/model` and its checkpoints in
    `tmp_path/ckpt`, parsed."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({**SMOLLM2_135M_CONFIG, "num_hidden_layers": 4}))
    return parse_job(job.model(str(model)).checkpoint(str(tmp_path / "ckpt")).build())


def test_one_pipeline_is_the_default() -> None:
    layout = local_layout(parse_job(PIPES.build()), 4)
    assert layout.splits == [[(0, 2), (2, 4)]] and layout.shares == [3]


def test_each_pipeline_gets_its_own_stage_count_and_even_split() -> None:
    one, two = parse_job(PIPES.build()), parse_job(PIPES.pipeline(replicas=2).build())
    layout = local_layout(two, 4, stages=[2, 3])
    assert layout.splits == [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]
    # The planner's split with every layer costing the same: beats of 2 layers each, the
    # longer pipeline pays one more beat of fill, so it gets one micro-batch of three.
    assert layout.shares == [2, 1]
    assert local_layout(two, 4).splits == [[(0, 2), (2, 4)]] * 2  # spec stages
    auto = parse_job(PIPES.pipeline(replicas="auto").build())
    assert local_layout(auto, 4, stages=[1, 2, 4]).shares == [1, 1, 1]
    assert local_layout(one, 4, stages=[2, 3], replicas=2, shares=[1, 2]).shares == [1, 2]


@pytest.mark.parametrize(
    ("pipeline", "flags", "field", "message"),
    [
        ({}, {"stages": [2, 3]}, "--stages", "lists 2 stage counts for 1 pipeline(s)"),
        ({"replicas": 2}, {"shares": [3, 1]}, "--shares", "adding up to"),
        ({"replicas": 2}, {"shares": [3]}, "--shares", "each of the 2 pipeline(s)"),
        ({}, {"replicas": 4}, "spec.pipeline.replicas", "4 pipelines need at least 4"),
        # 4 stages of 1 layer finish 3 micro-batches (beats 4, 5, 6) before 3 stages of up to
        # 2 layers finish one (beat 6): the planner gives the second pipeline none.
        ({"replicas": 2}, {"stages": [4, 3]}, "--stages", "as [3, 0], leaving one without any"),
    ],
)
def test_flags_that_do_not_fit_are_refused_by_name(
    pipeline: dict[str, Any], flags: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(SpecError) as refused:
        local_layout(parse_job(PIPES.pipeline(**pipeline).build()), 4, **flags)
    assert refused.value.paths == [field]
    assert message in str(refused.value)


def test_each_stage_of_each_pipeline_is_handed_its_own_document_and_certificate(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    run = LocalRun.prepare(_on_disk(PIPES.pipeline(replicas=2), tmp_path), tmp_path / "wd", [2, 3])
    run.write_stage_files()
    request.addfinalizer(run.remove_credentials)
    assert [(s.pipeline, s.index, s.name) for s in run.stages] == [
        (0, 0, "stage p0/s0"), (0, 1, "stage p0/s1"),
        (1, 0, "stage p1/s0"), (1, 1, "stage p1/s1"), (1, 2, "stage p1/s2"),
    ]  # fmt: skip
    assert [s.config_path.name for s in run.stages][2:] == [
        "p1-stage-0.json", "p1-stage-1.json", "p1-stage-2.json",
    ]  # fmt: skip
    ports = set()
    for stage, document in zip(run.stages, run.documents, strict=True):
        cfg = StageConfig.from_json(json.dumps(document))
        assert cfg.replicas is not None and cfg.replicas.pipeline == stage.pipeline
        assert list(cfg.replicas.shares) == [2, 1]
        assert cfg.stage.index == stage.index
        identity = f"relaytrain://default/pipes/p{stage.pipeline}/s{stage.index}"
        assert stage.link_dir is not None and cfg.links.credentials_dir == str(stage.link_dir)
        cert = x509.load_pem_x509_certificate((stage.link_dir / LINK_CERT_FILE).read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [identity]
        assert cfg.links.identity == identity
        for address in (cfg.links.listen, cfg.replicas.listen):
            if address is not None:
                ports.add(address)
        ports.add(cfg.observability.port)
        # Every peer of a higher pipeline is dialled where that stage listens for it.
        for peer in cfg.replicas.peers:
            if peer.pipeline > stage.pipeline:
                theirs = run.documents[2 + peer.stage]["replicas"]["listen"]
                assert peer.address == theirs
    assert len(ports) == 2 * 5 - 2 + 3  # links (stage 0s listen on none), metrics, replicas


def test_a_stages_override_on_a_job_with_a_fixed_stage_count_is_followed(tmp_path: Path) -> None:
    # `--stages 3` on a job that says `stages: 2`: the command line wins (it used to be
    # refused by the documents' check against the job's count).
    run = LocalRun.prepare(_on_disk(PIPES, tmp_path), tmp_path / "wd", [3])
    assert [d["stage"]["count"] for d in run.documents] == [3, 3, 3]
    assert all("replicas" not in d for d in run.documents)
    assert [s.config_path.name for s in run.stages] == [
        "stage-0.json", "stage-1.json", "stage-2.json",
    ]  # fmt: skip


def test_an_unsupported_model_type_is_refused_before_any_stage(tmp_path: Path) -> None:
    job = _on_disk(PIPES, tmp_path)
    config = {**SMOLLM2_135M_CONFIG, "model_type": "bert"}
    (Path(job.spec.model.uri) / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError) as refused:
        LocalRun.prepare(job, tmp_path / "wd", None)
    message = str(refused.value)
    assert "spec.model.uri" in message and "'bert' is not supported" in message
    assert "llama" in message and "gemma2" in message  # the supported list
    assert not (tmp_path / "wd").exists() or not list((tmp_path / "wd").glob("*stage-*.json"))


def test_periodic_sync_reaches_every_stage_document(tmp_path: Path) -> None:
    sync = {"mode": "periodic", "everySteps": 4, "outerCode": "int2", "loraMerge": "average"}
    run = LocalRun.prepare(
        _on_disk(PIPES.pipeline(replicas=2).sync("periodic", 4, "int2", "average"), tmp_path),
        tmp_path / "wd",
        [2, 1],
    )
    assert [d["replicas"]["sync"] for d in run.documents] == [sync] * 3
    assert all(StageConfig.from_json(d).replicas.sync.every_steps == 4 for d in run.documents)  # type: ignore[union-attr]


def test_a_pipeline_added_to_a_run_gets_documents_certificates_and_a_fleet_entry(
    tmp_path: Path,
) -> None:
    # The run's [2, 3]-stage pipelines share 3 micro-batches 2:1; one more, split as the
    # last, is planned with at least one micro-batch each, its stages' documents list all
    # three, their certificates come from the run's CA, and fleet.json says where they are.
    run = LocalRun.prepare(_on_disk(PIPES.pipeline(replicas=2), tmp_path), tmp_path / "wd", [2, 3])
    added = add_pipeline(run.job, run.layout, run.endpoints, run._ca, [])
    assert added.pipeline == 2 and added.layout.splits[2] == run.layout.splits[1]
    assert added.layout.shares == [1, 1, 1]
    ca = x509.load_pem_x509_certificate(run._credentials["ca.crt"].encode())
    fleet = FleetDocument.from_json(added.fleet)
    for k, document in enumerate(added.documents):
        cfg = StageConfig.from_json(json.dumps(document))
        assert cfg.replicas is not None and cfg.replicas.pipeline == 2
        assert list(cfg.replicas.shares) == [1, 1, 1] and cfg.replicas.listen is not None
        cert = x509.load_pem_x509_certificate(added.credentials[f"p2-s{k}.crt"].encode())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [cfg.links.identity]
        # fleet.json names it where it listens, with its layers and identity (which peers
        # the earlier stages take from it: tests/contract/test_replicas_contract.py).
        entry = fleet.added[0].stages[k]
        assert entry.address == cfg.replicas.listen and entry.identity == cfg.links.identity
        assert (entry.layer_start, entry.layer_end) == (cfg.stage.layer_start, cfg.stage.layer_end)
    # With as many pipelines as micro-batches there is no room for one more.
    with pytest.raises(ValueError, match="4 pipelines need at least 4 micro-batches"):
        grown_layout(added.layout, 3)
