"""The chart's monitoring objects as `helm template` renders them: off by default; when on,
a ServiceMonitor that selects the operator's metrics Service by its port name, a PodMonitor
that selects the stage pods the operator builds by their label and port name, in the watched
namespaces, keeping their `job` label; the four alerts with the thresholds the values give;
the Grafana dashboard ConfigMap with its sidecar label. (That every metric the alerts and
the dashboard query is one a real run exports: tests/e2e/test_operator_e2e.py.)"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_testkit.harness.chart_rbac import render_chart
from relaytrain_testkit.stage_pods import pod_for

from hack import toolpaths

pytestmark = pytest.mark.k8s

MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
ALL_ON = (
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.podMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.grafanaDashboard.enabled=true",
)


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def _dashboards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "relaytrain.json" in d.get("data", {})]


def test_nothing_is_rendered_unless_asked() -> None:
    docs = render_chart("mon", "relaytrain-system")
    assert not [d for d in docs if d["kind"] in MONITORING_KINDS] and not _dashboards(docs)
    # A ServiceMonitor needs the metrics Service.
    off = render_chart("mon", "relaytrain-system", "metrics.enabled=false", *ALL_ON)
    assert not [d for d in off if d["kind"] == "ServiceMonitor"]


def test_the_monitors_select_the_operator_service_and_the_stage_pods() -> None:
    docs = render_chart("mon", "relaytrain-system", *ALL_ON, "watchNamespaces={team-a,team-b}",
                        "monitoring.labels.release=prom")  # fmt: skip
    service = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")
    )
    monitor = _one(docs, "ServiceMonitor")
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert selected == service["spec"]["selector"]  # the operator pod's own labels
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [
        p["name"] for p in service["spec"]["ports"]
    ]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    pods = _one(docs, "PodMonitor")
    assert pods["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert pods["spec"]["selector"]["matchExpressions"] == [
        {"key": JOB_LABEL, "operator": "Exists"}
    ]
    endpoint = pods["spec"]["podMetricsEndpoints"][0]
    assert endpoint["honorLabels"] is True  # the stages' `job` label is the FineTuneJob
    # The stage pod the operator builds (its own builder) carries that label and port.
    stage = pod_for(1)
    assert JOB_LABEL in stage["metadata"]["labels"]
    ports = stage["spec"]["containers"][0]["ports"]
    assert endpoint["port"] in [p["name"] for p in ports]
    everywhere = _one(render_chart("mon", "relaytrain-system", *ALL_ON), "PodMonitor")
    assert everywhere["spec"]["namespaceSelector"] == {"any": True}


def test_the_alerts_carry_the_thresholds_of_the_values() -> None:
    docs = render_chart(
        "mon", "relaytrain-system", "monitoring.prometheusRule.enabled=true",
        "monitoring.prometheusRule.stalledMinutes=7", "monitoring.prometheusRule.restartsPerHour=5",
        "monitoring.prometheusRule.checkpointAgeMinutes=45",
        "--set-json=monitoring.prometheusRule.linkCollapseRatio=0.25",  # --set makes it a string
    )  # fmt: skip
    rules = {r["alert"]: r for g in _one(docs, "PrometheusRule")["spec"]["groups"]
             for r in g["rules"]}  # fmt: skip
    assert sorted(rules) == [
        "RelaytrainCheckpointOld", "RelaytrainJobStalled", "RelaytrainLinkThroughputCollapsed",
        "RelaytrainStagesRestarting",
    ]  # fmt: skip
    assert "changes(relaytrain_step[7m])" in rules["RelaytrainJobStalled"]["expr"]
    assert "7 minutes" in rules["RelaytrainJobStalled"]["annotations"]["summary"]
    assert rules["RelaytrainStagesRestarting"]["expr"].strip().endswith("> 5")
    assert (
        "changes(relaytrain_last_committed_step[45m])" in rules["RelaytrainCheckpointOld"]["expr"]
    )
    assert "< 0.25 *" in rules["RelaytrainLinkThroughputCollapsed"]["expr"]
    # Prometheus' own templating survives helm's.
    assert "{{ $labels.job }}" in rules["RelaytrainJobStalled"]["annotations"]["summary"]


def test_the_dashboard_ships_as_a_configmap_for_the_grafana_sidecar() -> None:
    docs = render_chart("mon", "relaytrain-system", "monitoring.grafanaDashboard.enabled=true")
    (board,) = _dashboards(docs)
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(board["data"]["relaytrain.json"])
    assert dashboard["uid"] == "relaytrain"
    titles = [p["title"] for p in dashboard["panels"]]
    for wanted in ("Tokens per second", "Loss and held-out loss", "Step", "Link bytes per second",
                   "Checkpoints", "Restarts and restores (per hour)"):  # fmt: skip
        assert wanted in titles
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "namespace", "job"]


def test_an_api_server_with_the_prometheus_operators_crds_takes_them_as_rendered(
    kube_cluster: Any, tmp_path: Path
) -> None:
    """The prometheus-operator's own CRDs (copied by the bootstrap out of its module at the
    pin of hack/versions.env) installed, the rendered ServiceMonitor, PodMonitor and
    PrometheusRule are created under strict field validation, so a field the operator's schema
    does not know fails here instead of being dropped; a misspelt one is refused."""
    crds = toolpaths.component_files("promoperator") / "example" / "prometheus-operator-crd"
    for plural in ("servicemonitors", "podmonitors", "prometheusrules"):
        path = crds / f"monitoring.coreos.com_{plural}.yaml"
        kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        kube_cluster.wait_established(f"{plural}.monitoring.coreos.com")
    namespace = f"rt-mon-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", namespace)
    docs = [
        d
        for d in render_chart("mon", namespace, *ALL_ON, "watchNamespaces={team-a}")
        if d["kind"] in MONITORING_KINDS
    ]
    assert {d["kind"] for d in docs} == MONITORING_KINDS
    rendered = tmp_path / "monitoring.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    kube_cluster.kubectl("create", "--validate=strict", "-f", str(rendered))
    stored = json.loads(
        kube_cluster.kubectl("get", "podmonitor", "-n", namespace, "-o", "json").stdout
    )["items"][0]
    assert stored["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    misspelt = _one(docs, "PodMonitor")
    misspelt["metadata"]["name"] += "-typo"
    misspelt["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(misspelt))
    refused = kube_cluster.kubectl(
        "create", "--validate=strict", "-f", str(tmp_path / "typo.yaml"), check=False
    )
    assert refused.returncode != 0 and "honourLabels" in refused.stderr, refused.stderr
