"""A job of one pipeline re-split when its replacement has waited for a GPU as long as a
re-split costs (domain/resplit.py has the rule and the plan; docs/operator.md, "A
replacement that cannot fit").

The new plan is written first, with fresh stage entries (each stage's restart count and
last failure kept, so a re-split never resets the failure budget), then every stage pod
goes. A pod carries its pipeline's split (`SPLIT_ANNOTATION`), so an operator that stops
between the two still replaces the pods of the old split on its next pass
(stages._verdict), and a pod of a stage the new plan does not have is removed
(`remove_unplanned`). The stages then start from the new plan and restore the last commit
by parameter name (the worker does that for any split).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.domain.planner import PlanError
from relaytrain_operator.domain.resplit import resplit_plan, resplit_wait, same_places
from relaytrain_operator.domain.status import Verdict, parse_time
from relaytrain_operator.loop.actions import DeletePod
from relaytrain_operator.loop.decide.context import (
    WAITING_ANNOTATION,
    JsonDict,
    Pass,
    planned_keys,
)
from relaytrain_operator.spec import FineTuneJob, PlanStatus, StageStatus

RESPLIT_PAUSE_SECONDS = 1.0
"""After a re-split, how soon the pass looks again (to create the pods once the old are gone)."""


def waiting_since(pods: Iterable[JsonDict]) -> datetime | None:
    """When the oldest of `pods` still waiting for a GPU (created with `WAITING_ANNOTATION`,
    not bound, not being deleted) was created; None when none waits (a pod without a
    creation time, never read back from the API server, has not waited)."""
    since: list[datetime] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if WAITING_ANNOTATION not in (meta.get("annotations") or {}):
            continue
        if (pod.get("spec") or {}).get("nodeName") or meta.get("deletionTimestamp"):
            continue
        created = parse_time(meta.get("creationTimestamp"))
        if created is not None:
            since.append(created)
    return min(since, default=None)


def resplit(ctx: Pass, spec: FineTuneJob, plan: PlanStatus) -> bool:
    """Re-split the job's one pipeline for the GPUs it can have, if a replacement has waited
    long enough and a plan fits; True when it did (the pass is over)."""
    if plan.several() or ctx.queue is not None:
        return False  # several pipelines: one out comes back (membership.py); Kueue: quota
    since = waiting_since(ctx.observed.pods.values())
    if since is None:
        return False
    wait = resplit_wait(since, ctx.now, ctx.settings.join_seconds)
    if wait:
        ctx.wake_within(wait.total_seconds())
        return False
    model, pods = ctx.observed.model, ctx.observed.cluster_pods
    if model is None or model.config is None or pods is None:
        return False  # needs() asks for both while a replacement waits
    others = [pod for pod in pods if not _ours(ctx, pod)]
    try:
        planned = resplit_plan(
            spec,
            model.config,
            ctx.observed.nodes.values(),
            others,
            stages_now=len(plan.stages),
            catalog=ctx.settings.catalog,
            default_link=ctx.settings.default_link,
        )
    except PlanError:
        return False  # nothing fits either: the replacement waits on, as its condition says
    recorded = PlanStatus.model_validate(planned)
    if same_places(plan.stages, recorded.stages):
        return False
    waited = int((ctx.now - since).total_seconds())
    kept = {s.index: s for s in ctx.status.stages}
    ctx.update(
        plan=recorded,
        stages=[
            fresh_entry(kept.get(s.index, StageStatus(index=s.index)), s.pool)
            for s in recorded.stages
        ],
    )
    ctx.patch()  # the plan first: pods of the old split are replaced even after a crash
    ctx.remove_pods()
    message = _message(plan, recorded, waited, ctx.settings.join_seconds)
    ctx.event("Normal", "Replanned", message)
    ctx.settle(Verdict("Recovering", False, True, "Replanned", message))
    ctx.wake_within(RESPLIT_PAUSE_SECONDS)
    return True


def remove_unplanned(ctx: Pass, plan: PlanStatus) -> None:
    """Delete the pods of stages the plan does not have (left by a re-split to fewer stages
    whose deletions did not all happen)."""
    planned = set(planned_keys(plan))
    for key, pod in sorted(ctx.observed.pods.items()):
        meta = pod["metadata"]
        if key not in planned and not meta.get("deletionTimestamp"):
            ctx.actions.append(DeletePod(meta["name"], meta.get("uid")))


def _ours(ctx: Pass, pod: JsonDict) -> bool:
    meta = pod.get("metadata") or {}
    return (
        meta.get("namespace") == ctx.namespace
        and (meta.get("labels") or {}).get(JOB_LABEL) == ctx.name
    )


def fresh_entry(before: StageStatus, pool: str, pipeline: int | None = None) -> StageStatus:
    """Stage `before` in a new plan, on `pool` (of `pipeline`, in a plan of several), to be
    created; its restart count and last failure kept."""
    return StageStatus(index=before.index, pipeline=pipeline, pool=pool).model_copy(
        update={
            "restarts": before.restarts,
            "last_failure": before.last_failure,
            "last_failure_time": before.last_failure_time,
        }
    )


def _message(before: PlanStatus, after: PlanStatus, waited: int, cost: float) -> str:
    def chain(plan: PlanStatus) -> str:
        return " → ".join(f"{s.pool}[{s.layer_start}:{s.layer_end})" for s in plan.stages)

    def rate(plan: PlanStatus) -> str:
        tps = plan.predicted_tokens_per_second
        return f"{tps:,.0f}" if tps is not None else "?"

    return (
        f"A replacement waited {waited} s for a GPU (a re-split costs about {cost:.0f} s: "
        f"--join-seconds); the pipeline is re-split for the GPUs free and those it holds: "
        f"{len(after.stages)} stages {chain(after)} instead of {len(before.stages)} stages "
        f"{chain(before)}; predicted tokens/s {rate(before)} -> {rate(after)} (0 while it "
        "waited). Every stage starts again from the last commit, restored by parameter name."
    )
