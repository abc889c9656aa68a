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

Under Kueue a re-split stays within what the job's Workload was admitted with (its pools,
and no more stages on one than its pod set there): the Workload is not changed, so the job
holds the same quota, and a re-split back returns to the admitted shape.

The plan a re-split replaced stays on record (`status.plan.resplitFrom`); while it does,
`resplit_back` re-plans the job as GPUs free up and re-splits it back the same way where
that pays for the restart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime

from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.domain.placement import node_pool
from relaytrain_operator.domain.planner import PlanError
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN
from relaytrain_operator.domain.resplit import resplit_plan, resplit_wait, same_places
from relaytrain_operator.domain.status import Verdict, parse_time
from relaytrain_operator.loop.actions import DeletePod
from relaytrain_operator.loop.decide.context import (
    JsonDict,
    Pass,
    planned_keys,
)
from relaytrain_operator.loop.decide.waiting import unbound_waiting, waiting_moves
from relaytrain_operator.spec import FineTuneJob, FormerPlan, PlanStatus, StageStatus

RESPLIT_PAUSE_SECONDS = 1.0
"""After a re-split, how soon the pass looks again (to create the pods once the old are gone)."""


def waiting_since(pods: Iterable[JsonDict]) -> datetime | None:
    """When the oldest of `pods` still waiting for a GPU (created with `WAITING_ANNOTATION`,
    not bound, not being deleted) was created; None when none waits (a pod without a
    creation time, never read back from the API server, has not waited)."""
    since = [
        parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
        for pod in pods
        if unbound_waiting(pod)
    ]
    return min((t for t in since if t is not None), default=None)


def resplit(ctx: Pass, spec: FineTuneJob, plan: PlanStatus) -> bool:
    """Re-split the job's one pipeline for the GPUs it can have, if a replacement has waited
    long enough and a plan fits; True when it did (the pass is over)."""
    if plan.several():
        return False  # several pipelines: one out comes back (membership.py)
    since = waiting_since(ctx.observed.pods.values())
    if since is None:
        return False
    wait = resplit_wait(since, ctx.now, ctx.settings.join_seconds)
    if wait:
        ctx.wake_within(wait.total_seconds())
        return False
    if waiting_moves(ctx, spec, plan):
        return False  # a pool has a GPU for it: it moves there alone (create.rehome_waiting)
    model, pods = ctx.observed.model, ctx.observed.cluster_pods
    if model is None or model.config is None or pods is None:
        return False  # needs() asks for both while a replacement waits
    others = [pod for pod in pods if not _ours(ctx, pod)]
    try:
        planned = resplit_plan(
            spec,
            model.config,
            _granted_nodes(ctx, spec),
            others,
            stages_now=len(plan.stages),
            catalog=ctx.settings.catalog,
            default_link=ctx.settings.default_link,
        )
    except PlanError:
        return False  # nothing fits either: the replacement waits on, as its condition says
    recorded = PlanStatus.model_validate(planned)
    if same_places(plan.stages, recorded.stages) or not _granted(ctx, recorded):
        return False
    waited = int((ctx.now - since).total_seconds())
    former = plan.resplit_from or FormerPlan(
        split=_chain(plan),
        stages=len(plan.stages),
        predicted_tokens_per_second=plan.predicted_tokens_per_second,
    )
    _restart(
        ctx,
        recorded.model_copy(update={"resplit_from": former}),
        _message(plan, recorded, waited, ctx.settings.join_seconds),
    )
    return True


def resplit_back(ctx: Pass, spec: FineTuneJob, plan: PlanStatus) -> bool:
    """Re-split a job of one pipeline that trains on a re-split (`plan.resplit_from`) for the
    GPUs free now and those it holds, when that raises its predicted tokens/s by
    `GROWTH_MARGIN` and the time it saves over the steps left pays for the restart
    (`--join-seconds`, and the steps since the last commit trained again); at most as many
    stages as before the first re-split, and under Kueue within what its Workload was
    granted. True when it did (the pass is over)."""
    former = plan.resplit_from
    if former is None or not _settled(ctx, plan):
        return False
    model, pods, progress = ctx.observed.model, ctx.observed.cluster_pods, ctx.status.progress
    assert model is not None and pods is not None, "needs() asks for both while re-split"
    if model.config is None or progress is None or progress.total_steps is None:
        return False
    others = [pod for pod in pods if not _ours(ctx, pod)]
    try:
        planned = resplit_plan(
            spec, model.config, _granted_nodes(ctx, spec), others,
            stages_now=former.stages, catalog=ctx.settings.catalog,
            default_link=ctx.settings.default_link,
        )  # fmt: skip
    except PlanError:
        return False  # its own GPUs count as free: a pool gone under it, say
    recorded = PlanStatus.model_validate(planned)
    before, after = plan.predicted_step_seconds, recorded.predicted_step_seconds
    if same_places(plan.stages, recorded.stages) or not before or not after:
        return False
    lost = max(ctx.step() - (ctx.committed() or 0), 0)
    restart = ctx.settings.join_seconds + lost * before
    saved = max(progress.total_steps - ctx.step(), 0) * (before - after)
    if before < after * (1 + GROWTH_MARGIN) or saved <= restart or not _granted(ctx, recorded):
        return False
    reached = (recorded.predicted_tokens_per_second or 0.0) >= (
        former.predicted_tokens_per_second or float("inf")
    )
    _restart(
        ctx,
        recorded.model_copy(update={"resplit_from": None if reached else former}),
        f"GPUs are free for the job's one pipeline (re-split from {former.split}): it is "
        f"re-split back, {len(recorded.stages)} stages {_chain(recorded)} instead of "
        f"{len(plan.stages)} stages {_chain(plan)}; predicted tokens/s "
        f"{_rate(plan)} -> {_rate(recorded)}, which saves about {saved:,.0f} s over the "
        f"steps left against a restart of about {restart:,.0f} s. Every stage starts again "
        "from the last commit, restored by parameter name.",
    )
    return True


def _settled(ctx: Pass, plan: PlanStatus) -> bool:
    """Whether a job may be re-split back now: one pipeline, every stage training."""
    stages = ctx.status.stages
    return (
        not plan.several()
        and bool(stages)
        and all(s.phase == "Running" and s.ready for s in stages)
    )


def _granted_nodes(ctx: Pass, spec: FineTuneJob) -> list[JsonDict]:
    """The nodes a re-split may plan on: every node, or under Kueue those of the pools its
    admitted Workload holds (a re-split never asks for quota Kueue did not grant)."""
    nodes = list(ctx.observed.nodes.values())
    if ctx.queue is None:
        return nodes
    admission = ctx.admissions.get(0)
    pools = admission.pool_counts if admission is not None else {}
    return [n for n in nodes if node_pool(n, spec.spec.placement.gpu_label) in pools]


def _granted(ctx: Pass, plan: PlanStatus) -> bool:
    """Whether `plan` stays within what the job's Workload was admitted with: under Kueue,
    no more stages on a pool than its admitted pod set there (the Workload stays as it was
    admitted, so the job goes on holding the same quota, and a re-split back returns to the
    admitted shape); without a queue, any plan."""
    if ctx.queue is None:
        return True
    admission = ctx.admissions.get(0)
    granted = admission.pool_counts if admission is not None else {}
    wanted = Counter(s.pool for s in plan.stages)
    return all(n <= granted.get(pool, 0) for pool, n in wanted.items())


def _restart(ctx: Pass, recorded: PlanStatus, message: str) -> None:
    """Write `recorded` (fresh stage entries, each stage's restart count and last failure
    kept), then remove every stage pod; the next pass creates the new plan's."""
    kept = {s.index: s for s in ctx.status.stages}
    ctx.replace_every_stage(  # the plan first: pods of the old split go even after a crash
        plan=recorded,
        stages=[
            fresh_entry(kept.get(s.index, StageStatus(index=s.index)), s.pool)
            for s in recorded.stages
        ],
    )
    ctx.event("Normal", "Replanned", message)
    ctx.settle(Verdict("Recovering", False, True, "Replanned", message))
    ctx.wake_within(RESPLIT_PAUSE_SECONDS)


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


def _chain(plan: PlanStatus) -> str:
    return " → ".join(f"{s.pool}[{s.layer_start}:{s.layer_end})" for s in plan.stages)


def _rate(plan: PlanStatus) -> str:
    tps = plan.predicted_tokens_per_second
    return f"{tps:,.0f}" if tps is not None else "?"


def _message(before: PlanStatus, after: PlanStatus, waited: int, cost: float) -> str:
    return (
        f"A replacement waited {waited} s for a GPU (a re-split costs about {cost:.0f} s: "
        f"--join-seconds); the pipeline is re-split for the GPUs free and those it holds: "
        f"{len(after.stages)} stages {_chain(after)} instead of {len(before.stages)} stages "
        f"{_chain(before)}; predicted tokens/s {_rate(before)} -> {_rate(after)} (0 while it "
        "waited). Every stage starts again from the last commit, restored by parameter name."
    )
