"""What the operator builds, the worker parses: docs/stage-contract.md from both sides.

Every shipped example and a spread of settings go through build_stage_configs (operator)
and StageConfig.from_json (the worker's reading; both are relaytrain_contract's model); the
worker must accept each document, read back exactly what the operator wrote, and reach the
stores and links it names. A field one side adds without the other fails here.
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from relaytrain_contract import StageConfig
from relaytrain_operator.domain.builders.pod import CredentialsRef, StagePodInputs, build_stage_pod
from relaytrain_operator.domain.builders.secret import build_link_secret
from relaytrain_operator.domain.linkcerts import mint_link_credentials
from relaytrain_operator.domain.stage_config import (
    build_stage_configs,
    local_endpoints,
    pod_endpoints,
)
from relaytrain_operator.spec import FineTuneJob, parse_job
from relaytrain_testkit.harness.kubelet_volumes import FileProjection, write_atomically
from relaytrain_testkit.jobs import Job
from relaytrain_worker.pipeline.loading import link_credentials
from relaytrain_worker.pipeline.transport import AuthError, Frame, Link, connect, listen
from relaytrain_worker.state.store import S3Credentials, S3Store, open_job_store

pytestmark = pytest.mark.contract

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("finetunejob-*.yaml"))


UID = "0b6f0d1e-uid"
"""The uid the API server would have given the jobs here."""
LORA = Job.example("finetunejob-lora").uid(UID)


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
    job = parse_job(Job.from_file(path).uid(UID).build())
    stages = job.spec.pipeline.stages if job.spec.pipeline.stages != "auto" else 3
    documents = _roundtrip(job, stages, local)
    assert len(documents) == stages


VARIANTS: dict[str, Job] = {
    "single-stage": LORA.pipeline(stages=1),
    "two-stages-no-compression": LORA.pipeline(stages=2, compression="none"),
    "int4-qlora": LORA.method("qlora", rank=4).pipeline(compression="int4"),
    "bf16-full": LORA.method("full").pipeline(compression="bf16"),
    "chat-packed": LORA.dataset("/data/chat.jsonl", format="chat", packing=True),
    "epochs": LORA.set("spec.training", {"epochs": 2, "microBatches": 4}),
    "held-out-file": (
        LORA.dataset("/data/chat.jsonl")
        .validation("/data/held-out.jsonl")
        .set("spec.training", {"steps": 10, "evalEverySteps": 5})
    ),
    "held-out-share": LORA.dataset("/data/train.jsonl").validation(fraction=0.1),
    "local-store": LORA.set("spec.checkpoint", {"uri": "/tmp/relaytrain-ckpt"}),
    "explicit-output": LORA.output("file:///srv/adapters/smol"),
}
"""The lora example with one setting changed (`set`: the whole section replaced)."""


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_worker_parses_each_setting(name: str) -> None:
    job = parse_job(VARIANTS[name].build())
    stages = job.spec.pipeline.stages if job.spec.pipeline.stages != "auto" else 3
    _roundtrip(job, stages, local=True)


def test_the_held_out_data_and_its_cadence_reach_every_stage() -> None:
    manifest = LORA.validation(fraction=0.2).training(eval_every_steps=5).build()
    for document in _roundtrip(parse_job(manifest), 3, local=False):
        parsed = StageConfig.from_json(json.dumps(document))
        assert parsed.dataset.validation is not None
        assert (parsed.dataset.validation.fraction, parsed.dataset.validation.uri) == (0.2, None)
        assert parsed.training.eval_every_steps == 5
    # Without them the documents carry neither field (a worker without evaluation reads them).
    plain = _roundtrip(parse_job(LORA.build()), 2, True)
    assert all("validation" not in d["dataset"] for d in plain)
    assert all("evalEverySteps" not in d["training"] for d in plain)


def test_worker_refuses_a_document_with_a_field_it_does_not_know() -> None:
    # The contract says unknown fields are errors, so mismatched versions fail loudly.
    job = parse_job(LORA.build())
    document = build_stage_configs(job, _split(30, 2), pod_endpoints("smollm-lora", "default", 2))[
        1
    ]
    document["training"]["gradientCheckpointing"] = True
    with pytest.raises(ValueError, match="gradientCheckpointing"):
        StageConfig.from_json(json.dumps(document))


def test_an_aws_job_reaches_aws_s3_from_the_worker(fake_minio: list[dict[str, Any]]) -> None:
    # spec.checkpoint.endpoint empty means AWS S3: the operator accepts the job, and the
    # worker's store must be built for AWS from the document, not refuse it.
    job = parse_job(LORA.set("spec.checkpoint", {"uri": "s3://team-ckpt/relaytrain"}).build())
    documents = build_stage_configs(job, _split(30, 2), pod_endpoints(job.metadata.name, "ml", 2))
    cfg = StageConfig.from_json(json.dumps(documents[1]))
    assert cfg.checkpoint.endpoint is None
    # No credential Secret: the document names no variables; AWS's standard ones serve.
    assert (cfg.checkpoint.access_key_env, cfg.checkpoint.secret_key_env) == (None, None)
    aws_env = {
        "AWS_ACCESS_KEY_ID": "ASIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_SESSION_TOKEN": "session-token",
        "AWS_REGION": "eu-central-1",
    }
    store = open_job_store(cfg.checkpoint.uri, cfg.checkpoint, aws_env)
    assert isinstance(store, S3Store)
    assert (store.endpoint, store.secure, store.region) == (
        "s3.amazonaws.com",
        True,
        "eu-central-1",
    )
    assert (store.bucket, store.prefix) == ("team-ckpt", "relaytrain")
    assert store.credentials == S3Credentials("ASIAEXAMPLE", "secret", "session-token")
    client = fake_minio[-1]
    assert (client["endpoint"], client["secure"], client["region"]) == (
        "s3.amazonaws.com", True, "eu-central-1",
    )  # fmt: skip
    assert (client["access_key"], client["secret_key"], client["session_token"]) == (
        "ASIAEXAMPLE", "secret", "session-token",
    )  # fmt: skip
    # Nothing in the environment: the pod's IAM role (IRSA, instance metadata), not anonymous.
    open_job_store(cfg.checkpoint.uri, cfg.checkpoint, {"AWS_REGION": "eu-central-1"})
    assert type(fake_minio[-1]["credentials"]).__name__ == "IamAwsProvider"
    # The model, data and output URIs of the job are served the same way.
    assert isinstance(open_job_store("s3://models/smollm2/", cfg.checkpoint, aws_env), S3Store)
    assert fake_minio[-1]["endpoint"] == "s3.amazonaws.com"


def test_a_credential_secret_reaches_the_worker_by_the_names_in_the_document(
    fake_minio: list[dict[str, Any]],
) -> None:
    store = {"uri": "s3://ckpt/x", "endpoint": "https://minio.example:9000"}
    manifest = LORA.namespace("ml").set("spec.checkpoint", store).credentials("s3").build()
    job = parse_job(manifest)
    ends = pod_endpoints(job.metadata.name, "ml", 1)
    document = build_stage_configs(job, _split(30, 1), ends)[0]
    cfg = StageConfig.from_json(document)
    pod_env = {e["name"] for e in _pod_container(manifest, document, "s3")["env"]}
    assert {cfg.checkpoint.access_key_env, cfg.checkpoint.secret_key_env} <= pod_env
    store = open_job_store(
        cfg.checkpoint.uri,
        cfg.checkpoint,
        {"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY": "pw", "AWS_SESSION_TOKEN": "t"},
    )
    assert isinstance(store, S3Store)
    assert (store.endpoint, store.secure) == ("minio.example:9000", True)
    # A static key pair from a Secret: a stray session token in the environment is not its.
    assert store.credentials == S3Credentials("minio", "pw", None)


def test_operator_minted_credentials_reach_a_stage_and_open_its_links(tmp_path: Path) -> None:
    # The pod's link volume (the Secret's items, written as the kubelet writes them) gives
    # each stage the credentials at the folder its document names; neighbours then link.
    manifest, documents, secret = _three_stage_pods()
    name = manifest["metadata"]["name"]
    cfg = [_mounted(manifest, d, secret, tmp_path / f"s{k}") for k, d in enumerate(documents)]
    creds = [link_credentials(c) for c in cfg]
    assert [c.identity for c in creds] == [c.links.identity for c in cfg]
    with listen("127.0.0.1:0", credentials=creds[1], expect=str(cfg[1].links.prev_identity)) as lst:
        out: dict[str, Link] = {}
        t = threading.Thread(target=lambda: out.setdefault("down", lst.accept(timeout=10)))
        t.start()
        up = connect(
            f"127.0.0.1:{lst.address[1]}", credentials=creds[0],
            expect=str(cfg[0].links.next_identity), retry_for=5,
        )  # fmt: skip
        t.join(10)
        with up, out["down"] as down:
            up.send(Frame("control", 3, -1, meta={"hello": name}))
            assert down.recv(timeout=5).meta == {"hello": name}
            assert down.peer_identity == cfg[0].links.identity


def test_a_stage_handed_another_stages_certificate_stops_at_start_up(tmp_path: Path) -> None:
    manifest, documents, secret = _three_stage_pods()
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    stage_2 = _mounted(manifest, documents[2], secret, tmp_path)
    stage_1 = StageConfig.from_json(documents[1])
    wired_wrong = stage_1.model_copy(
        update={"links": stage_1.links.model_copy(update={"credentials_dir": str(tmp_path)})}
    )
    with pytest.raises(AuthError, match=f"is relaytrain://{ns}/{name}/p0/s2, but this stage is"):
        link_credentials(wired_wrong)
    assert link_credentials(stage_2).identity == stage_2.links.identity
    # The plan a stage's links check is its document's (job.planEpoch).
    job = stage_2.job.model_copy(update={"plan_epoch": 3})
    assert link_credentials(stage_2.model_copy(update={"job": job})).plan == 3


def _three_stage_pods() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The lora example as three stage pods: its manifest, documents and link Secret."""
    manifest = LORA.namespace("default").build()
    job = parse_job(manifest)
    ns, name = job.metadata.namespace, job.metadata.name
    documents = build_stage_configs(job, _split(30, 3), pod_endpoints(name, ns, 3))
    minted = mint_link_credentials(ns, name, [3], now=datetime.now(UTC))
    return manifest, documents, build_link_secret(manifest, minted, {})


def _pod_inputs(document: dict[str, Any], credentials: str | None = None) -> StagePodInputs:
    return StagePodInputs(
        index=document["stage"]["index"], pool="p", node_selector={}, memory_bytes=1 << 30,
        stage_config=document, image="worker",
        credentials=CredentialsRef(credentials) if credentials else None,
    )  # fmt: skip


def _pod_container(
    manifest: dict[str, Any], document: dict[str, Any], credentials: str | None = None
) -> dict[str, Any]:
    pod = build_stage_pod(manifest, _pod_inputs(document, credentials))
    container: dict[str, Any] = pod["spec"]["containers"][0]
    return container


def _mounted(
    manifest: dict[str, Any], document: dict[str, Any], secret: dict[str, Any], folder: Path
) -> StageConfig:
    """The stage's document as its pod sees it: the link volume's items written to `folder`
    the way a kubelet writes a Secret volume, at the folder the document names."""
    pod = build_stage_pod(manifest, _pod_inputs(document))
    (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [
        m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume["name"]
    ]
    cfg = StageConfig.from_json(document)
    assert mount["mountPath"] == cfg.links.credentials_dir
    mode = volume["secret"]["defaultMode"]
    payload = {
        item["path"]: FileProjection(base64.b64decode(secret["data"][item["key"]]), mode)
        for item in volume["secret"]["items"]
    }
    write_atomically(folder, payload)
    links = cfg.links.model_copy(update={"credentials_dir": str(folder)})
    return cfg.model_copy(update={"links": links})
