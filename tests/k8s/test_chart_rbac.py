"""The Helm chart with the real helm and the real API server: it lints, renders, the API
server accepts every rendered object, and the rendered RBAC grants the operator what it
needs and nothing it does not (checked by impersonating its ServiceAccount)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_testkit.harness.chart_rbac import PEERING_CRDS, chart_rbac_kubeconfig
from relaytrain_testkit.harness.operator_process import OperatorProcess
from relaytrain_testkit.harness.rbac_audit import (
    Permission,
    calls_of,
    explain,
    granted_to,
    service_account_user,
)
from relaytrain_testkit.harness.waiting import wait_for

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
    [
        (),
        (
            "watchNamespaces={a,b}",
            "peering.enabled=true",
            "gpuCatalog.X.tflops=1",
            "kueue.enabled=true",
        ),
    ],
    ids=["defaults", "namespaced-peering-catalog-kueue"],
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
    docs = render(namespace, "gpuCatalog.X.tflops=1", "kueue.enabled=true")
    _apply(kube_cluster, docs, "--dry-run=server")


def _can(kube_cluster: Any, sa: str, permission: Permission, namespace: str | None) -> bool:
    resource, _, sub = permission.resource.partition("/")
    resource += f".{permission.group}" if permission.group else ""
    args = ["auth", "can-i", permission.verb, resource, "--as", sa]
    args += ["--subresource", sub] if sub else []
    args += ["-n", namespace] if namespace else []
    out = kube_cluster.kubectl(*args, check=False).stdout.strip()
    return out == "yes"


# What the operator must never be able to do, whatever its code comes to call: a policy,
# not a record. (What it may do is derived from its calls: tests/k8s/test_operator.py
# fails on any grant its operator did not use, by the API server's audit log.)
NEVER = [
    Permission("", "nodes", "delete"),
    Permission("", "nodes", "patch"),
    Permission("rbac.authorization.k8s.io", "clusterroles", "create"),
    Permission("rbac.authorization.k8s.io", "rolebindings", "create"),
    Permission("", "namespaces", "delete"),
    Permission("apps", "deployments", "create"),
    Permission("relaytrain.io", "finetunejobs", "delete"),
    Permission("relaytrain.io", "finetunejobs", "create"),
    Permission("", "pods", "patch"),
    # Updating Secrets is granted (renewing a job's link Secret in place: RBAC cannot name
    # Secrets made at run time); reading them all, or deleting any, is not.
    Permission("", "secrets", "list"),
    Permission("", "secrets", "watch"),
    Permission("", "secrets", "delete"),
    Permission("", "secrets", "patch"),
    Permission("", "pods/exec", "create"),
    Permission("relaytrain.io", "finetunejobs/scale", "update"),
    Permission("apiextensions.k8s.io", "customresourcedefinitions", "delete"),
]
CLUSTER_SCOPED = {"nodes", "namespaces", "customresourcedefinitions", "clusterkopfpeerings"}


def _install_rbac(kube_cluster: Any, *sets: str) -> tuple[str, str, list[dict[str, Any]]]:
    # can-i answers "no" for a resource the API server does not know: install the CRD first.
    crd = REPO / "crds" / "finetunejobs.relaytrain.io.yaml"
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    kube_cluster.wait_established("finetunejobs.relaytrain.io")
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
    return namespace, release, docs


def _granted(namespace: str, release: str, docs: list[dict[str, Any]]) -> set[Permission]:
    granted = granted_to(docs, namespace, f"{release}-relaytrain")
    assert granted, "the rendered chart binds nothing to its ServiceAccount"
    return granted


def test_cluster_wide_rbac_is_in_force_and_never_more(kube_cluster: Any) -> None:
    namespace, release, docs = _install_rbac(kube_cluster)
    sa = service_account_user(namespace, f"{release}-relaytrain")
    # Every rendered grant works where the operator needs it: any namespace, or the cluster.
    denied = [
        p
        for p in sorted(_granted(namespace, release, docs))
        if not _can(kube_cluster, sa, p, None if p.resource in CLUSTER_SCOPED else "team-a")
    ]
    assert denied == []
    assert [p for p in NEVER if _can(kube_cluster, sa, p, "team-a")] == []


def test_namespaced_rbac_stays_in_the_watched_namespaces(kube_cluster: Any) -> None:
    watched = f"team-{uuid.uuid4().hex[:6]}"
    namespace, release, docs = _install_rbac(kube_cluster, f"watchNamespaces={{{watched}}}")
    sa = service_account_user(namespace, f"{release}-relaytrain")
    granted = _granted(namespace, release, docs)
    # The job role, bound by a RoleBinding in each watched namespace.
    in_namespaces = [d for d in docs if d["kind"] != "ClusterRoleBinding"]
    jobs = granted_to(in_namespaces, namespace, f"{release}-relaytrain")
    assert jobs, "the job-level grants should be bound in the watched namespace"
    assert [p for p in sorted(granted) if not _can(kube_cluster, sa, p, watched)] == []
    # Outside the watched namespace: nothing of the job role beyond the cluster-wide reads.
    cluster_wide = granted_to(
        [d for d in docs if d["kind"] != "RoleBinding"], namespace, f"{release}-relaytrain"
    )
    outside = sorted(jobs - cluster_wide)
    assert outside, "the job role should grant writes the cluster role does not"
    leaked = [p for p in outside if _can(kube_cluster, sa, p, "kube-system")]
    assert leaked == []
    assert [p for p in NEVER if _can(kube_cluster, sa, p, watched)] == []


@pytest.mark.parametrize("scope", ["namespaced", "clusterwide"])
def test_the_peering_grants_are_exactly_what_peering_operators_call(
    kube_cluster: Any, tmp_path: Path, scope: str
) -> None:
    """With `peering.enabled`, several replicas agree on one active operator through kopf's
    peering object. Run one replica as the chart's ServiceAccount until it has announced
    itself there and stopped (withdrawing itself); the audit log must show a call for every
    peering grant the chart adds, and no refusal."""
    kube_cluster.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    kube_cluster.wait_established("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
    _install_rbac(kube_cluster)  # the FineTuneJob CRD, which the operator watches
    tag = uuid.uuid4().hex[:6]
    watched = f"rtpeer-{tag}"
    kube_cluster.kubectl("create", "namespace", watched)
    watch = [watched] if scope == "namespaced" else []
    identity = chart_rbac_kubeconfig(
        kube_cluster,
        tmp_path / "operator.kubeconfig",
        release=f"rp{tag}",
        namespace=f"rtpeer-ops-{tag}",
        watch=watch,
        values=("peering.enabled=true", f"peering.name=rp{tag}"),
    )
    kind, where = ("KopfPeering", ["-n", watched]) if watch else ("ClusterKopfPeering", [])
    peering = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": f"rp{tag}"}}
    (tmp_path / "peering.yaml").write_text(yaml.safe_dump(peering))
    kube_cluster.kubectl("apply", *where, "-f", str(tmp_path / "peering.yaml"))

    args = ["--peering", f"rp{tag}"] + [a for ns in watch for a in ("--namespace", ns)]
    operator = OperatorProcess(identity.kubeconfig, tmp_path / "operator.log", *args)
    operator.start()

    def announced() -> bool:
        out = kube_cluster.kubectl("get", kind.lower(), f"rp{tag}", *where, "-o", "json").stdout
        return bool(json.loads(out).get("status"))

    try:
        wait_for("the operator's presence in its peering object", announced, timeout=60)
    finally:
        operator.stop()
    wait_for("its withdrawal", lambda: not announced(), timeout=30)

    granted = granted_to(identity.rbac, identity.namespace, identity.account)
    peering_grants = {p for p in granted if p.group == "kopf.dev"}
    assert peering_grants, "peering.enabled should grant the peering resource"
    calls = calls_of(
        kube_cluster.component_log("audit"),
        service_account_user(identity.namespace, identity.account),
        {},
    )
    assert calls.refused == []
    assert peering_grants - calls.used == set(), explain(peering_grants - calls.used, set())
