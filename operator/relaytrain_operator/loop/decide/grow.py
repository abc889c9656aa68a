"""A running job grows: pipelines its plan did not have are added on GPUs that joined
(domain/growing.py prices them; docs/operator.md, "Adding a pipeline").

When: `spec.pipeline.replicas: auto` (the user let the planner choose how many pipelines
pay), or a fixed count while fewer train and a pipeline out cannot come back (`short`: a
pipeline shaped for the GPUs free takes its place, up to the count), its store on s3:// (the
stages training learn of the added pipelines there), every pipeline training or out (none
starting or recovering: their GPUs come first; with one pipeline, every stage training), its
link certificates not in a renewal, and the stages reporting progress (the steps left price
the join). `growable` says whether a job is so, from its record alone (for `needs`).

Under Kueue a job grows only with one Workload per pipeline (admission.per_pipeline: a job
queued with one Workload for the whole job, a job of one pipeline included, has its quota in
that one and does not grow), and only while no pipeline is out but those given up for good
or retired (membership._outwaited: a pipeline whose stage's replacement found no GPU, its
Workload given back, so that one shaped for the GPUs free takes its place through Kueue, on
any pool, its nodes not shunned): a pipeline out otherwise holds its admission (it comes
back on the pools it was admitted on) or waits for Kueue (Kueue is asked already; a second
ask would queue more while the first is unanswered). The grown plan is recorded as without
Kueue, but each added pipeline is out of the job from the start (`Left`, waiting for Kueue)
and gets its own Workload, built as the other pipelines' are (`admission.job_workload`, the
job's priority as its Workloads carry it): its stages' certificates are minted (links.py),
but no store or pod step is taken for it now. Kueue admits it when it has quota (a pending
Workload holds none), and it then comes back as a pipeline Kueue admitted does
(membership.bring_back: its pods, the store told first). Near the job's end it is withdrawn
(admission._withdrawn).

A job of one pipeline grows by a restart (`grow_one`): its stages' documents have no
replicas section to grow by, so the grown plan makes it pipeline 0 of several and every
pod goes, to be created again from the plan, every stage restoring the last commit. The
planner prices that restart with the join (`--join-seconds` and the steps since the last
commit trained again), and the pass ends there, as a re-split's does (resplit.py).

A pipeline out does not come back in a pass that adds one (membership.bring_back runs
first), and it holds growth off only while it may still come back by itself: given up and
waiting out its return delay (what failed it is not built on meanwhile), or its last pods
still going (their GPUs are not free yet). One that left and whose stages fit on no free GPUs,
or whose return does not pay (held out), stays out, its share kept as its weight, and the
GPUs free are priced for new pipelines shaped for them: a pipeline re-split, in effect, under
a new index. One given up for good (`returnAfterSeconds: 0`) stays out too, and nothing is
added on the nodes its stages last ran on.

What, in order: the grown plan is written first (status.plan.pipelines with every share
planned again, status.pipelines with `addedAtStep`, fresh status.stages entries on the pools
chosen), so that an operator stopped after it still builds the added pods from the record;
then the link Secret gets certificates for the added stages (links.py mints for any planned
stage it lacks), names.FLEET_FILE lists every added pipeline (`fleet`), and the added
stages' pods are created. They join the pipelines training at a step boundary with their
state (docs/worker.md, "A pipeline added to a running job").
"""

from __future__ import annotations

from collections.abc import Sequence

from relaytrain_operator.domain.builders.labels import StageKey
from relaytrain_operator.domain.growing import Grown, as_fleet, grow
from relaytrain_operator.domain.membership import return_wait
from relaytrain_operator.domain.planner import PlanError, PoolError
from relaytrain_operator.domain.queueing import QueueError
from relaytrain_operator.domain.stage_config import fleet_document, job_pod_endpoints
from relaytrain_operator.domain.status import OUT_PHASES, Verdict, rfc3339, short_of
from relaytrain_operator.loop.actions import Create, PutFleet
from relaytrain_operator.loop.decide.admission import job_workload, per_pipeline
from relaytrain_operator.loop.decide.context import JsonDict, Pass
from relaytrain_operator.loop.decide.resplit import RESPLIT_PAUSE_SECONDS, fresh_entry
from relaytrain_operator.spec import (
    FineTuneJob,
    FineTuneJobStatus,
    GrowthStatus,
    PipelineStatus,
    PlanStatus,
    StageStatus,
    is_s3,
)


def growable(
    spec: FineTuneJob, status: FineTuneJobStatus, queued: bool, layout: bool | None = None
) -> bool:
    """Whether the job may grow now, as far as its spec and record say (module doc): the
    pass then reads the nodes, the cluster's pods, the model and the link Secret. `queued`:
    under Kueue, `layout` saying whether its Workloads are one per pipeline as listed (None:
    not read, the layout it would be queued with)."""
    plan, links = status.plan, status.link_certificates
    fleet = status.pipelines or ()
    wanted = spec.spec.pipeline.replicas
    if wanted != "auto" and (plan is None or not short(plan, fleet, int(wanted))):
        return False  # a fixed count grows only to make up its N
    waits = any(p.phase == "Left" and not p.retired for p in fleet)
    if queued and (not per_pipeline(spec, plan, layout) or waits):
        return False  # one Workload holds the job, or a pipeline holds or waits for its own
    if plan is not None and plan.several():
        training = all(p.phase == "Running" or p.phase in OUT_PHASES for p in fleet) and any(
            p.phase == "Running" for p in fleet
        )
    else:  # one pipeline: every stage training
        training = bool(status.stages) and all(
            s.phase == "Running" and s.ready for s in status.stages
        )
    return (
        is_s3(spec.spec.checkpoint.uri)
        and plan is not None
        and training
        and links is not None
        and links.phase == "Current"
        and status.progress is not None
        and status.progress.total_steps is not None
    )


def short(plan: PlanStatus, fleet: Sequence[PipelineStatus], wanted: int) -> bool:
    """Whether a job of a fixed count of `wanted` pipelines trains fewer now: pipelines out
    that a pipeline shaped for the GPUs free may stand in for."""
    out = sum(1 for p in fleet if p.phase in OUT_PHASES)
    return plan.several() and short_of(plan, out, wanted)


def add_pipelines(
    ctx: Pass,
    spec: FineTuneJob,
    plan: PlanStatus,
    entries: dict[StageKey, StageStatus],
    out: set[int],
) -> tuple[PlanStatus, list[StageKey]]:
    """Grow a job of several pipelines if it may and the planner says it pays: returns the
    plan (grown or as it was) and the added stages to create, their entries put in
    `entries`. `out`: the pipelines out of the job after this pass's returns; under Kueue
    the added pipelines are put in it (they wait for their Workloads: none to create)."""
    queued = ctx.queue is not None
    layout = ctx.per_pipeline if queued else None
    if not plan.several() or not growable(spec, ctx.status, queued, layout):
        return plan, []
    if _awaited(ctx, spec, out) or (queued and out - _for_good(ctx, spec, out) - _retired(ctx)):
        return plan, []  # under Kueue: a pipeline given up whose Workload is active again
    wanted = spec.spec.pipeline.replicas
    fixed = None if wanted == "auto" else int(wanted)
    grown = _priced_growth(ctx, spec, plan, entries, out, most=fixed)
    if grown is None or grown.plan is None:
        return plan, []
    if not queued:
        ctx.update(growth=None)
        return grown.plan, _record(ctx, grown, entries, out)
    workloads = _workloads(ctx, spec, grown)
    if workloads is None:
        return plan, []
    ctx.update(growth=None)
    _record(ctx, grown, entries, out, queued=True)
    ctx.actions += [Create(workload) for workload in workloads]
    out.update(grown.added)
    return grown.plan, []


def grow_one(
    ctx: Pass, spec: FineTuneJob, plan: PlanStatus, entries: dict[StageKey, StageStatus]
) -> bool:
    """Grow a job of one pipeline if it may and the planner says it pays, restart cost
    included (module doc): True when it did (the pass is over: the pods go, the next pass
    creates the grown plan's)."""
    if plan.several() or not growable(spec, ctx.status, ctx.queue is not None):
        return False
    committed = ctx.committed()
    lost = max(ctx.step() - (committed or 0), 0)
    restart = ctx.settings.join_seconds + lost * (plan.predicted_step_seconds or 0.0)
    fleet_plan = as_fleet(plan, spec.spec.training.micro_batches)
    grown = _priced_growth(ctx, spec, fleet_plan, entries, set(), restart_seconds=restart)
    if grown is None:
        return False
    _restart_grown(ctx, grown, committed, restart)
    return True


def _priced_growth(
    ctx: Pass,
    spec: FineTuneJob,
    plan: PlanStatus,
    entries: dict[StageKey, StageStatus],
    out: set[int],
    *,
    restart_seconds: float = 0.0,
    most: int | None = None,
) -> Grown | None:
    """The planner's growth of `plan` (several pipelines' form) on the GPUs free for the
    job, when it pays over a join (and `restart_seconds` more); None when nothing is added,
    status.growth then saying why where GPUs are free. `most`: a fixed count, which the
    pipelines training and added make up at most."""
    model, cluster_pods = ctx.observed.model, ctx.observed.cluster_pods
    progress = ctx.status.progress
    if model is None or model.config is None or cluster_pods is None or progress is None:
        return None
    assert progress.total_steps is not None
    held = {key: s.pool for key, s in entries.items() if s.pool and key[0] not in out}
    # Nothing new on the nodes a pipeline given up for good last ran on.
    gone = _for_good(ctx, spec, out)
    shunned = {s.node for s in ctx.status.stages if s.node and (s.pipeline or 0) in gone}
    nodes = [n for n in ctx.observed.nodes.values() if n["metadata"]["name"] not in shunned]
    try:
        grown = grow(
            spec, plan, model.config, held=held, nodes=nodes, out=out,
            cluster_pods=cluster_pods,
            steps_left=max(progress.total_steps - ctx.step(), 0),
            catalog=ctx.settings.catalog, default_link=ctx.settings.default_link,
            join_seconds=ctx.settings.join_seconds + restart_seconds,
            max_pipelines=most,
        )  # fmt: skip
    except (PlanError, PoolError, ValueError):
        return None  # not to be priced (a pool gone under a stage): it stays as it is
    if grown.plan is None:
        _unused(ctx, grown)
        return None
    return grown


def _awaited(ctx: Pass, spec: FineTuneJob, out: set[int]) -> bool:
    """Whether a pipeline out may still come back by itself (module doc): given up and
    waiting out its return delay, or its last pods still going."""
    policy = spec.spec.failure_policy
    for pipeline in ctx.status.pipelines or ():
        if pipeline.index not in out:
            continue
        if any(key[0] == pipeline.index for key in ctx.observed.pods):
            return True
        if pipeline.phase == "Failed" and return_wait(pipeline, policy, ctx.now):
            return True
    return False


def _for_good(ctx: Pass, spec: FineTuneJob, out: set[int]) -> set[int]:
    """The pipelines out that never come back (given up, with returnAfterSeconds 0)."""
    policy = spec.spec.failure_policy
    return {
        p.index
        for p in ctx.status.pipelines or ()
        if p.index in out and p.phase == "Failed" and return_wait(p, policy, ctx.now) is None
    }


def _retired(ctx: Pass) -> set[int]:
    """The pipelines out for good with their Workloads given back (membership._outwaited):
    their nodes are not shunned, unlike those of one given up (nothing failed there)."""
    return {p.index for p in ctx.status.pipelines or () if p.retired}


def _unused(ctx: Pass, grown: Grown) -> None:
    """Say in status.growth why the GPUs free for the job stay unused, and in a
    GrowthDeclined Event, when they are other GPUs than last said: the reason is the
    pricing of these GPUs when they became free (its figures move with the steps left, and
    a status written on every pass would cost an API call each)."""
    if not grown.free:
        ctx.update(growth=None)
        return
    free = ", ".join(f"{p.name} x{p.gpus}" for p in sorted(grown.free, key=lambda p: p.name))
    said = ctx.status.growth
    if said is None or said.free_gpus != free:
        ctx.update(growth=GrowthStatus(free_gpus=free, reason=grown.growth.reason))
        ctx.event(
            "Normal",
            "GrowthDeclined",
            f"No pipeline is added on the GPUs free for the job ({free}): {grown.growth.reason}.",
        )


def _workloads(ctx: Pass, spec: FineTuneJob, grown: Grown) -> list[JsonDict] | None:
    """The Workloads of the pipelines `grown` adds to a queued job (one each, as its other
    pipelines'), with the priority its Workloads carry; None when Kueue could not hold one
    (more pools than a Workload's pod sets): nothing is added, status.growth says why."""
    assert grown.plan is not None
    held = [w.get("spec", {}).get("priority") for w in ctx.observed.workloads.values()]
    priority = next((v for v in held if v is not None), None)
    try:
        return [
            job_workload(ctx, spec, q, active=True, plan=grown.plan, priority=priority)
            for q in grown.added
        ]
    except QueueError as err:
        free = ", ".join(f"{p.name} x{p.gpus}" for p in sorted(grown.free, key=lambda p: p.name))
        ctx.update(growth=GrowthStatus(free_gpus=free, reason=str(err)))
        return None


def _record(
    ctx: Pass,
    grown: Grown,
    entries: dict[StageKey, StageStatus],
    out: set[int],
    *,
    queued: bool = False,
) -> list[StageKey]:
    """Write the grown plan and the added pipelines' life, and say so in an Event. `queued`:
    each added pipeline is out from the start, waiting for Kueue to admit its Workload."""
    assert grown.plan is not None and grown.plan.pipelines is not None
    step = ctx.step()
    added = grown.added
    keys: list[StageKey] = []
    life = list(ctx.status.pipelines or ())
    waits = {
        "phase": "Left", "left_at_step": step, "left_time": rfc3339(ctx.now),
        "left_reason": "its Workload waits for Kueue to admit it",
    }  # fmt: skip
    for q in added:
        planned = grown.plan.pipelines[q]
        for s in planned.stages:
            entries[(q, s.index)] = StageStatus(index=s.index, pipeline=q, pool=s.pool)
            keys.append((q, s.index))
        born = PipelineStatus(
            index=q, phase="Pending", ready_stages=f"0/{len(planned.stages)}",
            micro_batches=planned.micro_batches, added_at_step=step,
        )  # fmt: skip
        life.append(born.model_copy(update=waits) if queued else born)
    shares = {p.index: p.micro_batches for p in grown.plan.pipelines}
    life = [p.model_copy(update={"micro_batches": shares[p.index]}) for p in life]
    ctx.update(plan=grown.plan, pipelines=life, stages=[entries[key] for key in sorted(entries)])
    ctx.patch()  # the record first: the added pods are built from it, after a crash too
    then = "Its stages join the pipelines training at a step boundary with their state."
    if queued:
        then = (
            f"It waits for Kueue: its own Workload is submitted to LocalQueue {ctx.queue}, "
            "holding no quota until Kueue admits it; its stages are created then and join "
            "the pipelines training at a step boundary with their state."
        )
    _added(ctx, grown, step, out, then)
    return keys


def _added(ctx: Pass, grown: Grown, step: int, out: set[int], then: str) -> None:
    """A PipelineAdded Event for each pipeline `grown` adds after `step`: where, its share
    of the micro-batches of the pipelines not `out`, the planner's reason and tokens/s,
    and `then` (what happens next)."""
    assert grown.plan is not None and grown.plan.pipelines is not None
    growth = grown.growth
    micro = sum(p.micro_batches for p in grown.plan.pipelines if p.index not in out)
    for q in grown.added:
        planned = grown.plan.pipelines[q]
        pools = ", ".join(s.pool for s in planned.stages)
        ctx.event(
            "Normal",
            "PipelineAdded",
            f"Pipeline {q} is added after step {step} on GPUs free for the job ({pools}), "
            f"{planned.micro_batches} of each step's {micro} micro-batches: "
            f"{growth.reason}; {growth.tokens_per_second_before:,.0f} -> "
            f"{growth.tokens_per_second_after:,.0f} predicted tokens/s. {then}",
            change="added",
        )


def _restart_grown(ctx: Pass, grown: Grown, committed: int | None, restart_seconds: float) -> None:
    """A job of one pipeline grown: the plan of several written (its pipeline pipeline 0,
    each stage keeping its restart count and last failure), then every stage pod deleted;
    the next pass creates every pipeline's pods, which restore the last commit."""
    assert grown.plan is not None and grown.plan.pipelines is not None
    step = ctx.step()
    kept = {s.index: s for s in ctx.status.stages}
    stages = [
        fresh_entry(
            kept.get(s.index, StageStatus(index=s.index)) if p.index == 0
            else StageStatus(index=s.index),
            s.pool, pipeline=p.index,
        )
        for p in grown.plan.pipelines
        for s in p.stages
    ]  # fmt: skip
    life = [
        PipelineStatus(
            index=p.index, phase="Pending", ready_stages=f"0/{len(p.stages)}",
            micro_batches=p.micro_batches, added_at_step=step if p.index else None,
        )
        for p in grown.plan.pipelines
    ]  # fmt: skip
    # The plan first: pods of the one pipeline are replaced even after a crash.
    ctx.replace_every_stage(plan=grown.plan, pipelines=life, stages=stages, growth=None)
    since = "the start" if committed is None else f"step {committed}"
    restart = (
        f"The job's one pipeline restarts beside it as pipeline 0 (its stages' documents gain "
        f"the replicas a job grows by): every stage restores the last commit ({since}; the "
        f"{step - (committed or 0)} steps since are trained again), about "
        f"{restart_seconds:.0f} s that the added pipeline pays back."
    )
    _added(ctx, grown, step, set(), restart)
    count = len(grown.plan.pipelines)
    ctx.settle(
        Verdict("Recovering", False, True, "Replanned",
                f"Growing to {count} pipelines on GPUs free for the job: {restart}")
    )  # fmt: skip
    ctx.wake_within(RESPLIT_PAUSE_SECONDS)


def fleet(ctx: Pass, spec: FineTuneJob, plan: PlanStatus, creating: list[StageKey]) -> None:
    """Write names.FLEET_FILE (every pipeline added so far, and every pipeline's share as
    planned now) before any added pipeline's stage is created — added now, or replaced, or
    come back — so that the stages training know of it by the time it dials, and share each
    step as the plan does."""
    added = [p.index for p in ctx.status.pipelines or () if p.added_at_step is not None]
    if not added or not is_s3(spec.spec.checkpoint.uri):
        return
    if not any(key[0] in added for key in creating):
        return
    splits = plan.splits()
    endpoints = job_pod_endpoints(ctx.name, ctx.namespace, [len(s) for s in splits])
    shares = [p.micro_batches for p in plan.pipelines or ()]
    ctx.actions.append(PutFleet(fleet_document(spec, splits, endpoints, added, shares)))
