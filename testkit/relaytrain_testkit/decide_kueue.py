"""A queued job's Kueue Workloads as Kueue leaves them, for the decision's tests: the job
queued, its Workload (or a pipeline's) with Kueue's conditions and admission, the flavours,
and `observed` with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from relaytrain_operator.loop.decide import Decision, Observed, needs

from relaytrain_testkit.decide_cases import JOB, PLAN, T_RUNNING, observed

QUEUED = JOB.queue("team")
"""The job, queued for Kueue's LocalQueue `team`."""


def workload_of(
    job: dict[str, Any],
    *conditions: tuple[str, str, str, str],
    active: bool = True,
    pipeline: int | None = None,
) -> dict[str, Any]:
    """The job's Workload (or its pipeline `pipeline`'s) as Kueue left it: (type, status,
    reason, message) conditions; an admission (a100 → flavor fa, rtx → fr) while
    QuotaReserved is True."""
    from relaytrain_operator.domain.queueing import StageDemand, build_workload

    stages = (
        PLAN["stages"]
        if pipeline is None
        else job["status"]["plan"]["pipelines"][pipeline]["stages"]
    )
    demands = [
        StageDemand(s["pool"], {"relaytrain.io/pool": s["pool"]}, s["predictedMemoryBytes"])
        for s in stages
    ]
    wl = build_workload(job, demands, active=active, pipeline=pipeline)
    wl["metadata"].update(uid="wl-uid", generation=1)
    wl["status"] = {
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": T_RUNNING}
            for t, s, r, m in conditions
        ]
    }
    if any(t == "QuotaReserved" and s == "True" for t, s, _, _ in conditions):
        wl["status"]["admission"] = {
            "clusterQueue": "cq",
            "podSetAssignments": [
                {"name": "a100", "count": 1, "flavors": {"nvidia.com/gpu": "fa", "memory": "fa"}},
                {"name": "rtx", "count": 1, "flavors": {"nvidia.com/gpu": "fr"}},
            ],
        }
    return wl


ADMITTED = (
    ("QuotaReserved", "True", "QuotaReserved", "ok"),
    ("Admitted", "True", "Admitted", "ok"),
)
PENDING = (
    (
        "QuotaReserved",
        "False",
        "Pending",
        "couldn't assign flavors to pod set a100: insufficient unused quota for "
        "nvidia.com/gpu in flavor fa, 1 more needed",
    ),
)
EVICTED = (
    *ADMITTED,
    (
        "Evicted",
        "True",
        "Preempted",
        "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue",
    ),
)
FLAVORS = {
    "fa": {
        "metadata": {"name": "fa"},
        "spec": {
            "nodeLabels": {"relaytrain.io/pool": "a100", "tier": "gold"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "fr": {
        "metadata": {"name": "fr"},
        "spec": {"nodeLabels": {"relaytrain.io/pool": "rtx", "tier": "silver"}},
    },
}


def kobserved(
    job: dict[str, Any],
    pods: Sequence[dict[str, Any]] = (),
    workload: dict[str, Any] | None = None,
    *,
    priority: int | None = None,
    workloads: dict[int, dict[str, Any]] | None = None,
    **kw: Any,
) -> Observed:
    """`observed` of a queued job with its one `workload` (or its pipelines' `workloads`),
    their layout read from their labels as the operator reads it."""
    from relaytrain_operator.domain.queueing import by_pipeline

    base = observed(job, list(pods), **kw)
    assert needs(job, base.pods).workload, "a queued job's pass reads its Workload"
    found = [*(workloads or {}).values(), *([workload] if workload else [])]
    layout, by = by_pipeline(found)
    return replace(
        base,
        workloads=by,
        workloads_per_pipeline=layout,
        flavors=FLAVORS if base.cluster_pods is not None else {},
        priority=priority,
    )


def applied(decision: Decision) -> list[Any]:
    from relaytrain_operator.loop.actions import ApplyWorkloadStatus

    return [a for a in decision.actions if isinstance(a, ApplyWorkloadStatus)]
