"""The operator's effectful half against the real API server: the executor applies a
decision's actions in order and idempotently, the observer reads what a pass needs, and a
runner's passes over a new job create its children once and then leave them be.

Everything goes through the real `apply.ClusterApi` over the session cluster's admin
client, in a namespace of each test's own (named `rtex-*`, which the operator process of
tests/k8s/test_operator.py does not watch); the assertions are on what the API server then
holds. The checks of the store (progress.json, the credential Secret) need MinIO and live
in tests/e2e/test_operator_store.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from kubernetes import client
from relaytrain_operator.domain.builders.labels import JOB_LABEL, STAGE_LABEL
from relaytrain_operator.domain.builders.service import build_service
from relaytrain_operator.domain.status import load_status, to_manifest
from relaytrain_operator.loop.actions import (
    Action,
    Create,
    CreateLinkSecret,
    DeletePod,
    PatchStatus,
    PostEvent,
)
from relaytrain_operator.loop.apply import ClusterApi, Executor
from relaytrain_operator.loop.decide import Needs, parse_spec
from relaytrain_operator.loop.observe import Observer
from relaytrain_operator.loop.options import OperatorOptions
from relaytrain_operator.loop.runner import Runner
from relaytrain_testkit.decide_cases import running_status
from relaytrain_testkit.harness.operator_cases import (
    GROUP,
    PLURAL,
    VERSION,
    cluster_job,
    install_crd,
    namespace,
    nodes_index,
    raw,
)
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.k8s

JsonDict = dict[str, Any]


@pytest.fixture(scope="module")
def admin(kube_cluster: Any) -> client.ApiClient:
    return kube_cluster.api_client()


@pytest.fixture(scope="module")
def crd(kube_cluster: Any, admin: client.ApiClient) -> None:
    install_crd(kube_cluster, admin)


@pytest.fixture
def ns(admin: client.ApiClient, crd: None) -> Iterator[str]:
    with namespace(admin, "rtex") as name:
        yield name


@pytest.fixture
def api(admin: client.ApiClient) -> ClusterApi:
    return ClusterApi(admin)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG))
    return tmp_path


class Kube:
    """The test's own reads and writes, as the admin, in the test's namespace."""

    def __init__(self, admin: client.ApiClient, ns: str) -> None:
        self.ns = ns
        self.core = client.CoreV1Api(admin)
        self.custom = client.CustomObjectsApi(admin)

    def create_job(self, manifest: JsonDict, status: JsonDict | None = None) -> JsonDict:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, manifest)
        if status is not None:
            self.patch_status(manifest["metadata"]["name"], status)
        return self.job(manifest["metadata"]["name"])

    def patch_status(self, name: str, status: JsonDict) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.ns, PLURAL, name, {"status": status}
        )

    def job(self, name: str = "j") -> JsonDict:
        job: JsonDict = raw(
            self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.ns, PLURAL, name, _preload_content=False
            )
        )
        return job

    def rv(self, name: str = "j") -> str:
        return str(self.job(name)["metadata"]["resourceVersion"])

    def create_pod(self, pod: JsonDict) -> str:
        created = raw(self.core.create_namespaced_pod(self.ns, pod, _preload_content=False))
        return str(created["metadata"]["uid"])

    def pods(self, job: str = "j") -> dict[str, JsonDict]:
        items = raw(
            self.core.list_namespaced_pod(
                self.ns, label_selector=f"{JOB_LABEL}={job}", _preload_content=False
            )
        )["items"]
        return {p["metadata"]["name"]: p for p in items}

    def uids(self, job: str = "j") -> dict[str, str]:
        return {name: p["metadata"]["uid"] for name, p in self.pods(job).items()}

    def secret(self, name: str) -> JsonDict:
        secret: JsonDict = raw(
            self.core.read_namespaced_secret(name, self.ns, _preload_content=False)
        )
        return secret

    def service(self, name: str) -> JsonDict:
        service: JsonDict = raw(
            self.core.read_namespaced_service(name, self.ns, _preload_content=False)
        )
        return service

    def running(self, job: str, count: int) -> dict[str, JsonDict] | None:
        """The job's pods once exactly `count` are bound and Running (None before)."""
        pods = self.pods(job)
        live = [
            p
            for p in pods.values()
            if p["status"].get("phase") == "Running"
            and p["spec"].get("nodeName")
            and not p["metadata"].get("deletionTimestamp")
        ]
        return pods if len(live) == len(pods) == count else None


@pytest.fixture
def kube(admin: client.ApiClient, ns: str) -> Kube:
    return Kube(admin, ns)


def stage_pod(ns: str, k: int, job: str = "j", node: str | None = None) -> JsonDict:
    """A small pod that carries a stage's labels (the executor does not look inside)."""
    spec: JsonDict = {
        "containers": [{"name": "stage", "image": "relaytrain-worker:test"}],
        "automountServiceAccountToken": False,
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-stage-{k}",
            "namespace": ns,
            "labels": {JOB_LABEL: job, STAGE_LABEL: str(k)},
        },
        "spec": spec,
    }


def owner_uid(obj: JsonDict) -> tuple[str, str]:
    (ref,) = obj["metadata"]["ownerReferences"]
    return ref["kind"], ref["uid"]


# --- the executor -----------------------------------------------------------------------


def test_the_executor_applies_actions_in_order_and_patches_only_what_changed(
    kube: Kube, api: ClusterApi
) -> None:
    progress = {"step": 5, "totalSteps": 100, "stepOfTotal": "5/100"}
    kube.create_job(
        cluster_job("j", "s3://models/smol/", kube.ns).build(), running_status(progress=progress)
    )
    first_stage_0 = kube.create_pod(stage_pod(kube.ns, 0))
    stage_1 = kube.create_pod(stage_pod(kube.ns, 1))
    job = api.get_job(kube.ns, "j")
    assert job is not None
    unchanged = load_status(job["status"])
    # After the pass read the job, another writer moves a field the pass does not change.
    elsewhere = {"step": 7, "totalSteps": 100, "stepOfTotal": "7/100"}
    kube.patch_status("j", {"progress": elsewhere})
    rv = kube.rv()
    posted: list[tuple[str, str, str, str]] = []
    executor = Executor(api, lambda j, t, r, m: posted.append((j["metadata"]["name"], t, r, m)))
    now = datetime.now(UTC)

    # A status equal to the one the pass read is not sent at all: nothing is written, so
    # the other writer's field stays (a whole-status patch would put back the stale copy).
    executor.run(job, [PatchStatus(unchanged)], now)
    assert kube.rv() == rv

    recovering = unchanged.model_copy(update={"phase": "Recovering"})
    executor.run(
        job,
        [
            DeletePod("j-stage-0", first_stage_0, force=True),
            CreateLinkSecret((2,), timedelta(days=30)),
            Create(build_service(job)),
            Create(stage_pod(kube.ns, 0)),
            Create(stage_pod(kube.ns, 2)),
            PatchStatus(recovering),
            PatchStatus(recovering),
            PostEvent("Warning", "StageRestarting", "Stage 0 failed."),
        ],
        now,
    )
    uids = kube.uids()
    assert set(uids) == {"j-stage-0", "j-stage-1", "j-stage-2"}
    # Stage 0 was deleted before it was created again: the other way round, the create
    # would have found the old pod (409) and the delete would have left no stage 0.
    assert uids["j-stage-0"] != first_stage_0
    assert uids["j-stage-1"] == stage_1
    assert owner_uid(kube.service("j")) == ("FineTuneJob", job["metadata"]["uid"])
    assert owner_uid(kube.secret("j-link")) == ("FineTuneJob", job["metadata"]["uid"])
    # The patch carried the phase alone: what the other writer stored is still there.
    assert kube.job()["status"] == {
        **to_manifest(unchanged),
        "phase": "Recovering",
        "progress": elsewhere,
    }
    assert posted == [("j", "Warning", "StageRestarting", "Stage 0 failed.")]


def test_actions_applied_again_change_nothing_and_a_stale_delete_spares_the_successor(
    kube: Kube, api: ClusterApi
) -> None:
    job = kube.create_job(cluster_job("j", "s3://models/smol/", kube.ns).build())
    first = kube.create_pod(stage_pod(kube.ns, 0))
    actions: list[Action] = [
        DeletePod("j-stage-0", first),
        CreateLinkSecret((2,), timedelta(days=30)),
        Create(build_service(job)),
        Create(stage_pod(kube.ns, 0)),
    ]
    executor = Executor(api, lambda *a: None)
    executor.run(job, actions, datetime.now(UTC))
    successor = kube.uids()["j-stage-0"]
    assert successor != first
    secret, service = kube.secret("j-link"), kube.service("j")

    # The same pass again (as after an operator restart): the delete names the old pod's
    # uid and leaves its successor alone, and every create finds its object (409).
    executor.run(job, actions, datetime.now(UTC))
    assert kube.uids() == {"j-stage-0": successor}
    assert kube.secret("j-link") == secret
    assert kube.service("j") == service
    # A pod that is already gone is no error.
    executor.run(job, [DeletePod("j-stage-9", None, force=True)], datetime.now(UTC))


def test_the_link_secret_is_minted_once_for_every_stage(kube: Kube, api: ClusterApi) -> None:
    job = kube.create_job(cluster_job("j", "s3://models/smol/", kube.ns).build())
    executor = Executor(api, lambda *a: None)
    executor.run(job, [CreateLinkSecret((2,), timedelta(days=30))], datetime.now(UTC))
    secret = kube.secret("j-link")
    assert secret["type"] == "Opaque"
    assert owner_uid(secret) == ("FineTuneJob", job["metadata"]["uid"])
    assert secret["metadata"]["labels"][JOB_LABEL] == "j"
    files = {
        name: x509.load_pem_x509_certificate(_decoded(secret, name))
        for name in ("ca.crt", "p0-s0.crt", "p0-s1.crt")
    }
    assert set(secret["data"]) == {*files, "p0-s0.key", "p0-s1.key"}
    for stage in ("p0-s0.crt", "p0-s1.crt"):
        files[stage].verify_directly_issued_by(files["ca.crt"])
    # A second mint (a replacement's pass) keeps the first: every stage shares one CA.
    executor.run(job, [CreateLinkSecret((2,), timedelta(days=30))], datetime.now(UTC))
    assert kube.secret("j-link") == secret


def _decoded(secret: JsonDict, name: str) -> bytes:
    return base64.b64decode(secret["data"][name])


# --- the observer -----------------------------------------------------------------------


def test_the_observer_reads_only_what_is_needed(
    kube: Kube, api: ClusterApi, admin: client.ApiClient
) -> None:
    job = kube.create_job(cluster_job("j", "s3://models/smol/", kube.ns).build(), running_status())
    kube.create_pod(stage_pod(kube.ns, 0, node="a100-0"))
    kube.create_pod(stage_pod(kube.ns, 1, node="rtx4090-0"))
    kube.create_pod(stage_pod(kube.ns, 0, job="other", node="a100-1"))
    kube.create_pod(stage_pod(kube.ns, 1, job="other", node="a100-1"))
    wait_for("the other job's pods to run", lambda: kube.running("other", 2))
    kube.core.patch_namespaced_pod_status(
        "other-stage-1", kube.ns, {"status": {"phase": "Failed", "reason": "Error"}}
    )
    observer = Observer(api)
    now = datetime.now(UTC)

    # The job's own stage pods, by the job label (not the other job's).
    pods = observer.stage_pods(kube.ns, "j")
    assert {k: p["metadata"]["name"] for k, p in pods.items()} == {
        (0, 0): "j-stage-0",
        (0, 1): "j-stage-1",
    }
    # rtx4090-0 is not indexed yet: it is read from the API server, and nothing else is.
    indexed = {"a100-0": nodes_index(admin)["a100-0"][0]}
    quiet = observer.observe(job, pods, indexed, Needs(), now)
    assert set(quiet.nodes) == {"a100-0", "rtx4090-0"}
    assert quiet.nodes["rtx4090-0"]["metadata"]["labels"]["relaytrain.io/pool"] == "rtx4090"
    assert quiet.cluster_pods is None and quiet.model is None and quiet.progress is None

    # A pod bound to a node the API server no longer has: the node is left out (the
    # decision reads that as a lost node).
    lost = {(0, 0): {**pods[(0, 0)], "spec": {**pods[(0, 0)]["spec"], "nodeName": "vanished-0"}}}
    assert "vanished-0" not in observer.observe(job, lost, {}, Needs(), now).nodes

    # Room to place pods: the cluster's active pods, fresh; a Failed pod holds no GPU.
    room = observer.observe(job, pods, indexed, Needs(room=True), now).cluster_pods
    assert room is not None
    here = {p["metadata"]["name"] for p in room if p["metadata"]["namespace"] == kube.ns}
    assert here == {"j-stage-0", "j-stage-1", "other-stage-0"}


def test_a_cluster_that_serves_no_workloads_is_read_as_kueue_missing(
    kube: Kube, api: ClusterApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job labelled for a queue on a cluster without Kueue: the API server's 404 for the
    Workload resource is an answer (no Kueue), not a failed pass."""
    from relaytrain_operator.domain import queueing

    job = kube.create_job(cluster_job("q", "s3://models/smol/", kube.ns).queue("team").build())
    observer = Observer(api)
    now = datetime.now(UTC)
    # Whether this session's cluster has Kueue's CRDs depends on what ran before (the Kueue
    # e2e tests install them; tests/e2e/test_kueue_e2e.py reads Workloads that exist): a
    # group no cluster serves stands for a cluster without Kueue.
    monkeypatch.setattr(queueing, "GROUP", "absent.relaytrain.test")
    absent = observer.observe(job, {}, {}, Needs(workload=True), now)
    assert absent.kueue_missing and not absent.workloads
    assert not observer.observe(job, {}, {}, Needs(), now).kueue_missing  # not read


def test_the_observer_caches_model_configs_and_reports_why_one_cannot_be_read(
    kube: Kube, api: ClusterApi, model_dir: Path, tmp_path: Path
) -> None:
    job = kube.create_job(cluster_job("j", str(model_dir), kube.ns).build())
    observer = Observer(api)
    wanted = Needs(room=True, model=True)
    now = datetime.now(UTC)
    first = observer.observe(job, {}, {}, wanted, now)
    assert first.model is not None and first.model.config == SMOLLM2_135M_CONFIG
    assert first.cluster_pods is not None  # read from the API server alongside
    (model_dir / "config.json").unlink()
    assert observer.observe(job, {}, {}, wanted, now).model == first.model  # cached

    def model_error(name: str, uri: str) -> str:
        other = kube.create_job(cluster_job(name, uri, kube.ns).build())
        model = observer.observe(other, {}, {}, wanted, now).model
        assert model is not None and model.config is None
        return model.error

    assert "no hub access" in model_error("hub", "hf://org/name")
    assert "has no config.json" in model_error("empty", str(tmp_path / "none"))
    # A spec the API server accepts but the operator cannot run: nothing is read.
    bad = kube.create_job(
        cluster_job("bad", str(model_dir), kube.ns).method(target_modules=["lm_head"]).build()
    )
    assert isinstance(parse_spec(bad), str)
    unread = observer.observe(bad, {}, {}, wanted, now)
    assert unread.model is None and unread.cluster_pods is None


def test_each_job_s_credentials_and_data_set_are_checked_before_its_pods(
    kube: Kube, api: ClusterApi, minio_server: Any, model_dir: Path
) -> None:
    """Jobs on one s3:// model: the first, with good keys, reads config.json; the others
    name a Secret that does not exist, one without the key, and one with a key the store
    refuses: each is told so, none is planned on the first job's read (whatever another
    job read before). Then a Secret, keys and a data set that are wrong are told, for a job
    whose model the operator reads from a local directory too."""
    mc, bucket = minio_server.client(), minio_server.bucket
    body = json.dumps(SMOLLM2_135M_CONFIG).encode()
    mc.put_object(bucket, "models/creds/config.json", io.BytesIO(body), len(body))
    uri = f"s3://{bucket}/models/creds/"
    keys = {"AWS_ACCESS_KEY_ID": minio_server.access_key,
            "AWS_SECRET_ACCESS_KEY": minio_server.secret_key}  # fmt: skip
    for name, data in (("good", keys), ("partial", {"AWS_ACCESS_KEY_ID": minio_server.access_key}),
                       ("refused", {**keys, "AWS_SECRET_ACCESS_KEY": "not-the-key"})):  # fmt: skip
        kube.core.create_namespaced_secret(
            kube.ns, client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data)
        )
    observer = Observer(api)

    def model(name: str, secret: str) -> Any:
        job = (
            cluster_job(name, uri, kube.ns)
            .checkpoint(f"s3://{bucket}/ckpt", endpoint=minio_server.url)
            .credentials(secret)
        )
        return observer.observe(kube.create_job(job.build()), {}, {}, Needs(model=True),
                                datetime.now(UTC)).model  # fmt: skip

    assert model("first", "good").config == SMOLLM2_135M_CONFIG
    missing = model("second", "absent")
    assert missing.config is None and missing.error.startswith(
        "spec.checkpoint.credentialsSecret.name: Secret 'absent' does not exist"
    )
    partial = model("third", "partial")
    assert partial.config is None and partial.error.startswith(
        "spec.checkpoint.credentialsSecret.secretKeyKey: Secret 'partial' has no key"
    )
    refused = model("fourth", "refused")
    assert refused.config is None and "SignatureDoesNotMatch" in refused.error, refused.error
    assert model("fifth", "good").config == SMOLLM2_135M_CONFIG  # the same keys: read once

    # The inputs are looked at before any pod exists: the Secret, the store's answer to its
    # keys, the data set (missing, empty, or there), for a job on a local model too.
    mc.put_object(bucket, "data/empty.jsonl", io.BytesIO(b""), 0)
    mc.put_object(bucket, "data/one.jsonl", io.BytesIO(b'{"text": "a"}\n'), 14)

    def problem(name: str, key: str, secret: str = "good") -> tuple[str, str] | None:
        job = (
            cluster_job(name, str(model_dir), kube.ns)
            .dataset(f"s3://{bucket}/{key}")
            .checkpoint(f"s3://{bucket}/ckpt", endpoint=minio_server.url)
            .credentials(secret)
        )
        found = observer.observe(kube.create_job(job.build()), {}, {}, Needs(inputs=True),
                                 datetime.now(UTC)).inputs  # fmt: skip
        return (found.reason, found.message) if found is not None else None

    assert problem("d1", "data/one.jsonl") is None
    data = f"s3://{bucket}/data"
    assert problem("d2", "data/none.jsonl") == (
        "DatasetUnavailable",
        f"spec.dataset.uri {data}/none.jsonl: no such object; upload the JSONL file",
    )
    assert problem("d3", "data/empty.jsonl") == (
        "DatasetUnavailable",
        f"spec.dataset.uri {data}/empty.jsonl: the object is empty; it needs at least one record",
    )
    assert problem("d4", "data/one.jsonl", "absent") == (
        "CredentialsUnavailable",
        f"spec.checkpoint.credentialsSecret.name: Secret 'absent' does not exist in namespace "
        f"{kube.ns!r}; create it with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    )
    refused = problem("d5", "data/one.jsonl", "refused")
    assert refused is not None and refused[0] == "CredentialsUnavailable", refused
    assert refused[1].startswith(
        f"spec.checkpoint.credentialsSecret: the store at {minio_server.url} refused the keys "
        f"of Secret 'refused' for s3://{bucket}/ckpt (SignatureDoesNotMatch: "
    ), refused


# --- a runner's passes --------------------------------------------------------------------


def runner_over(api: ClusterApi, posted: list[tuple[str, str]] | None = None) -> Runner:
    def post(job: JsonDict, kind: str, reason: str, message: str) -> None:
        if posted is not None:
            posted.append((kind, reason))

    return Runner(api, OperatorOptions(resync_seconds=30, worker_device="cpu"), None, post)


def start(
    kube: Kube, runner: Runner, model_dir: Path, admin: client.ApiClient
) -> dict[str, JsonDict]:
    """Create job `j`, run its first pass, wait for its two pods to run, and record them."""
    kube.create_job(cluster_job("j", str(model_dir), kube.ns).build())
    nodes = nodes_index(admin)
    first = asyncio.run(runner.reconcile(kube.ns, "j", nodes, {}))
    assert first.status is not None and first.status.phase == "Pending"
    pods: dict[str, JsonDict] = wait_for("2 running stage pods", lambda: kube.running("j", 2))
    index = {(kube.ns, "j"): list(pods.values())}
    second = asyncio.run(runner.reconcile(kube.ns, "j", nodes, index))
    assert not [a for a in second.actions if isinstance(a, Create | DeletePod)]
    return pods


def test_a_pass_creates_a_new_job_s_pods_and_a_pass_with_nothing_new_does_nothing(
    kube: Kube, api: ClusterApi, model_dir: Path, admin: client.ApiClient
) -> None:
    posted: list[tuple[str, str]] = []
    runner = runner_over(api, posted)
    nodes = nodes_index(admin)
    kube.create_job(cluster_job("j", str(model_dir), kube.ns).build())

    first = asyncio.run(runner.reconcile(kube.ns, "j", nodes, {}))
    assert first.status is not None and first.status.phase == "Pending"
    job = kube.job()
    plan = job["status"]["plan"]["stages"]
    assert [s["index"] for s in plan] == [0, 1] and plan[-1]["layerEnd"] == 30
    assert job["status"]["startTime"]
    created = kube.pods()
    assert set(created) == {"j-stage-0", "j-stage-1"}
    for stage in plan:
        pod = created[f"j-stage-{stage['index']}"]
        assert pod["spec"]["nodeSelector"]["relaytrain.io/pool"] == stage["pool"]
        assert owner_uid(pod) == ("FineTuneJob", job["metadata"]["uid"])
    assert owner_uid(kube.service("j")) == ("FineTuneJob", job["metadata"]["uid"])
    assert owner_uid(kube.secret("j-link")) == ("FineTuneJob", job["metadata"]["uid"])
    assert ("Normal", "Planned") in posted

    # Once the pods run, a pass records them; it creates and deletes nothing.
    pods = wait_for("2 running stage pods", lambda: kube.running("j", 2))
    index = {(kube.ns, "j"): list(pods.values())}
    second = asyncio.run(runner.reconcile(kube.ns, "j", nodes, index))
    assert not [a for a in second.actions if isinstance(a, Create | DeletePod)]
    assert kube.job()["status"]["phase"] == "Running"

    # Nothing has changed since: the next pass decides nothing and writes nothing.
    rv, uids = kube.rv(), kube.uids()
    third = asyncio.run(runner.reconcile(kube.ns, "j", nodes, index))
    assert third.actions == () and third.restarts == 0
    assert kube.rv() == rv and kube.uids() == uids


def test_an_index_that_lags_a_create_is_confirmed_by_listing_the_pods(
    kube: Kube, api: ClusterApi, model_dir: Path, admin: client.ApiClient
) -> None:
    runner = runner_over(api)
    pods = start(kube, runner, model_dir, admin)
    nodes = nodes_index(admin)
    rv, uids = kube.rv(), kube.uids()

    # The index has only stage 1 (stage 0's create has not reached it yet): the pass
    # lists the job's pods, finds stage 0, and does not take it for deleted.
    lagging = {(kube.ns, "j"): [pods["j-stage-1"]]}
    decision = asyncio.run(runner.reconcile(kube.ns, "j", nodes, lagging))
    assert decision.restarts == 0 and decision.actions == ()
    assert kube.rv() == rv and kube.uids() == uids

    # When stage 0 is really gone, the same listing says so: it is counted once.
    kube.core.delete_namespaced_pod("j-stage-0", kube.ns, grace_period_seconds=0)
    decision = asyncio.run(runner.reconcile(kube.ns, "j", nodes, lagging))
    assert decision.restarts == 1
    stages = kube.job()["status"]["stages"]
    assert [s["restarts"] for s in stages] == [1, 0]
    assert stages[0]["lastFailure"] == "Deleted"
