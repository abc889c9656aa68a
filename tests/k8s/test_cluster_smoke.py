"""The local cluster behaves like a real one: what our operator relies on, checked directly."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from relaytrain_testkit.harness.waiting import wait_for

from hack import toolpaths

pytestmark = pytest.mark.k8s
REPO = Path(__file__).resolve().parents[2]


def test_the_built_binaries_report_their_pins() -> None:
    """The cache this session's cluster runs from holds exactly the pinned builds (here, not
    in the unit tier: `make test-fast` installs Python alone, `make deps` builds these)."""
    env = {**os.environ, "RELAYTRAIN_CACHE": str(toolpaths.cache_dir())}
    proc = subprocess.run(
        ["bash", "hack/build-go-binaries.sh", "verify"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def core(kube_cluster: Any) -> client.CoreV1Api:
    return client.CoreV1Api(kube_cluster.api_client())


@pytest.fixture
def namespace(core: client.CoreV1Api) -> Iterator[str]:
    name = f"smoke-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for("default service account", lambda: _has_default_sa(core, name))
    yield name
    core.delete_namespace(name)


def _has_default_sa(core: client.CoreV1Api, ns: str) -> bool:
    try:
        core.read_namespaced_service_account("default", ns)
    except ApiException:
        return False
    return True


def gpu_pod(name: str, product: str, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": product},
            "containers": [
                {
                    "name": "main",
                    "image": "relaytrain/worker:dev",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
            **extra,
        },
    }


def test_api_server_reports_pinned_version(kube_cluster: Any) -> None:
    info = client.VersionApi(kube_cluster.api_client()).get_code()
    assert info.git_version == toolpaths.versions()["KUBERNETES_VERSION"]
    assert kube_cluster.kubectl("version", "-o", "json").returncode == 0


def test_gpu_pools_are_labelled_nodes(core: client.CoreV1Api, kube_cluster: Any) -> None:
    nodes = core.list_node().items
    by_product: dict[str, int] = {}
    for node in nodes:
        product = node.metadata.labels.get("nvidia.com/gpu.product")
        if product:
            by_product[product] = by_product.get(product, 0) + 1
            assert node.status.allocatable["nvidia.com/gpu"] == "1"
    expected = {p["product"]: int(p["nodes"]) for p in kube_cluster.pools}
    assert by_product == expected


def test_gpu_pod_lands_on_requested_pool(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, gpu_pod("on-4090", "NVIDIA-GeForce-RTX-4090"))

    def running() -> Any:
        pod = core.read_namespaced_pod("on-4090", namespace)
        return pod if pod.status.phase == "Running" else None

    pod = wait_for("the pod to run", running)
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-GeForce-RTX-4090"


def test_unknown_gpu_type_stays_pending(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, gpu_pod("nowhere", "NVIDIA-B200"))

    def failed_scheduling() -> Any:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=nowhere"
        ).items
        return [e for e in events if e.reason == "FailedScheduling"]

    events = wait_for("a FailedScheduling event", failed_scheduling)
    assert "didn't match Pod's node affinity/selector" in events[0].message
    assert core.read_namespaced_pod("nowhere", namespace).status.phase == "Pending"


def test_garbage_collector_deletes_owned_pods(core: client.CoreV1Api, namespace: str) -> None:
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    for i in range(2):
        pod = gpu_pod(f"owned-{i}", "NVIDIA-A100-SXM4-40GB")
        pod["metadata"]["ownerReferences"] = [ref]
        core.create_namespaced_pod(namespace, pod)
    assert len(core.list_namespaced_pod(namespace).items) == 2

    core.delete_namespaced_config_map("owner", namespace)
    wait_for("owned pods to be deleted", lambda: not core.list_namespaced_pod(namespace).items)


def test_node_reported_not_ready_is_tainted_and_its_pods_evicted(
    core: client.CoreV1Api, namespace: str
) -> None:
    # The pod tolerates a not-ready node for 1 s only, so eviction follows soon after the
    # node lifecycle controller taints the node.
    tolerations = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 1}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    core.create_namespaced_pod(
        namespace, gpu_pod("doomed", "Tesla-V100-SXM2-16GB", tolerations=tolerations)
    )
    pod = wait_for(
        "the pod to run",
        lambda: (
            (p := core.read_namespaced_pod("doomed", namespace)).status.phase == "Running" and p
        ),
    )
    node_name = pod.spec.node_name
    set_node_ready(core, node_name, ready=False)
    try:

        def tainted() -> Any:
            node = core.read_node(node_name)
            return "node.kubernetes.io/not-ready" in {t.key for t in node.spec.taints or []}

        wait_for("the node lifecycle controller to taint the node", tainted, timeout=60)

        def evicted() -> bool:
            try:
                p = core.read_namespaced_pod("doomed", namespace)
            except ApiException as exc:
                return exc.status == 404
            return p.metadata.deletion_timestamp is not None

        wait_for("the pod to be evicted", evicted, timeout=60)
    finally:
        set_node_ready(core, node_name, ready=True)
        wait_for(
            "the taint to be lifted",
            lambda: not (core.read_node(node_name).spec.taints or []),
            timeout=60,
        )


def set_node_ready(core: client.CoreV1Api, node_name: str, *, ready: bool) -> None:
    """Posts the node's Ready condition as its kubelet would (kwok leaves it alone meanwhile)."""
    if ready:
        core.patch_node(node_name, {"metadata": {"annotations": {"kwok.x-k8s.io/status": None}}})
        return
    core.patch_node(node_name, {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {
        "type": "Ready",
        "status": "False",
        "reason": "KubeletNotReady",
        "message": "container runtime is down",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    core.patch_node_status(node_name, {"status": {"conditions": [condition]}})
