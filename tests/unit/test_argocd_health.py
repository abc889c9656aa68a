"""The chart's Argo CD health check (charts/relaytrain/files/argocd/health.lua), run with a
real Lua runtime on statuses the operator's own status code writes, one per phase; the k8s
tier runs it on the statuses of real jobs (tests/k8s/test_operator.py)."""

from __future__ import annotations

from typing import Any

import pytest
from relaytrain_testkit.harness.argocd_health import SCRIPT, health
from relaytrain_testkit.health_cases import CASES, job

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("case", "obj", "expected"), CASES, ids=[c[0] for c in CASES])
def test_health_of_every_phase(case: str, obj: dict[str, Any], expected: str) -> None:
    status, message = health(obj)
    assert status == expected, (case, message)
    assert message


def test_the_message_is_the_operators_own() -> None:
    assert health(job("Failed", "InvalidSpec")) == ("Degraded", "InvalidSpec says why")
    assert health(job("Pending", "Unschedulable"))[1] == "Unschedulable says why"


@pytest.mark.parametrize(
    ("phase", "wrong"),
    [("Running", "Failed"), ("Succeeded", "Recovering"), ("Suspended", "Running")],
)
def test_a_status_changed_to_the_wrong_phase_changes_the_health(phase: str, wrong: str) -> None:
    obj = job(phase, "x", ready=phase != "Suspended")
    right = health(obj)[0]
    obj["status"]["phase"] = wrong
    assert health(obj)[0] != right


def test_the_chart_ships_the_script_that_is_tested() -> None:
    assert SCRIPT.parent.parent.parent.name == "relaytrain"
    assert "resource.customizations.health.relaytrain.io_FineTuneJob" in SCRIPT.read_text()
