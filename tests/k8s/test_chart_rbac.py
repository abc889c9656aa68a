"""The Helm chart with the real helm and the real API server: it lints, renders, the API
server accepts every rendered object, and the rendered RBAC grants the operator what it
needs and nothing it does not (checked by impersonating its ServiceAccount)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "relaytrain"
RELEASE = "rt"


def helm_binary() -> Path:
    """RELAYTRAIN_HELM, else the bootstrap's pinned build in the cache."""
    if os.environ.get("RELAYTRAIN_HELM"):
        return Path(os.environ["RELAYTRAIN_HELM"])
    from hack import toolpaths

    return toolpaths.binary("helm")


def helm(*args: str) -> str:
    proc = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def render(namespace: str, *sets: str) -> list[dict[str, Any]]:
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("template", RELEASE, str(CHART), "--namespace", namespace, *flags)
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize(
    "sets",
    [(), ("watchNamespaces={a,b}", "peering.enabled=true", "gpuCatalog.X.tflops=1")],
    ids=["defaults", "namespaced-peering-catalog"],
)
def test_helm_lint_passes(sets: tuple[str, ...]) -> None:
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("lint", "--strict", str(CHART), *flags)
    assert "0 chart(s) failed" in out


def test_values_outside_the_schema_are_refused() -> None:
    proc = subprocess.run(
        [str(helm_binary()), "template", RELEASE, str(CHART), "--set", "replicas=3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "replicas" in proc.stderr


def test_crd_switches() -> None:
    kinds = [d["kind"] for d in render("ops")]
    assert kinds.count("CustomResourceDefinition") == 1
    (crd,) = [d for d in render("ops") if d["kind"] == "CustomResourceDefinition"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (crd,) = [
        d for d in render("ops", "crds.keep=false") if d["kind"] == "CustomResourceDefinition"
    ]
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})
    assert "CustomResourceDefinition" not in [
        d["kind"] for d in render("ops", "crds.enabled=false")
    ]
    # The rendered CRD is the source CRD (plus labels and the keep annotation).
    source = yaml.safe_load((REPO / "crds" / "finetunejobs.relaytrain.io.yaml").read_text())
    assert crd["spec"] == source["spec"]


def _apply(kube_cluster: Any, docs: list[dict[str, Any]], *flags: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump_all(docs, handle)
    try:
        kube_cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", *flags, "-f", handle.name
        )
    finally:
        os.unlink(handle.name)


def test_the_api_server_accepts_every_rendered_object(kube_cluster: Any) -> None:
    namespace = f"rt-chart-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", namespace)
    docs = render(namespace, "gpuCatalog.X.tflops=1")
    _apply(kube_cluster, docs, "--dry-run=server")


def _can(kube_cluster: Any, sa: str, verb: str, resource: str, namespace: str | None) -> bool:
    # "kind/name" would ask about an object named name; "kind#sub" asks about a subresource.
    resource, _, sub = resource.partition("#")
    args = ["auth", "can-i", verb, resource, "--as", sa]
    args += ["--subresource", sub] if sub else []
    args += ["-n", namespace] if namespace else []
    out = kube_cluster.kubectl(*args, check=False).stdout.strip()
    return out == "yes"


NEEDED = [
    ("get", "finetunejobs.relaytrain.io"),
    ("list", "finetunejobs.relaytrain.io"),
    ("watch", "finetunejobs.relaytrain.io"),
    ("patch", "finetunejobs.relaytrain.io"),
    ("patch", "finetunejobs.relaytrain.io#status"),
    ("update", "finetunejobs.relaytrain.io#finalizers"),
    ("create", "pods"),
    ("delete", "pods"),
    ("watch", "pods"),
    ("create", "services"),
    ("delete", "services"),
    ("create", "secrets"),
    ("get", "secrets"),
    ("delete", "secrets"),
    ("create", "events"),
]
CLUSTER_NEEDED = [("list", "nodes"), ("watch", "nodes"), ("list", "pods")]
NEVER = [
    ("delete", "nodes"),
    ("patch", "nodes"),
    ("create", "clusterroles"),
    ("create", "rolebindings"),
    ("delete", "namespaces"),
    ("create", "deployments.apps"),
    ("delete", "finetunejobs.relaytrain.io"),
    ("create", "finetunejobs.relaytrain.io"),
    ("patch", "pods"),
    ("update", "secrets"),
    ("create", "pods#exec"),
    ("update", "finetunejobs.relaytrain.io#scale"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
]


def _install_rbac(kube_cluster: Any, *sets: str) -> tuple[str, str]:
    # can-i answers "no" for a resource the API server does not know: install the CRD first.
    crd = REPO / "crds" / "finetunejobs.relaytrain.io.yaml"
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/finetunejobs.relaytrain.io", "--timeout=60s"
    )
    namespace = f"rt-rbac-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", namespace)
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "RoleBinding"}
    release = f"rt-{uuid.uuid4().hex[:6]}"
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("template", release, str(CHART), "--namespace", namespace, *flags)
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] in rbac_kinds]
    for doc in docs:  # RoleBindings go to watched namespaces, which must exist
        if doc["kind"] == "RoleBinding":
            kube_cluster.kubectl("create", "namespace", doc["metadata"]["namespace"], check=False)
    _apply(kube_cluster, docs)
    sa = f"system:serviceaccount:{namespace}:{release}-relaytrain"
    return namespace, sa


def test_cluster_wide_rbac_grants_exactly_what_the_operator_needs(kube_cluster: Any) -> None:
    _, sa = _install_rbac(kube_cluster)
    missing = [(v, r) for v, r in NEEDED if not _can(kube_cluster, sa, v, r, "team-a")]
    missing += [(v, r) for v, r in CLUSTER_NEEDED if not _can(kube_cluster, sa, v, r, None)]
    assert missing == []
    extra = [(v, r) for v, r in NEVER if _can(kube_cluster, sa, v, r, "team-a")]
    assert extra == []


def test_namespaced_rbac_stays_in_the_watched_namespaces(kube_cluster: Any) -> None:
    watched = f"team-{uuid.uuid4().hex[:6]}"
    _, sa = _install_rbac(kube_cluster, f"watchNamespaces={{{watched}}}")
    assert [(v, r) for v, r in NEEDED if not _can(kube_cluster, sa, v, r, watched)] == []
    assert [(v, r) for v, r in CLUSTER_NEEDED if not _can(kube_cluster, sa, v, r, None)] == []
    # Outside the watched namespace: no Secrets, no pod creation.
    for verb, resource in [
        ("get", "secrets"),
        ("create", "pods"),
        ("patch", "finetunejobs.relaytrain.io"),
    ]:
        assert not _can(kube_cluster, sa, verb, resource, "kube-system"), (verb, resource)
