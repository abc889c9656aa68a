"""FineTuneJobs in every phase, their statuses written by the operator's own status code,
and what Argo CD's health check must say of each (tests/unit/test_argocd_health.py); the k8s
tier reads the same statuses with the real kstatus library (tests/k8s/test_kstatus.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from relaytrain_operator.domain.status import Verdict, to_manifest, with_verdict
from relaytrain_operator.spec import FineTuneJobStatus, PipelineStatus

from relaytrain_testkit.jobs import Job

NOW = datetime(2026, 11, 23, 10, 0, 0, tzinfo=UTC)
"""When every status here was written."""


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
    """A FineTuneJob `j` as stored, its status written by the operator's status code."""
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
    return Job("j").generation(generation).status(written).build()


CASES = [
    ("just created", Job("j").generation(1).build(), "Progressing"),
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
    ("labelled for a queue, no Kueue", job("Suspended", "KueueNotInstalled"), "Degraded"),
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
"""(case, the FineTuneJob, what Argo CD's health check must say of it): one per phase and
reason the operator writes."""
