"""The stages of a started, admitted job: per stage keep, create, replace or wait.

`recovery.decide` gives each planned stage of a pipeline not given up its verdict on the
stage's pod. A failure is counted in status (and the count written) before its pod is
deleted, so an operator restarted in between counts it once (see recovery.py). A stage
that used up spec.failurePolicy.maxStageRestarts gives its pipeline up while the others
train on, and fails the job when it is the last one left. A pipeline whose node announced
its end leaves first, and one out comes back where it fits (membership.py); a job whose
pipelines all train may grow on GPUs that joined (grow.py). Pods to create
are create.py's; what the kept pods say, and progress.py's word on whether the job
finished, make the job's new condition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from relaytrain_operator.domain.builders.labels import (
    POOL_ANNOTATION,
    SPLIT_ANNOTATION,
    StageKey,
    stage_pod_name,
)
from relaytrain_operator.domain.recovery import (
    REPLACING,
    StageDecision,
    StageRecord,
    after_failure,
)
from relaytrain_operator.domain.recovery import decide as decide_stage
from relaytrain_operator.domain.recovery import stuck as stuck_container
from relaytrain_operator.domain.resplit import split_of
from relaytrain_operator.domain.status import (
    fleet_verdict,
    idle_stage,
    observed_stage,
    pipeline_statuses,
    rfc3339,
    stage_name,
)
from relaytrain_operator.loop.actions import DeletePod, PostEvent, PutGivenUp
from relaytrain_operator.loop.decide.context import (
    WAITING_ANNOTATION,
    Pass,
    given_up,
    planned_keys,
)
from relaytrain_operator.loop.decide.create import create_stages, rehome_waiting
from relaytrain_operator.loop.decide.grow import add_pipelines, fleet, grow_one
from relaytrain_operator.loop.decide.links import keep_links_valid
from relaytrain_operator.loop.decide.membership import (
    bring_back,
    departed,
    leave_departing,
    stage_departure,
)
from relaytrain_operator.loop.decide.progress import fail, follow_progress
from relaytrain_operator.loop.decide.resplit import remove_unplanned, resplit, resplit_back
from relaytrain_operator.spec import FineTuneJob, PlanStatus, StageStatus, is_s3


@dataclass
class _Judged:
    """The planned stages as judged so far in a pass."""

    entries: dict[StageKey, StageStatus] = field(default_factory=dict)
    """Every planned stage's status entry."""
    verdicts: dict[StageKey, StageDecision] = field(default_factory=dict)
    """What to do with the pod of each stage of a pipeline still training."""
    restarting: list[PostEvent] = field(default_factory=list)
    """The Events of the failures counted, posted once the count is written."""
    exhausted: dict[int, str] = field(default_factory=dict)
    """Pipelines given up in this pass, and why."""


def run_stages(ctx: Pass, spec: FineTuneJob) -> None:
    """Carry out every planned stage's verdict, then fold progress in and settle."""
    plan = ctx.status.plan
    assert plan is not None
    out = given_up(ctx.status)
    progress = ctx.observed.progress
    if progress is not None and progress.done and follow_progress(ctx, spec, out):
        return  # the workers finished: a stage ending afterwards is no failure
    out |= leave_departing(ctx, spec, plan, out)
    if resplit(ctx, spec, plan):
        return  # the pods go; the next pass creates the new plan's
    remove_unplanned(ctx, plan)
    judged = _judge(ctx, spec, plan, out)
    if judged is None:
        return  # the last pipeline left used up its restarts: the job failed
    out |= set(judged.exhausted)
    _write_count(ctx, plan, judged, out)
    rehome_waiting(ctx, spec, plan, judged.entries, judged.verdicts)
    returning = bring_back(ctx, spec, plan, out, judged.entries)
    out -= {key[0] for key in returning}
    _give_up(ctx, spec, judged.exhausted, out, back=bool(returning))
    if not returning and all(v.action == "keep" for v in judged.verdicts.values()):
        if grow_one(ctx, spec, plan, judged.entries) or resplit_back(ctx, spec, plan):
            return  # the one pipeline's pods go; the next pass creates the new plan's
        plan, added = add_pipelines(ctx, spec, plan, judged.entries, out)
        returning += added
    for key, verdict in judged.verdicts.items():
        if verdict.action == "delete":
            meta = ctx.observed.pods[key]["metadata"]
            ctx.actions.append(DeletePod(meta["name"], meta.get("uid"), verdict.force))
    # Certificates renewed (or reissued, after a long suspension) before any pod is
    # created with them.
    keep_links_valid(ctx, spec)
    waiting: dict[StageKey, str] = {}
    creating = [key for key, v in judged.verdicts.items() if v.action == "create"] + returning
    fleet(ctx, spec, plan, creating)
    if creating:
        create_stages(ctx, spec, creating, judged.entries, waiting)
    stuck = _keep(ctx, judged, waiting)
    stages = [judged.entries[key] for key in sorted(judged.entries)]
    pipelines = pipeline_statuses(plan, stages, out, ctx.status.pipelines)
    ctx.update(stages=stages, pipelines=pipelines)
    if follow_progress(ctx, spec, out):
        return
    ctx.settle(fleet_verdict(stages, pipelines, waiting, stuck=stuck))


def _judge(ctx: Pass, spec: FineTuneJob, plan: PlanStatus, out: set[int]) -> _Judged | None:
    """Recovery's verdict on each planned stage of the pipelines not given up (`out`), each
    new failure counted; None when the job failed instead (its last pipeline left used up
    its restarts)."""
    limit = spec.spec.failure_policy.max_stage_restarts
    several = plan.several()
    records = {(s.pipeline or 0, s.index): s for s in ctx.status.stages}
    judged = _Judged()
    for key in planned_keys(plan):
        p, k = key
        planned = plan.splits()[p][k]
        entry = records.get(key) or StageStatus(
            index=k, pipeline=p if several else None, pool=planned.pool
        )
        judged.entries[key] = entry
        if p in out:
            continue  # given up: its pods went when it was
        verdict = _verdict(ctx, key, entry, split_of(plan.splits()[p]), several=several)
        if verdict.fatal is not None:
            # The stage's own word that no restart can help (a Job's podFailurePolicy
            # FailJob on its exit code): every pipeline reads the same model, data and store.
            fail(ctx, _stopped(entry, verdict), verdict.fatal)
            return None
        if verdict.failure is not None and (moved := stage_departure(ctx, key, entry)):
            # One pipeline (several leave whole, `leave_departing`): its stage is replaced
            # on another node, as a failed one is, but a drain is not its failure.
            _move(ctx, judged, key, verdict, moved, several=several)
        elif verdict.failure is not None:
            counted = after_failure(entry.restarts, limit)
            if counted is None:
                why = (
                    f"Stage {stage_name(entry)} failed again ({verdict.failure}) after "
                    f"{entry.restarts} restarts; spec.failurePolicy.maxStageRestarts is "
                    f"{limit}.{_last_words(verdict.message)}"
                )
                # Any pipeline may go: the lowest one training writes the checkpoints, the
                # progress and the result (docs/worker.md). The job fails with the last.
                if out | set(judged.exhausted) | {p} >= set(range(len(plan.splits()))):
                    fail(ctx, why)
                    return None
                judged.exhausted.setdefault(p, why)
                continue
            _count(ctx, judged, key, verdict, counted=counted, limit=limit, several=several)
        judged.verdicts[key] = verdict
    return judged


def _stopped(entry: StageStatus, verdict: StageDecision) -> str:
    """The condition's message of a job failed on a stage's non-retryable exit."""
    said = verdict.message or "it left no termination message (see its pod's log)"
    return f"Stage {stage_name(entry)} stopped, not to be restarted ({verdict.fatal}): {said}"


def _last_words(message: str, limit: int = 400) -> str:
    """The last line of a stage's termination message (its own line, or the end of its log
    for a crash), to end a condition's message with; "" without one."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1] if len(lines[-1]) <= limit else lines[-1][: limit - 1] + "…"
    return f" Its last words: {last}"


def _verdict(
    ctx: Pass, key: StageKey, entry: StageStatus, split: str, *, several: bool
) -> StageDecision:
    """Recovery's verdict on the stage's pod, given the node it is bound to. A pod built for
    another split of its pipeline than `split` (the plan's: a re-split recorded, its pods
    not yet all gone), or under another name (the job's one pipeline before it grew into
    pipeline 0 of several), is removed, no failure: its successor is built from the plan."""
    pod = ctx.observed.pods.get(key)
    meta = (pod or {}).get("metadata") or {}
    built_for = (meta.get("annotations") or {}).get(SPLIT_ANNOTATION)
    named = stage_pod_name(ctx.name, key[1], key[0] if several else None)
    if pod is not None and (built_for not in (None, split) or meta.get("name") != named):
        return StageDecision("wait" if meta.get("deletionTimestamp") else "delete")
    node_name = ((pod or {}).get("spec") or {}).get("nodeName")
    node = ctx.observed.nodes.get(node_name) if node_name else None
    record = StageRecord(key[1], entry.restarts, entry.phase, entry.pool)
    grace = timedelta(seconds=ctx.settings.node_lost_seconds)
    return decide_stage(record, pod, node, now=ctx.now, node_grace=grace)


def _move(
    ctx: Pass, judged: _Judged, key: StageKey, verdict: StageDecision, why: str, *, several: bool
) -> None:
    """Replace the stage whose node announced its end without counting a restart, and say
    so in an Event."""
    p, k = key
    entry = judged.entries[key].model_copy(
        update={
            "phase": REPLACING,
            "last_failure": f"NodeLeaving: {why}",
            "last_failure_time": rfc3339(ctx.now),
        }
    )
    judged.entries[key] = entry
    name = stage_pod_name(ctx.name, k, p if several else None)
    ctx.event(
        "Normal",
        "StageMoving",
        f"Stage {stage_name(entry)} pod {name} ended ({verdict.failure}) on a node that "
        f"announced its end ({why}); replacing it on another node, not counted as a restart.",
    )


def _count(
    ctx: Pass,
    judged: _Judged,
    key: StageKey,
    verdict: StageDecision,
    *,
    counted: int,
    limit: int,
    several: bool,
) -> None:
    """Count the stage's new failure (`counted` restarts now) and say so in an Event."""
    p, k = key
    failure = verdict.failure
    entry = judged.entries[key].model_copy(
        update={
            "restarts": counted,
            "phase": REPLACING,
            "last_failure": failure,
            "last_failure_time": rfc3339(ctx.now),
        }
    )
    judged.entries[key] = entry
    ctx.restarts += 1
    name = stage_pod_name(ctx.name, k, p if several else None)
    judged.restarting.append(
        PostEvent(
            "Warning",
            "StageRestarting",
            f"Stage {stage_name(entry)} pod {name} ended ({failure}); "
            f"replacing it (restart {entry.restarts} of {limit}).{_last_words(verdict.message)}",
        )
    )


def _write_count(ctx: Pass, plan: PlanStatus, judged: _Judged, out: set[int]) -> None:
    """Idle the stages of the pipelines given up in this pass, and write the failures
    counted before any pod is deleted (see recovery.py for why this order is crash-safe)."""
    for key in [key for key in judged.entries if key[0] in judged.exhausted]:
        judged.verdicts.pop(key, None)
        judged.entries[key] = idle_stage(judged.entries[key])
    if judged.restarting or judged.exhausted:
        before = ctx.status.pipelines
        for p, why in judged.exhausted.items():
            before = departed(ctx, before, p, "Failed", why)
        ctx.update(
            stages=[judged.entries[key] for key in sorted(judged.entries)],
            pipelines=pipeline_statuses(plan, list(judged.entries.values()), out, before),
        )
        ctx.patch()
        ctx.actions += judged.restarting


def _give_up(
    ctx: Pass, spec: FineTuneJob, exhausted: dict[int, str], out: set[int], *, back: bool
) -> None:
    """Remove the pods of the pipelines given up in this pass, saying so, and tell the
    stages every pipeline out (`out`) through the store: always when one comes `back`."""
    for p, why in sorted(exhausted.items()):
        ctx.remove_pods(p)
        ctx.event(
            "Warning",
            "PipelineFailed",
            f"{why} Pipeline {p} is given up; the other pipelines train on without it.",
        )
    # The stages learn it from the store: one linking again waits for no stage of it. A
    # pipeline that comes back is no longer named there before its pods are created.
    told, was = tuple(sorted(out)), ctx.observed.told_given_up
    if (out or was or back) and is_s3(spec.spec.checkpoint.uri) and (was != told or back):
        ctx.actions.append(PutGivenUp(told))


def _keep(
    ctx: Pass, judged: _Judged, waiting: dict[StageKey, str]
) -> dict[StageKey, tuple[str, str]]:
    """Fold each pod kept into its stage's entry; one still unscheduled that was created to
    wait for a GPU says why in `waiting`. Returns the stages whose container waits on what
    it will not get by itself (recovery.stuck), with the condition's reason and message."""
    stuck: dict[StageKey, tuple[str, str]] = {}
    for key, verdict in judged.verdicts.items():
        if verdict.action != "keep":
            continue
        pod = ctx.observed.pods[key]
        annotations = pod["metadata"].get("annotations") or {}
        pool = annotations.get(POOL_ANNOTATION, judged.entries[key].pool)
        judged.entries[key] = observed_stage(judged.entries[key], pod, pool)
        if WAITING_ANNOTATION in annotations and not (pod.get("spec") or {}).get("nodeName"):
            waiting[key] = annotations[WAITING_ANNOTATION]
        blocked = stuck_container(pod)
        if blocked is not None:
            reason, said = blocked
            name = stage_name(judged.entries[key])
            stuck[key] = (reason, f"Stage {name} cannot start its container ({reason}): {said}")
    return stuck
