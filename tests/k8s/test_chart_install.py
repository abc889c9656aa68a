"""The operator as the chart installs it: `helm install` of charts/relaytrain into the local
cluster, the Deployment's pod run by the kwok process runner
(relaytrain_testkit.harness.chart_install) with the in-cluster environment a kubelet gives,
so the operator authenticates with a bound token of the chart's ServiceAccount and can do
what the chart's RBAC grants, nothing else.

Both namespaces (the release's and the jobs') enforce the Pod Security Standard
`restricted` through the API server's PodSecurity admission: the operator pod and every
stage pod must be admitted there. Stage pods are kwok's (Running, never executed); the
e2e tier runs them as real workers.

The tests run in order against one release: it runs a job, survives its probes failing,
is upgraded under a running job, and is uninstalled last. Two more releases, each rendered
with one grant removed (`create pods`, a write; `get secrets`, a read), show what a missing
grant does: the operator's Forbidden error as an Event on the FineTuneJob. To see the
whole tier fail that way, run it with RELAYTRAIN_CHART_DROP_GRANT="create pods" (any
`VERB RESOURCE[.GROUP]` the chart grants).
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from relaytrain_testkit.harness.chart_install import (
    ChartRelease,
    chart_values,
    pod_ready,
    restricted_namespace,
)
from relaytrain_testkit.harness.operator_cases import cluster_job, install_crd
from relaytrain_testkit.harness.procs import held
from relaytrain_testkit.harness.rbac_audit import service_account_user
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG as MODEL_CONFIG

pytestmark = pytest.mark.k8s

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"
JOB_LABEL = "relaytrain.io/job"
# Where the in-cluster config reads (/var/run, a link to /run; read through /proc/PID/root
# an absolute link would leave the process's mount namespace).
SA_DIR = "run/secrets/kubernetes.io/serviceaccount"


class Setup:
    """A release, its namespaces and the reads the tests repeat."""

    def __init__(self, api: client.ApiClient, release: ChartRelease, jobs: str) -> None:
        self.api = api
        self.release = release
        self.jobs = jobs
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.values = chart_values(jobs)

    def create_job(self, name: str, model_dir: Path) -> None:
        self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.jobs, PLURAL, cluster_job(name, str(model_dir), self.jobs).build()
        )

    def status(self, name: str) -> dict[str, Any]:
        job = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.jobs, PLURAL, name)
        return dict(job.get("status") or {})

    def stage_pods(self, job: str) -> dict[str, Any]:
        pods = self.core.list_namespaced_pod(self.jobs, label_selector=f"{JOB_LABEL}={job}")
        return {p.metadata.name: p for p in pods.items if not p.metadata.deletion_timestamp}

    def running(self, job: str, count: int) -> dict[str, Any] | None:
        pods = self.stage_pods(job)
        live = {n: p for n, p in pods.items() if p.status.phase == "Running"}
        return live if len(live) == count == len(pods) else None

    def wait_running(self, job: str, count: int, timeout: float = 90) -> dict[str, Any]:
        """Waits for the job's `count` stage pods to run; fails at once, with the job's
        story, when the operator reports a request the API server forbade."""

        def probe() -> dict[str, Any] | None:
            if any(e.reason == "Forbidden" for e in self.job_events(job)):
                raise AssertionError(f"the operator was refused a request{self.explain(job)}")
            return self.running(job, count)

        try:
            pods: dict[str, Any] = wait_for(f"{count} running stage pods of {job}", probe, timeout)
        except AssertionError as err:
            if "was refused" in str(err):
                raise
            raise AssertionError(f"{err}{self.explain(job)}") from None
        return pods

    def job_events(self, job: str) -> list[Any]:
        selector = f"involvedObject.name={job},involvedObject.kind=FineTuneJob"
        return list(self.core.list_namespaced_event(self.jobs, field_selector=selector).items)

    def explain(self, job: str) -> str:
        events = [f"{e.type} {e.reason}: {e.message}" for e in self.job_events(job)]
        return (
            f"\nFineTuneJob {self.jobs}/{job} status: {json.dumps(self.status(job))[:1500]}"
            f"\nIts events:\n" + "\n".join(events) + self.release.diagnostics()
        )


def _drop_finalizers_and_delete(setup: Setup) -> None:
    """Jobs outlive an uninstalled operator (by design), with kopf's finalizer on them: a
    test namespace can only go once nobody waits for an operator that is gone."""
    jobs = setup.custom.list_namespaced_custom_object(GROUP, VERSION, setup.jobs, PLURAL)
    for job in jobs["items"]:
        name = job["metadata"]["name"]
        try:
            setup.custom.patch_namespaced_custom_object(
                GROUP, VERSION, setup.jobs, PLURAL, name, {"metadata": {"finalizers": None}}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    setup.core.delete_collection_namespaced_pod(setup.jobs, grace_period_seconds=0)


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> client.ApiClient:
    return kube_cluster.api_client()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


def _installed(
    kube_cluster: Any,
    api: client.ApiClient,
    workdir: Path,
    prefix: str,
    drop_grant: str | None,
) -> Iterator[Setup]:
    # The CRD may already be there (other tests apply crds/): the release adopts it.
    install_crd(kube_cluster, api)
    core = client.CoreV1Api(api)
    tag = uuid.uuid4().hex[:6]
    system = restricted_namespace(core, f"{prefix}-system-{tag}")
    jobs = restricted_namespace(core, f"{prefix}-{tag}")
    release = ChartRelease(f"{prefix}{tag}", system, kube_cluster.kubeconfig, api, workdir)
    setup = Setup(api, release, jobs)
    release.start_kubelet()
    try:
        release.install(setup.values, drop_grant=drop_grant)
        yield setup
    finally:
        release.helm("uninstall", release.name, "--wait", check=False)
        release.stop_kubelet()
        _drop_finalizers_and_delete(setup)
        core.delete_namespace(jobs)
        core.delete_namespace(system)
        print(f"\nOperator pod logs of {release.name}:\n{release.operator_log()[-3000:]}")


@pytest.fixture(scope="module")
def setup(
    kube_cluster: Any, api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    drop = os.environ.get("RELAYTRAIN_CHART_DROP_GRANT") or None
    yield from _installed(kube_cluster, api, tmp_path_factory.mktemp("chart"), "rtchart", drop)


def test_the_operator_runs_as_the_chart_pod_under_its_service_account(
    setup: Setup, kube_cluster: Any
) -> None:
    pod, local = setup.release.ready_operator()
    system = setup.release.namespace
    account = pod.spec.service_account_name
    assert account == f"{setup.release.name}-relaytrain"
    # What the kubelet gave the container: the in-cluster environment, and no kubeconfig.
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{local.process.pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert "KUBECONFIG" not in environ
    assert environ["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    # Its mounts, seen from inside its own mount namespace.
    mounted = Path(f"/proc/{local.process.pid}/root") / SA_DIR
    assert (mounted / "namespace").read_text() == system
    assert (mounted / "ca.crt").read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert (mounted / "token").read_text().count(".") == 2  # a JWT

    # The API server saw the operator as the ServiceAccount, by a token bound to this pod.
    user = service_account_user(system, account)

    def operator_requests() -> list[dict[str, Any]]:
        events = (json.loads(line) for line in kube_cluster.component_log("audit").splitlines())
        return [e for e in events if e.get("user", {}).get("username") == user]

    seen = wait_for("the operator's requests in the audit log", operator_requests, timeout=60)
    pods = {
        tuple(e["user"].get("extra", {}).get("authentication.kubernetes.io/pod-name", []))
        for e in seen
    }
    assert pods == {(pod.metadata.name,)}, pods


def test_a_job_runs_with_every_pod_admitted_as_restricted(setup: Setup, model_dir: Path) -> None:
    # The namespace enforces `restricted` (the API server's PodSecurity admission is on):
    # a pod that is not is refused.
    privileged = {
        "metadata": {"name": "privileged"},
        "spec": {
            "containers": [{"name": "c", "image": "x", "securityContext": {"privileged": True}}]
        },
    }
    with pytest.raises(ApiException) as refused:
        setup.core.create_namespaced_pod(setup.jobs, privileged)
    assert refused.value.status == 403 and "violates PodSecurity" in str(refused.value.body)
    # The operator pod was admitted in its namespace, which enforces the same.
    labels = setup.core.read_namespace(setup.release.namespace).metadata.labels
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert setup.release.operator_pod()

    setup.create_job("admitted", model_dir)
    setup.wait_running("admitted", 2)
    try:
        wait_for("the job Running", lambda: setup.status("admitted").get("phase") == "Running")
    except AssertionError as err:
        raise AssertionError(f"{err}{setup.explain('admitted')}") from None


def test_failing_probes_mark_the_pod_unready_and_restart_the_operator(
    setup: Setup, model_dir: Path
) -> None:
    """A stuck operator (SIGSTOP: its health endpoint stops answering) fails readiness, then
    liveness: the pod turns not Ready, the container is killed and restarted, and the new
    process is Ready and reconciles."""
    pod, local = setup.release.ready_operator()
    name = pod.metadata.name
    restarts = pod.status.container_statuses[0].restart_count

    def status() -> Any:
        return setup.core.read_namespaced_pod(name, setup.release.namespace).status

    with held(local.process.pid):
        unready = wait_for("the pod not Ready", lambda: (s := status()) and not _ready(s) and s)
        assert unready.container_statuses[0].restart_count == restarts, "liveness acted first"
        restarted = wait_for(
            "the container restarted",
            lambda: (s := status()).container_statuses[0].restart_count == restarts + 1 and s,
            timeout=60,
        )
    last = restarted.container_statuses[0].last_state.terminated
    assert last is not None and last.exit_code == 128 + signal.SIGKILL  # SIGTERM stays pending
    again, new = setup.release.ready_operator()
    assert again.metadata.uid == pod.metadata.uid and new.process.pid != local.process.pid
    reasons = {
        (e.reason, (e.message or "").split(":")[0])
        for e in setup.core.list_namespaced_event(
            setup.release.namespace, field_selector=f"involvedObject.name={name}"
        ).items
    }
    assert ("Unhealthy", "Readiness probe failed") in reasons, reasons
    assert ("Unhealthy", "Liveness probe failed") in reasons, reasons
    assert any(r == "Killing" for r, _ in reasons), reasons

    # The restarted operator reconciles: a new job gets its pods.
    setup.create_job("after-restart", model_dir)
    setup.wait_running("after-restart", 2)


def _ready(status: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def test_upgrade_keeps_a_running_jobs_pods_and_the_job_finishes(
    setup: Setup, model_dir: Path
) -> None:
    setup.create_job("upgraded", model_dir)
    before = setup.wait_running("upgraded", 2)
    uids = {n: p.metadata.uid for n, p in before.items()}
    old = setup.release.operator_pod()

    # A changed value changes the pod template: the Deployment replaces the operator pod
    # (Recreate: the old one goes first, so two operators never run at once).
    setup.values["resyncSeconds"] = 2
    setup.release.upgrade(setup.values)
    new, _ = setup.release.ready_operator()
    assert new.metadata.uid != old.metadata.uid
    env = {e.name: e.value for e in new.spec.containers[0].env}
    assert env["RELAYTRAIN_RESYNC_SECONDS"] == "2"
    assert {n: p.metadata.uid for n, p in setup.stage_pods("upgraded").items()} == uids

    # The stages finish (kwok's pods never run: post what a kubelet would); the upgraded
    # operator sees it and the job succeeds.
    for name in uids:
        setup.core.patch_namespaced_pod(
            name, setup.jobs, {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}}
        )
        setup.core.patch_namespaced_pod_status(name, setup.jobs, {"status": {"phase": "Succeeded"}})
    try:
        wait_for(
            "the job Succeeded",
            lambda: setup.status("upgraded").get("phase") == "Succeeded",
            timeout=60,
        )
    except AssertionError as err:
        raise AssertionError(f"{err}{setup.explain('upgraded')}") from None
    # Same pods all along: the job's stages were never replaced.
    stages = setup.status("upgraded").get("stages") or []
    assert all(s.get("restarts", 0) == 0 for s in stages), stages


def test_uninstall_keeps_the_crd_and_the_jobs(setup: Setup, api: client.ApiClient) -> None:
    jobs = setup.custom.list_namespaced_custom_object(GROUP, VERSION, setup.jobs, PLURAL)
    names = sorted(j["metadata"]["name"] for j in jobs["items"])
    assert names, "the earlier tests should have left jobs"
    pods = {p.metadata.uid for p in setup.core.list_namespaced_pod(setup.jobs).items}
    setup.release.uninstall()
    wait_for("the operator pod to go", lambda: not setup.release.operator_pods(), timeout=60)
    # The release's own objects are gone ...
    rbac = client.RbacAuthorizationV1Api(api)
    roles = rbac.list_cluster_role(
        label_selector=f"app.kubernetes.io/instance={setup.release.name}"
    )
    assert roles.items == []
    # ... the CRD (helm.sh/resource-policy: keep) and the users' jobs and their pods are not.
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert crd.metadata.deletion_timestamp is None
    jobs = setup.custom.list_namespaced_custom_object(GROUP, VERSION, setup.jobs, PLURAL)
    assert sorted(j["metadata"]["name"] for j in jobs["items"]) == names
    assert {p.metadata.uid for p in setup.core.list_namespaced_pod(setup.jobs).items} == pods


@pytest.fixture(scope="module")
def without_pods_create(
    kube_cluster: Any, api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("chart-drop")
    yield from _installed(kube_cluster, api, workdir, "rtdrop", "create pods")


@pytest.fixture(scope="module")
def without_secrets_get(
    kube_cluster: Any, api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("chart-drop-get")
    yield from _installed(kube_cluster, api, workdir, "rtdropget", "get secrets")


def test_a_removed_read_grant_is_the_operators_forbidden_error_in_an_event(
    without_secrets_get: Setup,
) -> None:
    # A job whose store credentials are in a Secret: the operator reads it to open the
    # store (the model's config.json) before it plans. Without `get secrets` that read is
    # refused, and the refusal reaches the job as an Event like a refused write.
    setup = without_secrets_get
    setup.release.ready_operator()
    job = cluster_job("no-secrets", "s3://models/smol/", setup.jobs)
    job = job.checkpoint("s3://ckpt", endpoint="http://127.0.0.1:9").credentials("s3")
    setup.custom.create_namespaced_custom_object(GROUP, VERSION, setup.jobs, PLURAL, job.build())

    _refused_with_an_event(setup, "no-secrets", 'cannot get resource "secrets"')


def test_a_removed_grant_is_the_operators_forbidden_error_in_an_event(
    without_pods_create: Setup, model_dir: Path
) -> None:
    setup = without_pods_create
    setup.release.ready_operator()
    setup.create_job("no-pods", model_dir)

    _refused_with_an_event(setup, "no-pods", 'cannot create resource "pods"')


def _refused_with_an_event(setup: Setup, job: str, refusal: str) -> None:
    """Waits for the job's Warning Event `Forbidden` whose message says `refusal`; the job
    has no stage pod, and the operator pod stays up and Ready."""

    def forbidden() -> list[Any]:
        return [
            e
            for e in setup.job_events(job)
            if e.reason == "Forbidden" and refusal in (e.message or "")
        ]

    try:
        events = wait_for("a Forbidden event on the job", forbidden, timeout=60)
    except AssertionError as err:
        raise AssertionError(f"{err}{setup.explain(job)}") from None
    print(f"\nThe event: {events[0].type} {events[0].reason}: {events[0].message[:400]}")
    assert setup.stage_pods(job) == {}
    assert setup.release.operator_pod() is not None and pod_ready(setup.release.operator_pod())
