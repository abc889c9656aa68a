"""The chart's Argo CD health check (charts/relaytrain/files/argocd/health.lua), run with a
real Lua runtime on statuses the operator's own status code writes, one per phase; the k8s
tier runs it on the statuses of real jobs (tests/k8s/test_operator.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from relaytrain_operator.domain.status import Verdict, to_manifest, with_verdict
from relaytrain_operator.spec import FineTuneJobStatus, PipelineStatus

from tests.harness.argocd_health import SCRIPT, health

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 23, 10, 0, 0, tzinfo=UTC)


def job(
    phase: str,
    reason: str,
    *,
    ready: bool = False,
    degraded: bool | None = None,
    pipelines: list[str] | None = None,
    generation: int = 3,
    observed: int = 3,
) -> dict[str, Any]:
    """A FineTuneJob as stored, its status written by the operator's status code."""
    status = FineTuneJobStatus()
    if pipelines is not None:
        status = status.model_copy(
            update={
                "pipelines": [
                    PipelineStatus(index=i, phase=p, ready_stages="2/2", micro_batches=4)  # type: ignore[arg-type]
                    for i, p in enumerate(pipelines)
                ]
            }
        )
    verdict = Verdict(phase, ready, True, reason, f"{reason} says why", degraded=degraded)
    written = to_manifest(with_verdict(status, verdict, NOW, observed))
    return {"metadata": {"name": "j", "generation": generation}, "status": written}


CASES = [
    ("just created", {"metadata": {"name": "j", "generation": 1}}, "Progressing"),
    ("planning", job("Planning", "Planned"), "Progressing"),
    ("starting", job("Pending", "StagesStarting"), "Progressing"),
    ("waiting for GPUs", job("Pending", "Unschedulable"), "Progressing"),
    ("training", job("Running", "StagesRunning", ready=True), "Healthy"),
    ("recovering a stage", job("Recovering", "StageRestarting"), "Progressing"),
    (
        "a pipeline being replaced",
        job(
            "Running",
            "PipelinesDegraded",
            ready=True,
            degraded=True,
            pipelines=["Running", "Recovering"],
        ),
        "Progressing",
    ),
    (
        "a pipeline given up",
        job(
            "Running",
            "PipelinesDegraded",
            ready=True,
            degraded=True,
            pipelines=["Running", "Failed"],
        ),
        "Degraded",
    ),
    (
        "every pipeline training",
        job(
            "Running",
            "StagesRunning",
            ready=True,
            degraded=False,
            pipelines=["Running", "Running"],
        ),
        "Healthy",
    ),
    ("suspended", job("Suspended", "Suspended"), "Suspended"),
    ("queued for Kueue's quota", job("Suspended", "WaitingForQuota"), "Suspended"),
    ("evicted by Kueue", job("Suspended", "Evicted"), "Suspended"),
    ("a Kueue queue that cannot admit it", job("Suspended", "Inadmissible"), "Degraded"),
    ("succeeded", job("Succeeded", "Succeeded", ready=True), "Healthy"),
    ("restarts used up", job("Failed", "BackoffLimitExceeded"), "Degraded"),
    ("invalid spec", job("Failed", "InvalidSpec"), "Degraded"),
    ("model unreadable", job("Pending", "ModelUnavailable"), "Degraded"),
    (
        "a spec change not yet seen",
        job("Running", "StagesRunning", ready=True, generation=4, observed=3),
        "Progressing",
    ),
]


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
