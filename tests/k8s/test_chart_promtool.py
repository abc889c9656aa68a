"""The chart's alert rules with the real promtool (built by the bootstrap from
github.com/prometheus/prometheus at its pin): `promtool check rules` on the rendered
PrometheusRule, and `promtool test rules` with one unit test per alert — series that must
fire it (with its labels and summary) beside series that must not. The same tests against
rules rendered with other thresholds fail: they read the thresholds, not just the names."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_testkit.harness.chart_rbac import render_chart

from hack import toolpaths

pytestmark = pytest.mark.k8s

NS = "team-a"
J = {"namespace": NS, "job": "llama"}


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _alert(name: str, labels: dict[str, str], summary: str) -> dict[str, Any]:
    return {
        "exp_labels": {"severity": "warning", **labels},
        "exp_annotations": {"summary": summary},
    }


# One promtool test group per alert: (alert, series, [(eval time, alerts expected)]).
UNIT_TESTS: dict[str, dict[str, Any]] = {
    "RelaytrainJobStalled": {
        "interval": "1m",
        "input_series": [
            # Steps for 5 minutes, then none for 20, of a 40-step job: stalled.
            _series("relaytrain_step", {**J, "stage": "0"}, "0+1x5 5x20"),
            _series("relaytrain_total_steps", {**J, "stage": "0"}, "40x25"),
            # A finished job (its last step reached) does not count as stalled.
            _series("relaytrain_step", {"namespace": NS, "job": "done", "stage": "0"}, "40x25"),
            _series(
                "relaytrain_total_steps", {"namespace": NS, "job": "done", "stage": "0"}, "40x25"
            ),
        ],
        "alert_rule_test": [
            {"eval_time": "12m", "alertname": "RelaytrainJobStalled", "exp_alerts": []},
            {
                "eval_time": "18m",
                "alertname": "RelaytrainJobStalled",
                "exp_alerts": [
                    _alert(
                        "RelaytrainJobStalled",
                        J,
                        f"FineTuneJob {NS}/llama made no step in 10 minutes",
                    )
                ],
            },
        ],
    },
    "RelaytrainStagesRestarting": {
        "interval": "1m",
        "input_series": [
            # Five restarts in ten minutes in team-a, one in team-b.
            _series("relaytrain_stage_restarts_total", {"namespace": NS}, "0 1 2 3 4 5x10"),
            _series("relaytrain_stage_restarts_total", {"namespace": "team-b"}, "0 1x15"),
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "RelaytrainStagesRestarting", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "RelaytrainStagesRestarting",
                "exp_alerts": [
                    _alert(
                        "RelaytrainStagesRestarting",
                        {"namespace": NS},
                        f"5 stage restarts in the last hour in {NS}",
                    )
                ],
            },
        ],
    },
    "RelaytrainCheckpointOld": {
        "interval": "1m",
        "input_series": [
            # Training every minute; commits stop after 5 minutes.
            _series("relaytrain_step", {**J, "stage": "0"}, "0+1x60"),
            _series("relaytrain_last_committed_step", {**J, "stage": "0"}, "0+1x5 5x55"),
            # Another job commits all along.
            _series("relaytrain_step", {"namespace": NS, "job": "ok", "stage": "0"}, "0+1x60"),
            _series(
                "relaytrain_last_committed_step",
                {"namespace": NS, "job": "ok", "stage": "0"},
                "0+1x60",
            ),
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "RelaytrainCheckpointOld", "exp_alerts": []},
            {
                "eval_time": "40m",
                "alertname": "RelaytrainCheckpointOld",
                "exp_alerts": [
                    _alert(
                        "RelaytrainCheckpointOld",
                        J,
                        f"FineTuneJob {NS}/llama trains without a commit for 30 minutes",
                    )
                ],
            },
        ],
    },
    "RelaytrainLinkThroughputCollapsed": {
        "interval": "1m",
        "input_series": [
            # 60 kB a minute for an hour, then 60 bytes a minute, while the job trains.
            _series(
                "relaytrain_link_sent_bytes_total",
                {**J, "pipeline": "0", "stage": "0", "link": "next"},
                "0+60000x60 3600000+60x30",
            ),
            _series("relaytrain_step", {**J, "stage": "0"}, "0+1x90"),
            # The same collapse on a job that does not train (finished) does not alert.
            _series(
                "relaytrain_link_sent_bytes_total",
                {"namespace": NS, "job": "idle", "pipeline": "0", "stage": "0", "link": "next"},
                "0+60000x60 3600000+60x30",
            ),
            _series("relaytrain_step", {"namespace": NS, "job": "idle", "stage": "0"}, "40x90"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "60m",
                "alertname": "RelaytrainLinkThroughputCollapsed",
                "exp_alerts": [],
            },
            {
                "eval_time": "75m",
                "alertname": "RelaytrainLinkThroughputCollapsed",
                "exp_alerts": [
                    _alert(
                        "RelaytrainLinkThroughputCollapsed",
                        {**J, "pipeline": "0", "stage": "0", "link": "next"},
                        f"Link next of {NS}/llama stage 0 fell below 0.1 of its hourly rate",
                    )
                ],
            },
        ],
    },
}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(toolpaths.binary("promtool")), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _rules(tmp_path: Path, *values: str) -> Path:
    docs = render_chart(
        "mon", "relaytrain-system", "monitoring.prometheusRule.enabled=true", *values
    )
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def _unit_test(tmp_path: Path, alert: str) -> Path:
    group = UNIT_TESTS[alert]
    path = tmp_path / f"test-{alert}.yaml"
    path.write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [group]}
        )
    )
    return path


def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    rules = _rules(tmp_path)
    proc = promtool("check", "rules", rules.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = [r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
    assert f"SUCCESS: {len(alerts)} rules found" in proc.stdout + proc.stderr
    assert sorted(alerts) == sorted(UNIT_TESTS), "every alert has its unit test"


@pytest.mark.parametrize("alert", sorted(UNIT_TESTS))
def test_each_alert_fires_when_it_should_and_only_then(tmp_path: Path, alert: str) -> None:
    _rules(tmp_path)
    proc = promtool("test", "rules", _unit_test(tmp_path, alert).name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


# Thresholds under which none of the series above fires its alert.
LOOSE = {
    "RelaytrainJobStalled": "monitoring.prometheusRule.stalledMinutes=20",
    "RelaytrainStagesRestarting": "monitoring.prometheusRule.restartsPerHour=10",
    "RelaytrainCheckpointOld": "monitoring.prometheusRule.checkpointAgeMinutes=50",
    # --set would pass the number as a string (helm converts only integers and booleans).
    "RelaytrainLinkThroughputCollapsed": (
        "--set-json=monitoring.prometheusRule.linkCollapseRatio=0.0001"
    ),
}


@pytest.mark.parametrize("alert", sorted(UNIT_TESTS))
def test_the_unit_tests_fail_against_other_thresholds(tmp_path: Path, alert: str) -> None:
    _rules(tmp_path, LOOSE[alert])
    proc = promtool("test", "rules", _unit_test(tmp_path, alert).name, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert alert in proc.stdout + proc.stderr
