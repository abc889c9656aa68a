"""The operator against the real control plane with kwok GPU pools.

One operator process per module, started as users start it (`python -m
relaytrain_operator`), watching only namespaces named `rtop-*` so other tests' objects are
not its business. Each test works in its own namespace. kwok marks pods Running on its
nodes; a test "fails" a stage pod by setting its status phase to Failed (what a kubelet
reports for a crashed container with restartPolicy Never), deletes it, or deletes its node.

RBAC: the operator authenticates as the Helm chart's ServiceAccount, bound by the chart's
own (Cluster)Roles (relaytrain_testkit.harness.chart_rbac), so it can do what the chart grants
and no more.
The tests themselves use the admin kubeconfig.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from relaytrain_testkit.harness import kwok_nodes
from relaytrain_testkit.harness.chart_rbac import ChartIdentity, chart_rbac_kubeconfig
from relaytrain_testkit.harness.operator_cases import cluster_job, install_crd, namespace
from relaytrain_testkit.harness.operator_process import PASSES, OperatorProcess
from relaytrain_testkit.harness.rbac_audit import (
    calls_of,
    explain,
    granted_to,
    service_account_user,
)
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import LLAMA31_8B_CONFIG
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG as MODEL_CONFIG
from relaytrain_testkit.spec_cases import DELETE

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.k8s

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"
JOB_LABEL = "relaytrain.io/job"
JOIN_SECONDS = 5


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> client.ApiClient:
    return kube_cluster.api_client()


@pytest.fixture(scope="module")
def crd(kube_cluster: Any, api: client.ApiClient) -> None:
    install_crd(kube_cluster, api)


@pytest.fixture(scope="module")
def identity(
    kube_cluster: Any, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> ChartIdentity:
    return chart_rbac_kubeconfig(
        kube_cluster,
        tmp_path_factory.mktemp("identity") / "operator.kubeconfig",
        release="rtop",
        namespace="relaytrain-optest",
        watch=[],
    )


@pytest.fixture(scope="module")
def operator(
    identity: ChartIdentity,
    tmp_path_factory: pytest.TempPathFactory,
    api: client.ApiClient,
    model_dir: Path,
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    # A re-split waits for what one costs (--join-seconds): seconds here, not minutes.
    args = ("--namespace", "rtop-*", "--resync-seconds", "1", "--secret-propagation-seconds", "1",
            "--join-seconds", str(JOIN_SECONDS))  # fmt: skip
    proc = OperatorProcess(identity.kubeconfig, log, *args)
    # The tests start once /metrics answers: a namespace (and job) made while kopf still
    # sets up its watches is served all the same (tests/k8s/test_operator_namespaces.py).
    proc.start()
    yield proc
    proc.stop()
    print(f"\nOperator log ({log}):\n{proc.tail(40)}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


@pytest.fixture
def ns(api: client.ApiClient) -> Iterator[str]:
    """A namespace the operator watches (rtop-*); its stage pods, which hold GPUs the next
    test plans on, are gone when the test is."""
    with namespace(api, "rtop") as name:
        yield name


def _job(name: str, model_path: Path | str) -> Job:
    """A three-stage job on the model at `model_path`, 3 restarts a stage."""
    return (
        cluster_job(name, str(model_path)).pipeline(stages=3).failure_policy(max_stage_restarts=3)
    )


class Cluster:
    """Short reads and writes the tests repeat."""

    def __init__(self, api: client.ApiClient, ns: str) -> None:
        self.ns = ns
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.seen: list[dict[str, Any]] = []
        """Every job object this test read, as the API server returned it."""

    def create_job(self, manifest: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, manifest
        )
        return result

    def job(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, name
        )
        self.seen.append(result)
        return result

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec}
        )

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.job(name).get("status") or {})

    def condition(self, name: str, kind: str = "Ready") -> dict[str, Any]:
        for c in self.status(name).get("conditions") or []:
            if c["type"] == kind:
                return dict(c)
        return {}

    def pods(self, job: str) -> dict[str, client.V1Pod]:
        items = self.core.list_namespaced_pod(self.ns, label_selector=f"{JOB_LABEL}={job}").items
        return {p.metadata.name: p for p in items}

    def uids(self, job: str) -> dict[str, str]:
        return {name: p.metadata.uid for name, p in self.pods(job).items()}

    def running(self, job: str, count: int) -> dict[str, client.V1Pod] | None:
        pods = self.pods(job)
        live = {
            n: p
            for n, p in pods.items()
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        }
        return live if len(live) == count and len(pods) == count else None

    def fail_pod(self, name: str, reason: str = "Error") -> None:
        self.core.patch_namespaced_pod_status(
            name, self.ns, {"status": {"phase": "Failed", "reason": reason}}
        )

    def ready_node(self, name: str) -> bool:
        """Whether node `name` reports Ready."""
        conditions = self.core.read_node(name).status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    def delete_nodes(self, names: list[str]) -> None:
        """Delete the nodes a test made (those already gone are no error)."""
        for name in names:
            try:
                self.core.delete_node(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def events(self, job: str, reason: str) -> list[client.CoreV1Event]:
        items = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={job},reason={reason}"
        ).items
        return list(items)


@pytest.fixture
def kube(api: client.ApiClient, ns: str, operator: OperatorProcess) -> Iterator[Cluster]:
    """The test's namespace. Afterwards every job status the test read from the API server
    gets the GitOps health docs/operator.md promises, from the chart's Argo CD health script
    and from the real kstatus library (tests/unit/test_argocd_health.py and
    tests/k8s/test_kstatus.py hold a status of every phase)."""
    cluster = Cluster(api, ns)
    yield cluster
    _assert_gitops_health(cluster.seen)


def test_three_stage_job_runs_on_its_planned_pools(kube: Cluster, model_dir: Path) -> None:
    from relaytrain_contract import StageConfig

    kube.create_job(_job("llm", model_dir).build())
    pods = wait_for("3 running stage pods", lambda: kube.running("llm", 3))
    status = wait_for(
        "phase Running", lambda: (s := kube.status("llm")).get("phase") == "Running" and s
    )
    plan = status["plan"]["stages"]
    assert [s["index"] for s in plan] == [0, 1, 2]
    assert plan[0]["layerStart"] == 0 and plan[-1]["layerEnd"] == 30
    assert kube.condition("llm")["status"] == "True"
    assert status["observedGeneration"] == kube.job("llm")["metadata"]["generation"]

    for stage in plan:
        k = stage["index"]
        pod = pods[f"llm-stage-{k}"]
        node = kube.core.read_node(pod.spec.node_name)
        # Pinned to the pool its plan names, and it landed there.
        assert pod.spec.node_selector["relaytrain.io/pool"] == stage["pool"]
        assert node.metadata.labels["relaytrain.io/pool"] == stage["pool"]
        assert pod.spec.hostname == f"llm-stage-{k}" and pod.spec.subdomain == "llm"
        assert pod.spec.restart_policy == "Never"
        assert pod.spec.automount_service_account_token is False
        container = pod.spec.containers[0]
        assert container.resources.requests["nvidia.com/gpu"] == "1"
        assert "memory" in container.resources.requests
        assert container.security_context.read_only_root_filesystem is True
        assert container.security_context.run_as_non_root is True
        assert container.security_context.capabilities.drop == ["ALL"]
        assert pod.metadata.owner_references[0].kind == "FineTuneJob"
        env = {e.name: e for e in container.env}
        from relaytrain_contract import LINK_CREDENTIALS_DIR

        # Each pod mounts the CA and only its own certificate and key from the link Secret,
        # where the worker reads them (and finds them renewed).
        (link,) = [v for v in pod.spec.volumes if v.secret is not None]
        assert link.secret.secret_name == "llm-link"
        assert {i.key: i.path for i in link.secret.items} == {
            "ca.crt": "ca.crt",
            f"p0-s{k}.crt": "tls.crt",
            f"p0-s{k}.key": "tls.key",
        }
        (mount,) = [m for m in container.volume_mounts if m.name == link.name]
        assert (mount.mount_path, mount.read_only) == (LINK_CREDENTIALS_DIR, True)
        # The worker parses what the operator wrote, with this stage's layers.
        config = StageConfig.from_json(env["RELAYTRAIN_STAGE_CONFIG"].value)
        assert (config.stage.index, config.stage.layer_start, config.stage.layer_end) == (
            k,
            stage["layerStart"],
            stage["layerEnd"],
        )
        if k < 2:
            assert config.links.next == f"llm-stage-{k + 1}.llm.{kube.ns}.svc:29500"

    service = kube.core.read_namespaced_service("llm", kube.ns)
    assert service.spec.cluster_ip == "None"
    assert service.spec.selector == {JOB_LABEL: "llm"}
    assert service.spec.publish_not_ready_addresses is True
    secret = kube.core.read_namespaced_secret("llm-link", kube.ns)
    assert sorted(secret.data) == [
        "ca.crt",
        *(f"p0-s{k}.{e}" for k in range(3) for e in ("crt", "key")),
    ]
    wait_for("a Planned event", lambda: kube.events("llm", "Planned"))


def test_a_failed_or_deleted_stage_is_replaced_alone(kube: Cluster, model_dir: Path) -> None:
    kube.create_job(_job("rep", model_dir).build())
    wait_for("3 running stage pods", lambda: kube.running("rep", 3))
    before = kube.uids("rep")

    kube.fail_pod("rep-stage-1")
    after = wait_for(
        "stage 1 replaced",
        lambda: (
            (u := kube.uids("rep")).get("rep-stage-1") not in (None, before["rep-stage-1"])
            and kube.running("rep", 3)
            and u
        ),
    )
    assert after["rep-stage-0"] == before["rep-stage-0"]
    assert after["rep-stage-2"] == before["rep-stage-2"]

    kube.core.delete_namespaced_pod("rep-stage-2", kube.ns)
    final = wait_for(
        "stage 2 replaced",
        lambda: (
            (u := kube.uids("rep")).get("rep-stage-2") not in (None, after["rep-stage-2"])
            and kube.running("rep", 3)
            and u
        ),
    )
    assert final["rep-stage-0"] == before["rep-stage-0"]
    assert final["rep-stage-1"] == after["rep-stage-1"]

    status = wait_for(
        "Running again", lambda: (s := kube.status("rep"))["phase"] == "Running" and s
    )
    assert [s["restarts"] for s in status["stages"]] == [0, 1, 1]
    assert status["restarts"] == 2
    assert [s.get("lastFailure") for s in status["stages"]] == [None, "Error", "Deleted"]
    wait_for("2 events", lambda: len(kube.events("rep", "StageRestarting")) == 2)


def test_two_pipelines_land_and_a_failed_stage_takes_out_its_pipeline_only(
    kube: Cluster, model_dir: Path, kube_cluster: Any
) -> None:
    from relaytrain_contract import StageConfig

    # A back-off holds the failed pipeline out long enough to see the job Degraded.
    kube.create_job(
        _job("fleet", model_dir)
        .pipeline(stages=2, replicas=2)
        .failure_policy(max_stage_restarts=3, backoff_seconds=4)
        .build()
    )
    pods = wait_for("4 running stage pods", lambda: kube.running("fleet", 4))
    assert sorted(pods) == ["fleet-p0-s0", "fleet-p0-s1", "fleet-p1-s0", "fleet-p1-s1"]
    status = wait_for(
        "2/2 pipelines", lambda: (s := kube.status("fleet")).get("readyPipelines") == "2/2" and s
    )
    assert status["phase"] == "Running" and kube.condition("fleet", "Degraded")["status"] == "False"
    plan = status["plan"]
    assert [len(p["stages"]) for p in plan["pipelines"]] == [2, 2]
    assert sum(p["microBatches"] for p in plan["pipelines"]) == 8
    assert [(p["index"], p["phase"], p["readyStages"]) for p in status["pipelines"]] == [
        (0, "Running", "2/2"),
        (1, "Running", "2/2"),
    ]
    for name, pod in pods.items():
        p, k = int(name[7]), int(name[10])
        labels = pod.metadata.labels
        assert (labels["relaytrain.io/pipeline"], labels["relaytrain.io/stage"]) == (str(p), str(k))
        assert pod.spec.hostname == name and pod.spec.subdomain == "fleet"
        stage = plan["pipelines"][p]["stages"][k]
        assert pod.spec.node_selector["relaytrain.io/pool"] == stage["pool"]
        env = {e.name: e for e in pod.spec.containers[0].env}
        (link,) = [v for v in pod.spec.volumes if v.secret is not None]
        assert {i.path: i.key for i in link.secret.items}["tls.crt"] == f"p{p}-s{k}.crt"
        config = StageConfig.from_json(env["RELAYTRAIN_STAGE_CONFIG"].value)
        assert config.replicas is not None and config.replicas.pipeline == p
        assert (config.stage.layer_start, config.stage.layer_end) == (
            stage["layerStart"],
            stage["layerEnd"],
        )
        for peer in config.replicas.peers:
            if peer.pipeline > p:
                assert (
                    peer.address
                    == f"fleet-p{peer.pipeline}-s{peer.stage}.fleet.{kube.ns}.svc:29501"
                )
    secret = kube.core.read_namespaced_secret("fleet-link", kube.ns)
    assert sorted(secret.data) == [
        "ca.crt",
        *(f"p{p}-s{k}.{e}" for p in range(2) for k in range(2) for e in ("crt", "key")),
    ]
    # `kubectl get ftj` shows the pipelines.
    table = kube_cluster.kubectl("get", "ftj", "fleet", "-n", kube.ns).stdout.splitlines()
    assert "PIPELINES" in table[0].split() and "2/2" in table[1].split()

    before = kube.uids("fleet")
    kube.fail_pod("fleet-p1-s0")
    degraded = wait_for(
        "Degraded", lambda: (c := kube.condition("fleet", "Degraded")).get("status") == "True" and c
    )
    assert "pipeline 1 is recovering" in degraded["message"]
    out = kube.status("fleet")
    assert out["phase"] == "Running" and out["readyPipelines"] == "1/2"
    assert [p["phase"] for p in out["pipelines"]] == ["Running", "Recovering"]
    after = wait_for(
        "p1/s0 replaced",
        lambda: (
            (u := kube.uids("fleet")).get("fleet-p1-s0") not in (None, before["fleet-p1-s0"])
            and kube.running("fleet", 4)
            and u
        ),
    )
    # The other pipeline, and the failed one's other stage, were never touched.
    for name in ("fleet-p0-s0", "fleet-p0-s1", "fleet-p1-s1"):
        assert after[name] == before[name]
    wait_for("whole again", lambda: kube.condition("fleet", "Degraded").get("status") == "False")
    final = kube.status("fleet")
    assert [p["restarts"] for p in final["pipelines"]] == [0, 1]
    assert [(s.get("pipeline"), s["index"], s["restarts"]) for s in final["stages"]] == [
        (0, 0, 0),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 0),
    ]
    event = wait_for("a StageRestarting event", lambda: kube.events("fleet", "StageRestarting"))
    assert "Stage p1/s0 pod fleet-p1-s0 ended (Error)" in event[0].message


def test_repeated_failures_fail_the_job_exactly_at_the_policy(
    kube: Cluster, model_dir: Path, operator: OperatorProcess
) -> None:
    kube.create_job(_job("flaky", model_dir).failure_policy(max_stage_restarts=2).build())
    wait_for("3 running stage pods", lambda: kube.running("flaky", 3))
    for restart in (1, 2):
        uid = kube.uids("flaky")["flaky-stage-0"]
        kube.fail_pod("flaky-stage-0")
        wait_for(
            f"replacement {restart}",
            lambda uid=uid: kube.running("flaky", 3) and kube.uids("flaky")["flaky-stage-0"] != uid,
        )
        status = kube.status("flaky")
        assert status["phase"] != "Failed"
        assert status["stages"][0]["restarts"] == restart
    kube.fail_pod("flaky-stage-0")
    wait_for("phase Failed", lambda: kube.status("flaky").get("phase") == "Failed")
    ready = kube.condition("flaky")
    assert (ready["status"], ready["reason"]) == ("False", "BackoffLimitExceeded")
    assert "maxStageRestarts is 2" in ready["message"]
    wait_for("the stage pods removed", lambda: not kube.pods("flaky"))
    wait_for(
        "a BackoffLimitExceeded event",
        lambda: kube.events("flaky", "BackoffLimitExceeded"),
    )
    # A finished job has no loop of its own: while the operator passes three times over
    # another job (one that never gets pods), the failed one gets no pass, stays Failed and
    # gets no pods back.
    kube.create_job(_job("clock", model_dir).placement(pools=["tpu-v5"]).build())
    operator.wait_for_passes(kube.ns, "clock", more=1)
    done = operator.passes(kube.ns, "flaky")
    operator.wait_for_passes(kube.ns, "clock", more=3)
    assert operator.passes(kube.ns, "flaky") == done
    assert kube.status("flaky")["phase"] == "Failed" and not kube.pods("flaky")


def test_an_unschedulable_job_gets_a_condition_and_no_pods(
    kube: Cluster, model_dir: Path, operator: OperatorProcess
) -> None:
    # The local fleet has two V100s; a three-stage job limited to them cannot fit.
    kube.create_job(_job("big", model_dir).placement(pools=["v100"]).model(dtype="float16").build())
    ready = wait_for(
        "Unschedulable", lambda: (c := kube.condition("big")).get("reason") == "Unschedulable" and c
    )
    assert ready["status"] == "False"
    assert "3" in ready["message"] and "GPU" in ready["message"]
    wait_for("an Unschedulable event", lambda: kube.events("big", "Unschedulable"))
    operator.wait_for_passes(kube.ns, "big", more=3)  # the periodic checks find no room either
    assert not kube.pods("big")
    assert kube.status("big")["phase"] == "Pending"


def test_link_certificates_renew_in_three_phases_and_no_stage_restarts(
    kube: Cluster, model_dir: Path
) -> None:
    """Certificates of a minute, renewed at 10% of it: the Secret passes through its three
    phases a propagation delay apart (1 s here), the pods stay, and the status and one
    Event say so (what each phase holds, and that stages link across them: unit tests)."""
    from cryptography import x509

    job = _job("certs", model_dir).link_certificates(lifetime_seconds=60, renew_at_percent=10)
    kube.create_job(job.build())
    wait_for("3 running stage pods", lambda: kube.running("certs", 3))
    uids = kube.uids("certs")
    first = kube.core.read_namespaced_secret("certs-link", kube.ns)
    seen: list[str] = []

    def renewed() -> Any:
        secret = kube.core.read_namespaced_secret("certs-link", kube.ns)
        notes = secret.metadata.annotations or {}
        phase = (
            f"{notes.get('relaytrain.io/link-generation')}:{notes.get('relaytrain.io/link-phase')}"
        )
        if not seen or seen[-1] != phase:
            seen.append(phase)
        return phase == "1:Current" and secret

    secret = wait_for("the certificates renewed once", renewed, timeout=60, interval=0.1)
    assert seen == ["0:Current", "0:Trusting", "1:Switching", "1:Current"], seen
    files = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    assert sorted(files) == sorted(first.data)  # nothing staged is left
    (ca,) = x509.load_pem_x509_certificates(files["ca.crt"].encode())
    for k in range(3):
        cert = x509.load_pem_x509_certificate(files[f"p0-s{k}.crt"].encode())
        cert.verify_directly_issued_by(ca)
        assert files[f"p0-s{k}.crt"] != base64.b64decode(first.data[f"p0-s{k}.crt"]).decode()
    # The status says the same (until the next renewal, 6 s after this one began).
    status = wait_for(
        "the status at generation 1, Current",
        lambda: (
            (s := kube.status("certs")).get("linkCertificates", {}).get("phase") == "Current"
            and s["linkCertificates"]["generation"] == 1
            and s
        ),
        interval=0.1,
    )
    when = ca.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert status["linkCertificates"]["notAfter"] == when
    assert kube.uids("certs") == uids
    assert kube.status("certs")["restarts"] == 0
    wait_for(
        "a LinkCertificatesRenewed event", lambda: kube.events("certs", "LinkCertificatesRenewed")
    )


def test_suspend_removes_pods_and_resume_brings_them_back(kube: Cluster, model_dir: Path) -> None:
    kube.create_job(_job("sus", model_dir).build())
    wait_for("3 running stage pods", lambda: kube.running("sus", 3))
    plan = kube.status("sus")["plan"]

    kube.patch_spec("sus", {"suspend": True})
    wait_for("pods removed", lambda: not kube.pods("sus"))
    wait_for("phase Suspended", lambda: kube.status("sus").get("phase") == "Suspended")
    assert kube.condition("sus", "Progressing")["status"] == "False"

    kube.patch_spec("sus", {"suspend": False})
    wait_for("3 running stage pods", lambda: kube.running("sus", 3))
    status = wait_for("Running", lambda: (s := kube.status("sus"))["phase"] == "Running" and s)
    # Resumed on the same plan (same layers), and a suspension is no failure.
    assert status["plan"] == plan
    assert status["restarts"] == 0


def test_deleting_the_job_removes_everything_it_owns(
    kube: Cluster, model_dir: Path, operator: OperatorProcess
) -> None:
    kube.create_job(_job("gone", model_dir).build())
    wait_for("3 running stage pods", lambda: kube.running("gone", 3))
    wait_for("a pass of the job counted", lambda: operator.passes(kube.ns, "gone") > 0)
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.ns, PLURAL, "gone")

    def all_gone() -> bool:
        services = kube.core.list_namespaced_service(kube.ns).items
        secrets = [
            s
            for s in kube.core.list_namespaced_secret(kube.ns).items
            if s.metadata.name == "gone-link"
        ]
        jobs = kube.custom.list_namespaced_custom_object(GROUP, VERSION, kube.ns, PLURAL)
        return not (kube.pods("gone") or services or secrets or jobs["items"])

    wait_for("the job and its children gone", all_gone, timeout=60)
    # And its series in the operator's metrics (one per job would otherwise pile up).
    wait_for(
        "its pass counter gone",
        lambda: operator.metric(PASSES, namespace=kube.ns, finetunejob="gone") is None,
    )


class _TwoPools:
    """Two stages (fixed) of job `name` on a pool of two RTX 4090 nodes (`lost`), pool `spare`
    (A100s, no node yet) allowed too; `created`: the nodes made, deleted by the test."""

    def __init__(self, kube: Cluster, api: client.ApiClient, name: str) -> None:
        self.lost = {
            "name": f"{kube.ns}-{name}-a", "product": "NVIDIA-GeForce-RTX-4090",
            "gpuMemoryMiB": 24564, "cpu": "16", "memory": "64Gi", "linkBandwidthMbps": 500,
            "linkLatencyMs": 30,
        }  # fmt: skip
        self.spare = {**self.lost, "name": f"{kube.ns}-{name}-b",
                      "product": "NVIDIA-A100-SXM4-40GB", "gpuMemoryMiB": 40960}  # fmt: skip
        nodes = [kwok_nodes.node_manifest(self.lost, i) for i in range(2)]
        kwok_nodes.create_nodes(api, nodes)
        self.created = [n["metadata"]["name"] for n in nodes]
        self.api = api

    def start(self, kube: Cluster, model_dir: Path, name: str) -> dict[str, client.V1Pod]:
        """Create the job; its two pods once they run."""
        pools = [self.lost["name"], self.spare["name"]]
        kube.create_job(_job(name, model_dir).pipeline(stages=2).placement(pools=pools).build())
        return wait_for("2 running stage pods", lambda: kube.running(name, 2))  # type: ignore[no-any-return]

    def stage_1_moved(self, kube: Cluster, name: str, node: str, before: dict[str, str]) -> None:
        """Waits for stage 1 running on `node` of the spare pool, stage 0 untouched (its pod
        the one of `before`, the pods' uids before the move)."""
        moved = wait_for(
            f"stage 1 on {node}",
            lambda: (p := kube.running(name, 2)) and p[f"{name}-stage-1"].spec.node_name == node
            and p,
            timeout=45,
        )  # fmt: skip
        assert kube.uids(name)[f"{name}-stage-0"] == before[f"{name}-stage-0"]
        selector = moved[f"{name}-stage-1"].spec.node_selector
        assert selector["relaytrain.io/pool"] == self.spare["name"]

    def spare_joins(self) -> str:
        """A node of the spare pool joins; its name."""
        node = kwok_nodes.node_manifest(self.spare, 0)
        kwok_nodes.create_nodes(self.api, [node])
        self.created.append(node["metadata"]["name"])
        return str(node["metadata"]["name"])


def test_a_lost_node_moves_its_stage_to_a_pool_with_room(
    kube: Cluster, model_dir: Path, api: client.ApiClient
) -> None:
    two = _TwoPools(kube, api, "mv")
    spare = two.spare
    try:
        pods = two.start(kube, model_dir, "mv")
        before = kube.uids("mv")
        # A larger-memory pool appears; then the node under stage 1 disappears while
        # stage 0 holds the pool's only other GPU.
        spare_node = two.spare_joins()
        # Appeared means Ready (kwok marks it a moment later): only a Ready node is eligible.
        wait_for("the spare node Ready", lambda: kube.ready_node(spare_node))
        kube.core.delete_node(pods["mv-stage-1"].spec.node_name)

        two.stage_1_moved(kube, "mv", spare_node, before)
        status = wait_for(
            "status shows the move",
            lambda: (
                (s := kube.status("mv"))["stages"][1].get("pool") == spare["name"]
                and s["phase"] == "Running"
                and s
            ),
        )
        assert status["stages"][1]["restarts"] == 1
        assert status["stages"][1]["lastFailure"] == "NodeLost"
    finally:
        kube.delete_nodes(two.created)


def test_a_waiting_replacement_moves_to_a_node_that_joins_another_pool(
    kube: Cluster, model_dir: Path, api: client.ApiClient
) -> None:
    """Two stages (fixed) on a pool of two RTX 4090s, another pool allowed; the node under
    stage 1 disappears with no GPU free anywhere, so its replacement waits (a re-split onto
    the one GPU left cannot hold two stages). An A100 node joins the other pool: the waiting
    replacement moves there alone, stage 0 untouched, and the move is no restart."""
    two = _TwoPools(kube, api, "wt")
    lost, spare = two.lost, two.spare
    try:
        pods = two.start(kube, model_dir, "wt")
        before = kube.uids("wt")
        kube.core.delete_node(pods["wt-stage-1"].spec.node_name)
        waiting = wait_for(
            "stage 1's replacement waiting",
            lambda: (c := kube.condition("wt"))["reason"] == "Unschedulable" and c,
        )
        assert f"waits for a GPU on pool {lost['name']}" in waiting["message"], waiting
        spare_node = two.spare_joins()
        two.stage_1_moved(kube, "wt", spare_node, before)
        (event,) = kube.events("wt", "StageMoving")
        assert f"pool {spare['name']} has one free" in event.message, event.message
        status = wait_for("status shows the move", lambda: (
            (s := kube.status("wt"))["phase"] == "Running" and s))  # fmt: skip
        assert status["stages"][1]["restarts"] == 1  # the node lost; the move is none
        assert status["stages"][1]["pool"] == spare["name"]
    finally:
        kube.delete_nodes(two.created)


def test_a_replacement_with_no_gpu_left_has_its_pipeline_resplit_onto_what_is_left(
    kube: Cluster, api: client.ApiClient, minio_server: Any, operator: OperatorProcess
) -> None:
    """A Llama-3.1-8B job over a pool of three A100s (`stages: auto`, fast links: one stage
    per GPU); the node under its last stage disappears and no GPU
    is free anywhere. The replacement waits as long as a re-split costs (--join-seconds),
    then the job is re-planned with one stage fewer on the GPUs it still holds: the old pods
    go, the new plan's are created, each recording the new split. An A100 then joins the
    pool, with many steps left: the job is re-split back to three stages (predicted 9,005
    tokens/s against 7,397), and the plan no longer records the one it replaced."""
    pool = {
        "name": f"{kube.ns}-r", "product": "NVIDIA-A100-SXM4-40GB", "gpuMemoryMiB": 40960,
        "cpu": "16", "memory": "64Gi", "linkBandwidthMbps": 10000, "linkLatencyMs": 1,
    }  # fmt: skip
    nodes = [kwok_nodes.node_manifest(pool, i) for i in range(3)]
    names = [n["metadata"]["name"] for n in nodes]
    kwok_nodes.create_nodes(api, nodes)
    try:
        for name in names:  # the plan is made for the GPUs of Ready nodes
            wait_for(f"{name} Ready", lambda name=name: kube.ready_node(name))
        # As many stages as Ready GPUs the operator's node index held when it planned: a
        # Ready update may reach it after the job (then another job is made once the first
        # one's pods are gone), and three stages make the re-split below two.
        for attempt in range(5):
            name = f"rs{attempt}"
            job = _on_the_store(kube, minio_server, name, LLAMA31_8B_CONFIG)
            kube.create_job(job.pipeline(stages="auto").placement(pools=[pool["name"]]).build())
            planned = wait_for("a plan", lambda n=name: kube.status(n).get("plan"))["stages"]
            if len(planned) == 3:
                break
            kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.ns, PLURAL, name)
            wait_for("its pods gone", lambda n=name: not kube.pods(n))
        assert len(planned) == 3 and {s["pool"] for s in planned} == {pool["name"]}, planned
        pods = wait_for("3 running stage pods", lambda: kube.running(name, 3))
        before = kube.uids(name)
        kube.core.delete_node(pods[f"{name}-stage-2"].spec.node_name)  # no GPU is free anywhere
        wait_for(
            "stage 2's replacement waiting for a GPU",
            lambda: kube.condition(name).get("reason") == "Unschedulable",
            timeout=30,
        )
        event = wait_for("a Replanned event", lambda: kube.events(name, "Replanned"), timeout=60)
        assert "2 stages" in event[0].message and "instead of 3 stages" in event[0].message
        after = wait_for("2 running stage pods of the new plan", lambda: kube.running(name, 2))
        status = wait_for("status Running on the new plan",
                          lambda: (s := kube.status(name))["phase"] == "Running" and s)  # fmt: skip
        plan = status["plan"]["stages"]
        assert [(s["layerStart"], s["layerEnd"]) for s in plan] == [(0, 17), (17, 32)]
        # Every pod is new (each stage holds other layers now) and records the split.
        assert not set(kube.uids(name).values()) & set(before.values())
        assert {p.metadata.annotations["relaytrain.io/split"] for p in after.values()} == {
            "0-17,17-32"
        }
        assert [s["restarts"] for s in status["stages"]] == [0, 0]
        assert status["plan"]["resplitFrom"]["stages"] == 3
        changes = "relaytrain_pipeline_changes_total"
        assert (operator.metric(changes, namespace=kube.ns, change="replanned") or 0) == 1

        # An A100 joins, with 99,950 steps left: the job goes back to three stages.
        put_json(minio_server, f"ckpt/{kube.ns}/{name}/progress.json", {
            "step": 50, "totalSteps": 100_000, "loss": 2.5, "tokensPerSecond": 7000.0,
            "lastCommittedStep": 50, "updatedAt": "2026-11-22T10:00:00Z", "done": False,
        })  # fmt: skip
        joined = kwok_nodes.node_manifest(pool, 3)
        names.append(joined["metadata"]["name"])
        kwok_nodes.create_nodes(api, [joined])
        back = wait_for(
            "a Replanned event back to three stages",
            lambda: [e for e in kube.events(name, "Replanned") if "re-split back" in e.message],
            timeout=90,
        )
        assert "3 stages" in back[0].message and "instead of 2 stages" in back[0].message
        wait_for("3 running stage pods of the plan back", lambda: kube.running(name, 3))
        status = wait_for("status Running on the plan back",
                          lambda: (s := kube.status(name))["phase"] == "Running" and s)  # fmt: skip
        assert len(status["plan"]["stages"]) == 3 and "resplitFrom" not in status["plan"]
        assert (operator.metric(changes, namespace=kube.ns, change="replanned") or 0) == 2
    finally:
        kube.delete_nodes(names)


def test_a_cordoned_node_takes_its_pipeline_out_and_a_new_node_brings_it_back(
    kube: Cluster, model_dir: Path, api: client.ApiClient
) -> None:
    """A drain's cordon is a planned departure: the pipeline with a stage on the node
    leaves (its pods go, no restart counted, a PipelineLeaving Event) while the other
    trains on untouched. It waits for room, since the node is no longer eligible; a node
    that joins the pool brings it back (PipelineAdded), its stages on free GPUs."""
    pool = {
        "name": f"{kube.ns}-g",
        "product": "NVIDIA-A100-SXM4-40GB",
        "gpuMemoryMiB": 40960,
        "cpu": "16",
        "memory": "64Gi",
    }
    nodes = [kwok_nodes.node_manifest(pool, i) for i in range(5)]
    kwok_nodes.create_nodes(api, nodes[:4])
    created = [n["metadata"]["name"] for n in nodes]
    try:
        kube.create_job(
            _job("follow", model_dir)
            .pipeline(stages=2, replicas=2)
            .placement(pools=[pool["name"]])
            .build()
        )
        pods = wait_for("4 running stage pods", lambda: kube.running("follow", 4))
        # The pods can run before the status lists the pipelines (a probe that read
        # status.pipelines as soon as they ran once found none, 2026-12-04).
        wait_for("2/2 pipelines", lambda: kube.status("follow").get("readyPipelines") == "2/2")
        before = kube.uids("follow")
        drained = pods["follow-p1-s1"].spec.node_name
        kube.core.patch_node(drained, {"spec": {"unschedulable": True}})
        left = wait_for(
            "pipeline 1 left",
            lambda: (s := kube.status("follow"))["pipelines"][1]["phase"] == "Left" and s,
        )
        assert left["phase"] == "Running" and left["restarts"] == 0
        assert left["pipelines"][1]["leftReason"] == (
            f"node {drained} is cordoned (a drain or maintenance)"
        )
        wait_for(
            "its pods gone", lambda: set(kube.pods("follow")) == {"follow-p0-s0", "follow-p0-s1"}
        )
        assert kube.uids("follow") == {n: before[n] for n in ("follow-p0-s0", "follow-p0-s1")}
        (leaving,) = wait_for("PipelineLeaving", lambda: kube.events("follow", "PipelineLeaving"))
        assert f"Pipeline 1 leaves at step 0: node {drained} is cordoned" in leaving.message
        # One GPU of the pool is free, pipeline 1 needs two: it waits, Degraded.
        assert kube.condition("follow", "Degraded")["status"] == "True"
        kwok_nodes.create_nodes(api, nodes[4:])
        back = wait_for("pipeline 1 back", lambda: kube.running("follow", 4), timeout=60)
        assert drained not in {p.spec.node_name for p in back.values()}
        for name in ("follow-p0-s0", "follow-p0-s1"):
            assert back[name].metadata.uid == before[name]
        status = wait_for(
            "pipeline 1 running again",
            lambda: (s := kube.status("follow"))["pipelines"][1]["phase"] == "Running" and s,
        )
        assert status["pipelines"][1]["returns"] == 1 and status["restarts"] == 0
        (added,) = kube.events("follow", "PipelineAdded")
        assert "Pipeline 1 comes back after step 0 (it left at step 0: node" in added.message
    finally:
        kube.delete_nodes(created)


def test_operator_restart_creates_no_duplicates_and_keeps_status(
    kube: Cluster, model_dir: Path, operator: OperatorProcess
) -> None:
    kube.create_job(_job("keep", model_dir).build())
    wait_for("3 running stage pods", lambda: kube.running("keep", 3))
    kube.fail_pod("keep-stage-2")
    wait_for(
        "stage 2 replaced",
        lambda: kube.status("keep")["stages"][2]["restarts"] == 1 and kube.running("keep", 3),
    )
    status = kube.status("keep")

    operator.kill()
    try:
        # While the operator is down: a stage fails, and a new job arrives.
        kube.fail_pod("keep-stage-0")
        kube.create_job(_job("late", model_dir).pipeline(stages=2).build())
    finally:
        operator.start()
    wait_for(
        "stage 0 replaced",
        lambda: kube.status("keep")["stages"][0]["restarts"] == 1 and kube.running("keep", 3),
    )
    wait_for("the new job's pods", lambda: kube.running("late", 2))

    # Killed again in the middle of creating a job's pods.
    kube.create_job(_job("mid", model_dir).pipeline(stages=2).build())
    wait_for("a first pod", lambda: kube.pods("mid"), timeout=15)
    operator.kill()
    operator.start()
    wait_for("the job's pods", lambda: kube.running("mid", 2))

    # Several periodic checks of each job by the restarted operator change nothing.
    operator.wait_for_passes(kube.ns, "keep", "late", "mid", more=3)
    after = kube.status("keep")
    assert after["plan"] == status["plan"] and after["startTime"] == status["startTime"]
    assert [s["restarts"] for s in after["stages"]] == [1, 0, 1]
    wait_for("2 events", lambda: len(kube.events("keep", "StageRestarting")) == 2)
    for job, count in (("keep", 3), ("late", 2), ("mid", 2)):
        assert len(kube.pods(job)) == count, job


def test_metrics_report_jobs_passes_and_no_errors(
    kube: Cluster, model_dir: Path, operator: OperatorProcess
) -> None:
    kube.create_job(_job("met", model_dir).build())
    wait_for("Running", lambda: kube.status("met").get("phase") == "Running")
    wait_for(
        "a Running job in the metrics",
        lambda: (operator.metric("relaytrain_jobs", phase="Running") or 0) >= 1,
    )
    operator.wait_for_passes(kube.ns, "met", more=1)
    assert operator.metric("relaytrain_reconcile_errors_total") == 0
    assert (operator.metric("relaytrain_reconcile_duration_seconds_count") or 0) > 0
    assert operator.alive()


def put_json(minio: Any, key: str, value: dict[str, Any]) -> None:
    import io

    data = json.dumps(value).encode()
    minio.client().put_object(minio.bucket, key, io.BytesIO(data), len(data))


def _on_the_store(kube: Cluster, minio: Any, name: str, config: dict[str, Any]) -> Job:
    """Job `name` (`_job`) on the store in `minio`: the model's `config` and a data set
    there, checkpoints and progress there, its keys in Secret `s3` of the test's namespace."""
    with contextlib.suppress(client.ApiException):
        kube.core.create_namespaced_secret(
            kube.ns,
            {
                "metadata": {"name": "s3"},
                "stringData": {
                    "AWS_ACCESS_KEY_ID": minio.access_key,
                    "AWS_SECRET_ACCESS_KEY": minio.secret_key,
                },
            },
        )
    put_json(minio, f"models/{kube.ns}/{name}/config.json", config)
    put_json(minio, f"data/{kube.ns}.jsonl", {"prompt": "q", "completion": "a"})
    return (
        _job(name, f"s3://{minio.bucket}/models/{kube.ns}/{name}/")
        .dataset(f"s3://{minio.bucket}/data/{kube.ns}.jsonl")
        .checkpoint(f"s3://{minio.bucket}/ckpt", endpoint=minio.url)
        .credentials("s3")
    )


def test_progress_from_the_store_is_reported_and_completion_succeeds(
    kube: Cluster, minio_server: Any
) -> None:
    minio = minio_server
    # The operator plans from the model's config.json in the store, read with the job's keys,
    # and looks at the data set there before any pod exists.
    kube.create_job(_on_the_store(kube, minio, "prog", MODEL_CONFIG).build())
    pods = wait_for("3 running stage pods", lambda: kube.running("prog", 3))
    env = {e.name: e for e in pods["prog-stage-0"].spec.containers[0].env}
    assert env["AWS_SECRET_ACCESS_KEY"].value_from.secret_key_ref.name == "s3"
    assert minio.secret_key not in json.dumps(
        kube.core.api_client.sanitize_for_serialization(pods["prog-stage-0"])
    )

    key = f"ckpt/{kube.ns}/prog/progress.json"
    put_json(
        minio,
        key,
        {
            "step": 10,
            "totalSteps": 100,
            "loss": 2.5,
            "tokensPerSecond": 800.0,
            "lastCommittedStep": 10,
            "updatedAt": "2026-11-22T10:00:00Z",
            "done": False,
        },
    )
    progress = wait_for(
        "progress in status",
        lambda: (p := kube.status("prog").get("progress") or {}).get("step") == 10 and p,
    )
    assert progress["stepOfTotal"] == "10/100"
    assert (progress["loss"], progress["tokensPerSecond"]) == (2.5, 800.0)
    assert progress["lastCommittedStep"] == 10 and progress["eta"] > "2026-11-22T10:00:00Z"

    # A replaced stage restores from the last committed step.
    kube.fail_pod("prog-stage-1")
    stage = wait_for(
        "stage 1 replaced",
        lambda: (
            (s := kube.status("prog")["stages"][1]).get("restarts") == 1
            and kube.running("prog", 3)
            # The count is patched before the pod is replaced, the restore step with the
            # replacement: wait for the pass that created it.
            and "restoredFromStep" in s
            and s
        ),
    )
    assert stage["restoredFromStep"] == 10

    put_json(
        minio,
        key,
        {
            "step": 100,
            "totalSteps": 100,
            "loss": 1.9,
            "tokensPerSecond": 810.0,
            "lastCommittedStep": 100,
            "updatedAt": "2026-11-22T10:30:00Z",
            "done": True,
            "output": f"s3://{minio.bucket}/adapters/prog/",
        },
    )
    status = wait_for("Succeeded", lambda: (s := kube.status("prog"))["phase"] == "Succeeded" and s)
    assert status["output"]["uri"] == f"s3://{minio.bucket}/adapters/prog/"
    assert status["progress"]["step"] == 100 and "completionTime" in status
    ready = kube.condition("prog")
    assert (ready["status"], ready["reason"]) == ("True", "Succeeded")
    assert kube.condition("prog", "Progressing")["status"] == "False"
    wait_for("the stage pods removed", lambda: not kube.pods("prog"))
    wait_for("a Succeeded event", lambda: kube.events("prog", "Succeeded"))


# (case, the field set in a valid job (DELETE: removed) and its value, who refuses it: "api" =
# the API server answers 422, else the reason of the Ready=False condition the operator sets).
INVALID = [
    ("missing-model", "spec.model", DELETE, "api"),
    ("missing-dataset", "spec.dataset", DELETE, "api"),
    ("negative-steps", "spec.training.steps", -5, "api"),
    ("unknown-compression", "spec.pipeline.compression", "zstd", "api"),
    ("lora-rank-0", "spec.method.rank", 0, "api"),
    ("dataset-format-csv", "spec.dataset.format", "csv", "api"),
    ("steps-and-epochs", "spec.training.epochs", 2, "api"),
    ("neither-steps-nor-epochs", "spec.training.steps", DELETE, "api"),
    ("warmup-beyond-steps", "spec.training.warmupSteps", 500, "api"),
    ("zero-stages", "spec.pipeline.stages", 0, "api"),
    ("stages-not-a-number", "spec.pipeline.stages", "many", "api"),
    ("http-model-uri", "spec.model.uri", "http://example.com/m", "api"),
    ("endpoint-for-local-store", "spec.checkpoint.endpoint", "http://m:9000", "api"),
    ("dropout-above-one", "spec.method.dropout", 1.5, "api"),
    ("zero-learning-rate", "spec.training.learningRate", 0, "api"),
    ("zero-micro-batch", "spec.training.microBatchSize", 0, "api"),
    ("int8-dtype", "spec.model.dtype", "int8", "api"),
    ("no-target-modules", "spec.method.targetModules", [], "api"),
    ("repeated-target-module", "spec.method.targetModules", ["q_proj"] * 2, "api"),
    ("keep-no-checkpoints", "spec.checkpoint.keep", 0, "api"),
    ("negative-restarts", "spec.failurePolicy.maxStageRestarts", -1, "api"),
    ("unknown-method", "spec.method.type", "prefix", "api"),
    ("unknown-schedule", "spec.pipeline.schedule", "gpipe", "api"),
    (
        "bad-toleration-effect",
        "spec.placement.tolerations",
        [{"key": "a", "effect": "Sometimes"}],
        "api",
    ),
    # Accepted by the API server, refused by the operator:
    (
        "target-not-a-linear-layer",
        "spec.method.targetModules",
        ["lm_head"],
        "InvalidSpec",
    ),
    ("more-pipelines-than-gpus", "spec.pipeline.replicas", 6, "Unschedulable"),
    ("hub-model-without-hub", "spec.model.uri", "hf://org/name", "ModelUnavailable"),
    ("model-without-config", "spec.model.uri", "/nonexistent/model", "ModelUnavailable"),
    ("more-stages-than-layers", "spec.pipeline.stages", 40, "Unschedulable"),
    ("unknown-pool", "spec.placement.pools", ["tpu-v5"], "Unschedulable"),
]


@pytest.mark.parametrize(
    ("case", "path", "value", "refused_by"), INVALID, ids=[c[0] for c in INVALID]
)
def test_an_invalid_job_is_refused_without_pods(
    kube: Cluster,
    model_dir: Path,
    operator: OperatorProcess,
    case: str,
    path: str,
    value: Any,
    refused_by: str,
) -> None:
    job = _job(case, model_dir)
    manifest = (job.unset(path) if value is DELETE else job.set(path, value)).build()
    if refused_by == "api":
        with pytest.raises(ApiException) as refused:
            kube.create_job(manifest)
        assert refused.value.status == 422
    else:
        kube.create_job(manifest)
        ready = wait_for(
            refused_by, lambda: (c := kube.condition(case)).get("reason") == refused_by and c
        )
        assert ready["status"] == "False" and ready["message"]
        wait_for(f"a {refused_by} event", lambda: kube.events(case, refused_by))
        operator.wait_for_passes(kube.ns, case, more=2)  # periodic checks later, still no pods
    assert not kube.pods(case)
    assert operator.alive()


def test_the_model_and_pipeline_of_a_started_job_cannot_change(
    kube: Cluster, model_dir: Path, operator: OperatorProcess
) -> None:
    kube.create_job(_job("fixed", model_dir).build())
    wait_for("3 running stage pods", lambda: kube.running("fixed", 3))
    before = kube.uids("fixed")
    for change in (
        {"model": {"uri": "/other/model"}},
        {"pipeline": {"stages": 2}},
        {"dataset": {"uri": "s3://data/other.jsonl"}},
    ):
        with pytest.raises(ApiException) as refused:
            kube.patch_spec("fixed", change)
        assert refused.value.status == 422, change
    operator.wait_for_passes(kube.ns, "fixed", more=2)  # periodic checks of the unchanged spec
    assert kube.uids("fixed") == before


def _expected_health(obj: dict[str, Any]) -> str:
    """What Argo CD should show for a job, from docs/operator.md "GitOps health"."""
    status = obj.get("status") or {}
    if "phase" not in status:
        return "Progressing"
    if status.get("observedGeneration", 0) < obj["metadata"]["generation"]:
        return "Progressing"
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    phase = status["phase"]
    reasons = {c["type"]: c.get("reason") for c in status.get("conditions") or []}
    if phase == "Suspended" and reasons.get("Ready") in ("Inadmissible", "KueueNotInstalled"):
        return "Degraded"
    if phase in ("Succeeded", "Suspended"):
        return "Healthy" if phase == "Succeeded" else "Suspended"
    if phase == "Failed" or conditions.get("Stalled") == "True":
        return "Degraded"
    if phase == "Running" and conditions.get("Degraded") == "True":
        given_up = any(p["phase"] == "Failed" for p in status.get("pipelines") or [])
        return "Degraded" if given_up else "Progressing"
    return "Healthy" if phase == "Running" else "Progressing"


def _assert_gitops_health(objects: list[dict[str, Any]]) -> None:
    """Argo CD's health script and the real kstatus library (kstatus-check) on the job
    objects a test read: each says what docs/operator.md "GitOps health" promises."""
    from relaytrain_testkit.harness.argocd_health import health
    from relaytrain_testkit.harness.kstatus import expected_kstatus, kstatus

    for obj in objects:
        got, message = health(obj)
        assert got == _expected_health(obj), (obj.get("status"), got, message)
    for obj, (got, message) in zip(objects, kstatus(objects) if objects else [], strict=True):
        assert got == expected_kstatus(obj), (obj.get("status"), got, message)


def test_the_chart_grants_exactly_what_this_operator_called(
    kube_cluster: Any, identity: ChartIdentity, operator: OperatorProcess
) -> None:
    """Last in this module on purpose: the API server's audit log now holds every request
    this module's operator made while the tests above created, replaced, failed, suspended,
    resumed, completed, moved, refused and deleted jobs, and restarted it. The chart must
    grant each call it made (no 403) and nothing it never made. Run alone, nothing above
    has run, and it lists the grants those tests would have used."""
    crd = yaml.safe_load((REPO / "crds" / "finetunejobs.relaytrain.io.yaml").read_text())
    names = crd["spec"]["names"]
    plurals = {(crd["spec"]["group"], names["kind"]): names["plural"]}
    user = service_account_user(identity.namespace, identity.account)
    calls = calls_of(kube_cluster.component_log("audit"), user, plurals)
    assert calls.used, f"no request of {user} in the audit log"
    assert calls.refused == [], "the API server refused the operator: the chart lacks a grant"
    granted = granted_to(identity.rbac, identity.namespace, identity.account)
    assert granted == calls.used, explain(granted - calls.used, calls.used - granted)
