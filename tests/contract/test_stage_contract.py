"""What the operator builds, the worker parses: docs/stage-contract.md from both sides.

Every shipped example and a spread of settings go through build_stage_configs (operator)
and StageConfig.from_json (worker); the worker must accept each document and read back
exactly what the operator wrote. A field one side adds without the other fails here.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_operator.builders.pod import StagePodInputs, build_stage_pod
from relaytrain_operator.builders.secret import build_link_secret
from relaytrain_operator.linkcerts import mint_link_credentials
from relaytrain_operator.spec import FineTuneJob, parse_job
from relaytrain_operator.stage_config import (
    build_stage_configs,
    local_endpoints,
    pod_endpoints,
)
from relaytrain_worker.config import StageConfig
from relaytrain_worker.stage import link_credentials
from relaytrain_worker.transport import AuthError, Frame, Link, connect, listen

pytestmark = pytest.mark.contract

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("finetunejob-*.yaml"))


def _example(path: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(path.read_text())
    manifest["metadata"].setdefault("uid", "0b6f0d1e-uid")
    return manifest


def _split(layers: int, stages: int) -> list[tuple[int, int]]:
    cuts = [round(layers * k / stages) for k in range(stages + 1)]
    return list(itertools.pairwise(cuts))


def _roundtrip(job: FineTuneJob, stages: int, local: bool) -> list[dict[str, Any]]:
    ranges = _split(30, stages)
    ends = (
        local_endpoints(stages, 29500, 9400)
        if local
        else pod_endpoints(job.metadata.name, job.metadata.namespace, stages)
    )
    documents = build_stage_configs(job, ranges, ends)
    for document in documents:
        text = json.dumps(document)  # what travels: an env var or a file
        parsed = StageConfig.from_json(text)
        assert parsed.to_dict() == document
    return documents


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("local", [False, True], ids=["pods", "local"])
def test_worker_parses_every_example_stage_by_stage(path: Path, local: bool) -> None:
    job = parse_job(_example(path))
    stages = job.spec.pipeline.stages if job.spec.pipeline.stages != "auto" else 3
    documents = _roundtrip(job, stages, local)
    assert len(documents) == stages


VARIANTS: dict[str, dict[str, Any]] = {
    "single-stage": {"pipeline": {"stages": 1}},
    "two-stages-no-compression": {"pipeline": {"stages": 2, "compression": "none"}},
    "int4-qlora": {"method": {"type": "qlora", "rank": 4}, "pipeline": {"compression": "int4"}},
    "bf16-full": {"method": {"type": "full"}, "pipeline": {"compression": "bf16"}},
    "chat-packed": {
        "dataset": {"uri": "/data/chat.jsonl", "format": "chat", "packing": True},
    },
    "epochs": {"training": {"epochs": 2, "microBatches": 4}},
    "local-store": {"checkpoint": {"uri": "/tmp/relaytrain-ckpt"}},
    "explicit-output": {"output": {"uri": "file:///srv/adapters/smol"}},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_worker_parses_each_setting(name: str) -> None:
    manifest = _example(REPO / "examples" / "finetunejob-lora.yaml")
    spec = copy.deepcopy(manifest["spec"])
    for key, value in VARIANTS[name].items():
        spec[key] = value if key not in ("dataset",) else {**spec[key], **value}
    manifest["spec"] = spec
    job = parse_job(manifest)
    stages = job.spec.pipeline.stages if job.spec.pipeline.stages != "auto" else 3
    _roundtrip(job, stages, local=True)


def test_worker_refuses_a_document_with_a_field_it_does_not_know() -> None:
    # The contract says unknown fields are errors, so mismatched versions fail loudly.
    job = parse_job(_example(REPO / "examples" / "finetunejob-lora.yaml"))
    document = build_stage_configs(job, _split(30, 2), pod_endpoints("smollm-lora", "default", 2))[
        1
    ]
    document["training"]["gradientCheckpointing"] = True
    with pytest.raises(ValueError, match="gradientCheckpointing"):
        StageConfig.from_json(json.dumps(document))


def test_operator_minted_credentials_reach_a_stage_and_open_its_links() -> None:
    # The pod's env (secretKeyRef into the link Secret, resolved as the kubelet does) gives
    # each stage the credentials its document names; neighbours then link up over TLS.
    manifest = _example(REPO / "examples" / "finetunejob-lora.yaml")
    manifest["metadata"].setdefault("namespace", "default")
    job = parse_job(manifest)
    ns, name = job.metadata.namespace, job.metadata.name
    documents = build_stage_configs(job, _split(30, 3), pod_endpoints(name, ns, 3))
    secret = build_link_secret(
        manifest, mint_link_credentials(ns, name, [3], now=datetime.now(UTC))
    )
    creds = [
        link_credentials(StageConfig.from_json(d), _pod_env(manifest, d, secret)) for d in documents
    ]
    cfg = [StageConfig.from_json(d) for d in documents]
    assert [c.identity for c in creds] == [c.links.identity for c in cfg]
    with listen("127.0.0.1:0", credentials=creds[1], expect=str(cfg[1].links.prevIdentity)) as lst:
        out: dict[str, Link] = {}
        t = threading.Thread(target=lambda: out.setdefault("down", lst.accept(timeout=10)))
        t.start()
        up = connect(
            f"127.0.0.1:{lst.address[1]}", credentials=creds[0],
            expect=str(cfg[0].links.nextIdentity), retry_for=5,
        )  # fmt: skip
        t.join(10)
        with up, out["down"] as down:
            up.send(Frame("control", 3, -1, meta={"hello": name}))
            assert down.recv(timeout=5).meta == {"hello": name}
            assert down.peer_identity == cfg[0].links.identity


def test_a_stage_handed_another_stages_certificate_stops_at_start_up() -> None:
    manifest = _example(REPO / "examples" / "finetunejob-lora.yaml")
    manifest["metadata"].setdefault("namespace", "default")
    job = parse_job(manifest)
    ns, name = job.metadata.namespace, job.metadata.name
    documents = build_stage_configs(job, _split(30, 3), pod_endpoints(name, ns, 3))
    secret = build_link_secret(
        manifest, mint_link_credentials(ns, name, [3], now=datetime.now(UTC))
    )
    env_of_stage_2 = _pod_env(manifest, documents[2], secret)
    with pytest.raises(AuthError, match=f"is relaytrain://{ns}/{name}/p0/s2, but this stage is"):
        link_credentials(StageConfig.from_json(documents[1]), env_of_stage_2)


def _pod_env(
    manifest: dict[str, Any], document: dict[str, Any], secret: dict[str, Any]
) -> dict[str, str]:
    inputs = StagePodInputs(
        index=document["stage"]["index"], pool="p", node_selector={}, memory_bytes=1 << 30,
        stage_config=document, image="worker",
    )  # fmt: skip
    env = {}
    for var in build_stage_pod(manifest, inputs)["spec"]["containers"][0]["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["name"] == secret["metadata"]["name"]:
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env
