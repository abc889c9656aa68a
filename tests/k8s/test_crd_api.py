"""The FineTuneJob CRD on the real API server: examples accepted, invalid jobs refused with
the field named (schema and CEL), started jobs frozen, status fully declared, defaults equal
to parse_job's, and `kubectl explain` / `kubectl get ftj` useful."""

from __future__ import annotations

import copy
import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_operator.spec import (
    Condition,
    FineTuneJobStatus,
    OutputStatus,
    PlanBottleneck,
    PlannedStage,
    PlanStatus,
    ProgressStatus,
    StageStatus,
    parse_job,
    status_patch,
)
from relaytrain_testkit.harness.cluster import established_args
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.spec_cases import INVALID_CASES, Case

from hack import toolpaths

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "finetunejobs.relaytrain.io.yaml"
GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Any:
    from kubernetes import client

    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kube_cluster.wait_established("finetunejobs.relaytrain.io")
    return client.CustomObjectsApi(kube_cluster.api_client())


@pytest.fixture(scope="module")
def namespace(kube_cluster: Any, api: Any) -> Iterator[str]:
    name = f"crd-test-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", name)
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _create(api: Any, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(manifest)
    body["metadata"]["namespace"] = namespace
    # Strict, as kubectl is: unknown fields are refused instead of silently pruned.
    result: dict[str, Any] = api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body, field_validation="Strict"
    )
    return result


def _refusal(api: Any, namespace: str, manifest: dict[str, Any]) -> str:
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as info:
        _create(api, namespace, manifest)
    assert info.value.status in (400, 422), info.value.body
    message: str = json.loads(info.value.body)["message"]
    return message


@pytest.mark.parametrize(
    "path", sorted((REPO / "examples").glob("finetunejob-*.yaml")), ids=lambda p: p.stem
)
def test_examples_are_accepted(api: Any, namespace: str, path: Path) -> None:
    created = _create(api, namespace, yaml.safe_load(path.read_text()))
    # What the API server stored (its defaults filled in) is still a valid job for the operator.
    parse_job(created)


def test_server_defaults_equal_parse_job_defaults(api: Any, namespace: str) -> None:
    manifest = Job(f"defaults-{uuid.uuid4().hex[:6]}").build()
    created = _create(api, namespace, manifest)
    assert parse_job(created).spec == parse_job(manifest).spec


@pytest.mark.parametrize("case", INVALID_CASES, ids=[c.id for c in INVALID_CASES])
def test_invalid_jobs_are_refused_naming_the_field(api: Any, namespace: str, case: Case) -> None:
    manifest = case.apply(Job(f"bad-{uuid.uuid4().hex[:6]}")).build()
    message = _refusal(api, namespace, manifest)
    assert case.field in message, message
    # Nothing was stored under that name.
    listed = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    assert manifest["metadata"]["name"] not in {i["metadata"]["name"] for i in listed["items"]}


def _start(api: Any, namespace: str, name: str) -> None:
    api.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": {"phase": "Running", "startTime": "2026-11-22T05:00:00Z"}},
    )


@pytest.mark.parametrize(
    ("part", "before", "after"),
    [
        ("model", {"uri": "s3://models/another/"}, {"uri": "s3://models/third/"}),
        ("dataset", {"uri": "s3://datasets/b.jsonl"}, {"uri": "s3://datasets/c.jsonl"}),
        ("method", {"type": "qlora"}, {"rank": 64}),
        ("pipeline", {"compression": "none"}, {"compression": "int4"}),
        ("training", {"steps": 999}, {"learningRate": 0.1}),
        ("checkpoint", {"uri": "s3://other-bucket/ckpt"}, {"uri": "s3://third-bucket/ckpt"}),
    ],
)
def test_a_started_job_refuses_changes_to_what_it_trains(
    api: Any, namespace: str, part: str, before: dict[str, Any], after: dict[str, Any]
) -> None:
    from kubernetes.client.exceptions import ApiException

    name = f"frozen-{part}-{uuid.uuid4().hex[:6]}"
    _create(api, namespace, Job(name).build())
    # Before the first pod exists the job may still be edited...
    api.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {part: before}}
    )
    _start(api, namespace, name)
    # ...afterwards it may not, and the message names the field.
    with pytest.raises(ApiException) as info:
        api.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {part: after}}
        )
    assert info.value.status == 422
    assert f"spec.{part}" in json.loads(info.value.body)["message"]


def test_a_started_job_may_still_be_suspended_and_resumed(api: Any, namespace: str) -> None:
    name = f"suspend-{uuid.uuid4().hex[:6]}"
    _create(api, namespace, Job(name).build())
    _start(api, namespace, name)
    for value in (True, False):
        api.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"suspend": value}}
        )
        got = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        assert got["spec"]["suspend"] is value


def _full_status() -> FineTuneJobStatus:
    return FineTuneJobStatus(
        phase="Running",
        observed_generation=1,
        conditions=[
            Condition(
                type="Ready",
                status="True",
                reason="StagesReady",
                message="3/3 ready",
                last_transition_time="2026-11-22T05:00:00Z",
                observed_generation=1,
            ),
            Condition(
                type="Progressing",
                status="True",
                reason="Training",
                last_transition_time="2026-11-22T05:00:00Z",
            ),
        ],
        start_time="2026-11-22T05:00:00Z",
        completion_time="2026-11-22T06:00:00Z",
        plan=PlanStatus(
            stages=[
                PlannedStage(
                    index=k,
                    pool="NVIDIA-A100-SXM4-40GB",
                    layer_start=10 * k,
                    layer_end=10 * k + 10,
                    predicted_step_seconds=0.5,
                    predicted_memory_bytes=2**33,
                    available_memory_bytes=2**35,
                )
                for k in range(3)
            ],
            predicted_step_seconds=1.5,
            predicted_tokens_per_second=812.5,
            bubble_fraction=0.2,
            bottleneck=PlanBottleneck(stage=1, resource="link"),
        ),
        stages=[
            StageStatus(
                index=k,
                pod=f"job-stage-{k}",
                node=f"a100-{k}",
                pool="a100",
                phase="Running",
                ready=True,
                restarts=k,
                restored_from_step=20,
                last_failure="Evicted",
            )
            for k in range(3)
        ],
        ready_stages="3/3",
        restarts=3,
        progress=ProgressStatus(
            step=12,
            total_steps=100,
            step_of_total="12/100",
            loss=2.31,
            tokens_per_second=800.5,
            last_committed_step=10,
            eta="2026-11-22T07:00:00Z",
            updated_at="2026-11-22T05:10:00Z",
            eval_loss=2.07,
            eval_step=10,
        ),
        output=OutputStatus(uri="s3://relaytrain/adapters/job/"),
    )


def test_every_status_field_is_stored_not_pruned(api: Any, namespace: str) -> None:
    name = f"status-{uuid.uuid4().hex[:6]}"
    _create(api, namespace, Job(name).build())
    patch = status_patch(_full_status())
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": patch}
    )
    got = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert FineTuneJobStatus.model_validate(got["status"]) == _full_status()


def test_kubectl_get_shows_progress_columns(kube_cluster: Any, api: Any, namespace: str) -> None:
    name = f"columns-{uuid.uuid4().hex[:6]}"
    _create(api, namespace, Job(name).build())
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status_patch(_full_status())}
    )
    out = kube_cluster.kubectl("get", "ftj", name, "-n", namespace).stdout
    header, row = out.splitlines()[:2]
    for column in ("PHASE", "STEP", "LOSS", "EVAL LOSS", "READY", "RESTARTS", "CHECKPOINT", "AGE"):
        assert column in header
    for value in ("Running", "12/100", "2.31", "2.07", "3/3", "10"):
        assert value in row.split()


def test_kubectl_explain_teaches_the_api(kube_cluster: Any, api: Any) -> None:
    # The API server publishes a new CRD's OpenAPI a while after serving it.
    field = "ftj.spec.checkpoint.credentialsSecret"
    explained = wait_for(
        f"kubectl explain {field}: the CRD's OpenAPI published",
        lambda: kube_cluster.kubectl("explain", field, check=False).returncode == 0,
    )
    assert explained
    out = kube_cluster.kubectl("explain", field).stdout
    assert "Secret in the job's namespace" in out
    assert "accessKeyKey" in out
    out = kube_cluster.kubectl("explain", "finetunejobs.spec.pipeline.compression").stdout
    assert "int8" in out


def test_short_name_and_category(kube_cluster: Any, api: Any) -> None:
    out = kube_cluster.kubectl("api-resources", "--api-group=relaytrain.io", "-o", "wide").stdout
    assert "ftj" in out and "relaytrain" in out


@pytest.fixture
def things(kube_cluster: Any, tmp_path: Path) -> Iterator[str]:
    """A throwaway cluster-scoped kind, Thing (``things.<group>``, any fields), served;
    deleted after the test. Yields its group."""
    group = f"w{uuid.uuid4().hex[:8]}.example.com"
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    version = {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
    names = {"kind": "Thing", "plural": "things", "singular": "thing"}
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"things.{group}"},
        "spec": {"group": group, "names": names, "scope": "Cluster", "versions": [version]},
    }
    (tmp_path / "crd.json").write_text(json.dumps(crd))
    kube_cluster.kubectl("create", "-f", str(tmp_path / "crd.json"))
    kube_cluster.wait_established(f"things.{group}")
    yield group
    kube_cluster.kubectl("delete", "crd", f"things.{group}", "--wait=false", check=False)


def test_the_documented_wait_for_a_crd_outlasts_its_unwritten_status(
    kube_cluster: Any, tmp_path: Path, things: str
) -> None:
    """A CRD the API server has just made reads `status.conditions: null` until its
    controllers write it. `kubectl wait --for condition=Established` fails at once on that
    (CI met it on a busy machine); the wait README.md shows (`established_args`: the accepted
    names first, then the condition) waits it out. Played on an object of a throwaway kind
    whose status is written by hand as a new CRD's is, then as its controllers write it."""
    group = things
    unwritten = {"acceptedNames": {"plural": "", "kind": ""}, "conditions": None}
    thing = {"apiVersion": f"{group}/v1", "kind": "Thing", "metadata": {"name": "new"}}
    (tmp_path / "thing.json").write_text(json.dumps({**thing, "status": unwritten}))
    # `create --raw` keeps the null, which kubectl create and apply would drop.
    path = f"/apis/{group}/v1/things"
    kube_cluster.kubectl("create", "--raw", path, "-f", str(tmp_path / "thing.json"))
    target = f"things.{group}/new"

    alone = kube_cluster.kubectl(
        "wait", "--for=condition=Established", target, "--timeout=60s", check=False
    )
    assert alone.returncode != 0 and "accessor error" in alone.stderr, alone.stderr

    args = established_args(f"things.{group}", timeout=60)
    args[args.index(f"crd/things.{group}")] = target
    kubectl = [str(toolpaths.binary("kubectl")), "--kubeconfig", str(kube_cluster.kubeconfig)]
    log: list[str] = []

    def watching(times: int) -> bool:
        """Whether the wait has opened its ``times``-th watch (kubectl -v=6 logs each request:
        a wait whose condition is not met yet watches), or ended."""
        opened = sum("watch=true" in line for line in list(log))
        return opened >= times or documented.poll() is not None

    def write_status(*conditions: str) -> None:
        names = {"plural": "things", "kind": "Thing"}
        written = [{"type": c, "status": "True"} for c in conditions]
        patch = {"status": {"acceptedNames": names, "conditions": written}}
        kube_cluster.kubectl("patch", target, "--type=merge", "-p", json.dumps(patch))

    with subprocess.Popen(
        [*kubectl, "wait", *args, "-v=6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as documented:
        reader = threading.Thread(target=lambda: log.extend(documented.stderr or ()))
        reader.start()
        try:
            wait_for("the documented wait watching the unwritten status", lambda: watching(1))
            assert documented.poll() is None, log
            write_status("NamesAccepted")  # the names and the first condition: one update
            wait_for("the documented wait on to the condition, watching", lambda: watching(2))
            assert documented.poll() is None, log
            write_status("NamesAccepted", "Established")
            documented.wait(timeout=60)
        finally:
            documented.kill()
            reader.join()
        out = documented.stdout.read() if documented.stdout else ""
    assert documented.returncode == 0, log
    assert out.count("condition met") == 2, out
