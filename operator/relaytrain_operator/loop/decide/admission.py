"""The first plan, and Kueue's admission of a job submitted to a LocalQueue (queueing.py).

A job's first pass plans it (`planning.make_plan`) and records the plan and `startTime`
before any pod exists (Planned, ModelUnavailable, Unschedulable). A job with a queue label
is planned for the whole fleet, not for the GPUs free now; its Workloads (one per pipeline,
`per_pipeline`) are created from the recorded plan, kept active as spec.suspend asks, and a
pipeline's pods are created only once Kueue admits its Workload, with the labels and
tolerations of the flavours Kueue assigned. A pipeline not admitted, or evicted, is out of
the job (membership.py) and comes back once admitted; with none admitted the job has no pods
and is Suspended with Kueue's words. An evicted Workload's quota is handed back once none of
its pods is left, and a finished job's Workloads are marked Finished. A pipeline added to
the running job (grow.py: only with one Workload per pipeline) gets its Workload as the
others' (`job_workload`), and is out until Kueue admits it; one that has not started is
withdrawn (its Workload made inactive) once the job's end is nearer than a join costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from relaytrain_operator.domain import queueing
from relaytrain_operator.domain.membership import return_wait, worth_returning
from relaytrain_operator.domain.placement import pool_selector
from relaytrain_operator.domain.planning import (
    LoraTargetError,
    ModelConfigError,
    PlanError,
    make_plan,
)
from relaytrain_operator.domain.queueing import (
    ADMISSION_MANAGER,
    FINISHED_MANAGER,
    PRIORITY_LABEL,
    Admission,
    QueueError,
    StageDemand,
    build_workload,
    finished,
    priority_class_of,
    read_admission,
    workload_names,
)
from relaytrain_operator.domain.status import (
    READY,
    Verdict,
    condition,
    idle_stage,
    parse_time,
    rfc3339,
)
from relaytrain_operator.loop.actions import (
    ApplyWorkloadStatus,
    Create,
    PatchWorkload,
)
from relaytrain_operator.loop.decide.context import (
    DEFAULT_MEMORY_BYTES,
    QUEUE_REASONS,
    JsonDict,
    Pass,
)
from relaytrain_operator.spec import (
    FineTuneJob,
    FineTuneJobStatus,
    PlanStatus,
    StageStatus,
    is_s3,
)

# --- the first plan -------------------------------------------------------------------


def plan(ctx: Pass, spec: FineTuneJob) -> bool:
    """Plan the job and record the plan; False (with a condition) when it cannot."""
    model, pods = ctx.observed.model, ctx.observed.cluster_pods
    assert model is not None and pods is not None, "needs() asks for both before a plan"
    if ctx.queue is not None:
        # Kueue's quota decides when the job runs; the plan is made for the whole
        # fleet, not for the GPUs that happen to be free now.
        pods = []
    if model.config is None:
        ctx.settle(Verdict("Pending", False, False, "ModelUnavailable", model.error))
        return False
    problem = ctx.observed.inputs
    if problem is not None:
        ctx.settle(Verdict("Pending", False, False, problem.reason, problem.message))
        return False
    try:
        planned = make_plan(
            spec,
            model.config,
            list(ctx.observed.nodes.values()),
            pods,
            catalog=ctx.settings.catalog,
            default_link=ctx.settings.default_link,
        )
    except (LoraTargetError, ModelConfigError) as err:
        # Not a fleet too small: the spec asks for what this model has not, or names a
        # model no fleet can train (an unsupported family).
        ctx.update(plan=None)
        ctx.settle(Verdict("Failed", False, False, "InvalidSpec", str(err)))
        return False
    except PlanError as err:
        ctx.update(plan=None)
        ctx.settle(Verdict("Pending", False, False, "Unschedulable", str(err)))
        return False
    recorded = PlanStatus.model_validate(planned)
    several = recorded.several()
    ctx.update(
        plan=recorded,
        start_time=rfc3339(ctx.now),
        stages=[
            StageStatus(index=s.index, pipeline=p if several else None, pool=s.pool)
            for p, split in enumerate(recorded.splits())
            for s in split
        ],
    )
    # The plan is recorded before any pod exists: a restart after this point builds
    # the same pods from it.
    ctx.settle(Verdict("Planning", False, True, "Planned", "Creating the stage pods."))
    ctx.event("Normal", "Planned", planned_message(recorded))
    return True


def planned_message(plan: PlanStatus) -> str:
    """The Planned Event's words: each pipeline's stages, pools and layers."""

    def chain(stages: Sequence[Any]) -> str:
        return " → ".join(f"{s.pool}[{s.layer_start}:{s.layer_end})" for s in stages)

    if not plan.pipelines:
        return f"Planned {len(plan.stages)} stages: {chain(plan.stages)}."
    gpus = sum(len(p.stages) for p in plan.pipelines)
    each = "; ".join(
        f"pipeline {p.index} ({p.micro_batches} micro-batches/step): {chain(p.stages)}"
        for p in plan.pipelines
    )
    return f"Planned {len(plan.pipelines)} pipelines on {gpus} GPUs: {each}."


# --- Kueue ----------------------------------------------------------------------------


def per_pipeline(spec: FineTuneJob, plan: PlanStatus | None, found: bool | None = None) -> bool:
    """Whether a queued job has one Workload per pipeline, so that Kueue admits and preempts
    its pipelines one by one: the layout of the Workloads it has (`found`, from
    `queueing.by_pipeline`: a job keeps the one it was queued with); else, when it has none
    yet, whether it has several pipelines and a store on s3:// (through which the stages of
    the others learn that one is out). Otherwise one Workload holds the job."""
    if found is not None:
        return found
    return plan is not None and plan.several() and is_s3(spec.spec.checkpoint.uri)


def workloads_of(
    spec: FineTuneJob, status: FineTuneJobStatus, found: bool | None
) -> dict[int, str]:
    """The names of the job's Workloads by pipeline (the job's one Workload under 0)."""
    plan = status.plan
    several = len(plan.splits()) if plan is not None and per_pipeline(spec, plan, found) else None
    return workload_names(spec.metadata.name, several)


def admitted(ctx: Pass, spec: FineTuneJob) -> bool:
    """A job submitted to a LocalQueue: its Workloads created, kept active, and True once
    Kueue admits one (every pipeline's with one Workload per pipeline: those not admitted
    are out, membership.py); otherwise the pods go (an evicted workload's quota is handed
    back once none of its pods is left) and the job is Suspended with Kueue's words."""
    if ctx.observed.kueue_missing:
        wait_for_kueue(ctx, "KueueNotInstalled", _no_kueue(ctx.queue))
        ctx.wake_within(KUEUE_MISSING_RECHECK_SECONDS)
        return False
    found = ctx.observed.workloads_per_pipeline
    ctx.per_pipeline = per_pipeline(spec, ctx.status.plan, found)
    ctx.admissions = {
        p: read_admission(ctx.observed.workloads.get(p))
        for p in workloads_of(spec, ctx.status, found)
    }
    missing = [p for p, a in ctx.admissions.items() if a.state == "missing"]
    if missing and not _submit(ctx, spec, missing):
        return False
    for p, workload in ctx.observed.workloads.items():
        withdrawn = _withdrawn(ctx, p, workload)
        hold_workload(ctx, p, workload, active=not (withdrawn or _resting(ctx, spec, p)))
    running = {p: a for p, a in ctx.admissions.items() if a.state == "admitted"}
    if running:
        ready = condition(ctx.written, READY)
        if ready is not None and ready.reason in QUEUE_REASONS:
            ctx.event("Normal", "Admitted", _admitted_words(ctx, running))
        return True
    known = [(p, a) for p, a in ctx.admissions.items() if a.state != "missing"]
    evicted = [(p, a) for p, a in known if a.state in ("evicted", "released")]
    told = [(p, a) for p, a in known if a.message]
    if evicted:
        p, admission = evicted[0]
        wait_for_kueue(
            ctx,
            "Evicted",
            f"Kueue evicted the workload{_of(ctx, p)} ({admission.reason}: "
            f"{admission.message}); the stage pods are removed and it resumes from the last "
            "committed checkpoint when Kueue admits it again.",
        )
    elif told:
        # Pending: no quota now; Inadmissible: it cannot be admitted as it stands (its
        # LocalQueue or ClusterQueue missing or inactive): Kueue's words either way.
        p, admission = told[0]
        reason = "WaitingForQuota" if admission.reason == "Pending" else "Inadmissible"
        wait_for_kueue(ctx, reason, f"LocalQueue {ctx.queue}{_of(ctx, p)}: {admission.message}")
    else:
        wait_for_kueue(
            ctx, "Queued", f"Submitted to LocalQueue {ctx.queue}: waiting for Kueue to admit it."
        )
    return False


KUEUE_MISSING_RECHECK_SECONDS = 60.0
"""How often a job labelled for a queue on a cluster without Kueue looks again (Kueue
installed later is then used with no change to the job)."""


def _no_kueue(queue: str | None) -> str:
    return (
        f"metadata.labels[{queueing.QUEUE_LABEL}]: the job is submitted to LocalQueue "
        f"{queue}, but this cluster serves no {queueing.PLURAL}.{queueing.GROUP}/"
        f"{queueing.VERSION} (Kueue is not installed): install Kueue, or remove the label "
        "to run the job without a queue. No pod starts until one of those is done."
    )


def _resting(ctx: Pass, spec: FineTuneJob, p: int) -> bool:
    """Whether pipeline `p` (one Workload per pipeline) is given up and not yet to come back
    (its return delay running, or never), or retired (membership._outwaited): its Workload
    is made inactive, so that Kueue evicts it and its quota really goes back to the queue,
    and, given up, active again when the delay is over (Kueue then admits it when there is
    quota, and it comes back)."""
    if not ctx.per_pipeline:
        return False
    pipeline = next((s for s in ctx.status.pipelines or () if s.index == p), None)
    if pipeline is not None and pipeline.retired:
        return True
    if pipeline is None or pipeline.phase != "Failed":
        return False
    wait = return_wait(pipeline, spec.spec.failure_policy, ctx.now)
    if wait:
        ctx.wake_within(wait.total_seconds())
    return wait != timedelta(0)


def _withdrawn(ctx: Pass, p: int, workload: JsonDict) -> bool:
    """Whether pipeline `p` was added to the running job (grow.py), has not trained yet, and
    the job's estimated end is nearer than a join costs: admitted then, it would not come
    back (membership.bring_back), so its Workload is made inactive (Kueue takes it out of
    the queue, or hands back quota it reserved), and once, as that is done, its status and
    a PipelineWithdrawn Event say so. An estimate that moves out again makes it active."""
    pipeline = next((s for s in ctx.status.pipelines or () if s.index == p), None)
    if pipeline is None or pipeline.added_at_step is None or pipeline.returns:
        return False
    eta = ctx.status.progress.eta if ctx.status.progress is not None else None
    end = parse_time(eta)
    if pipeline.phase != "Left" or worth_returning(end, ctx.now, ctx.settings.join_seconds):
        return False
    if read_admission(workload).active:
        why = (
            f"its Workload is withdrawn from LocalQueue {ctx.queue}: the job's estimated end "
            f"({eta}) is nearer than a join costs (--join-seconds "
            f"{ctx.settings.join_seconds:.0f})"
        )
        ctx.update(
            pipelines=[
                s.model_copy(update={"left_reason": why}) if s.index == p else s
                for s in ctx.status.pipelines or ()
            ]
        )
        ctx.event(
            "Normal",
            "PipelineWithdrawn",
            f"Pipeline {p}, added at step {pipeline.added_at_step}, does not start: {why}. "
            "The other pipelines train to the end without it.",
        )
    return True


def _of(ctx: Pass, p: int) -> str:
    """Whose Workload a message speaks of: a pipeline's, where each has its own."""
    return f" (pipeline {p})" if ctx.per_pipeline else ""


def _admitted_words(ctx: Pass, running: dict[int, Admission]) -> str:
    """The Admitted Event's words: Kueue's, and the flavours of each pipeline admitted."""
    flavors = "; ".join(
        (f"pipeline {p}: " if ctx.per_pipeline else "")
        + ", ".join(f"{pool} → {f}" for pool, f in sorted(a.pool_flavors.items()))
        for p, a in sorted(running.items())
    )
    first = next(iter(running.values()))
    waiting = sorted(set(ctx.admissions) - set(running))
    rest = (
        f" Pipelines {', '.join(map(str, waiting))} wait for Kueue to admit theirs; the others "
        "train without them until it does."
        if waiting
        else ""
    )
    return f"{first.message} (flavors: {flavors}).{rest}"


def _submit(ctx: Pass, spec: FineTuneJob, missing: list[int]) -> bool:
    """Create the Workloads of pipelines `missing` (the job's one Workload: [0]); False
    when the job cannot be queued (Failed) or has none yet (it waits)."""
    priority_class = priority_class_of(ctx.job)
    if priority_class is not None and ctx.observed.priority is None:
        ctx.settle(
            Verdict(
                "Failed",
                False,
                False,
                "InvalidSpec",
                f"metadata.labels[{PRIORITY_LABEL}]: WorkloadPriorityClass "
                f"{priority_class!r} does not exist; create it or name one that does "
                "(kubectl get workloadpriorityclasses)",
            )
        )
        return False
    try:
        workloads = [job_workload(ctx, spec, p, active=True) for p in missing]
    except QueueError as err:
        ctx.settle(Verdict("Failed", False, False, "InvalidSpec", str(err)))
        return False
    ctx.actions += [Create(workload) for workload in workloads]
    if len(missing) < len(ctx.admissions):
        return True  # a pass stopped between creating the job's Workloads: the rest stand
    wait_for_kueue(
        ctx, "Queued", f"Submitted to LocalQueue {ctx.queue}: waiting for Kueue to admit it."
    )
    return False


def wait_for_kueue(ctx: Pass, reason: str, message: str) -> None:
    ctx.stop_every_stage()
    ctx.update(stages=[idle_stage(s) for s in ctx.status.stages])
    ctx.settle(Verdict("Suspended", False, False, reason, message))


def job_workload(
    ctx: Pass,
    spec: FineTuneJob,
    p: int,
    *,
    active: bool,
    plan: PlanStatus | None = None,
    priority: int | None = None,
) -> JsonDict:
    """The Workload of pipeline `p` (one Workload per pipeline) or of the whole job, for
    its recorded plan (or `plan`, grown: grow.py): one demand per planned stage. `priority`:
    the value of the job's WorkloadPriorityClass, where this pass did not read it."""
    plan = plan or ctx.status.plan
    assert plan is not None
    nodes = list(ctx.observed.nodes.values())
    placement = spec.spec.placement
    demands = [
        StageDemand(
            stage.pool,
            {
                **pool_selector(stage.pool, nodes, placement.gpu_label),
                **placement.node_selector,
            },
            stage.predicted_memory_bytes or DEFAULT_MEMORY_BYTES,
        )
        for i, split in enumerate(plan.splits())
        if not ctx.per_pipeline or i == p
        for stage in split
    ]
    return build_workload(
        ctx.job,
        demands,
        active=active,
        tolerations=[t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations],
        priority_class_name=placement.priority_class_name,
        priority=ctx.observed.priority if priority is None else priority,
        pipeline=p if ctx.per_pipeline else None,
    )


def hold_workload(ctx: Pass, p: int, workload: JsonDict, *, active: bool) -> None:
    """Keep `workload` (pipeline `p`'s, or the job's) spec.active as spec.suspend asks
    (Kueue evicts an inactive one and hands its quota on), and hand an evicted one's quota
    back once none of its stage pods is left (terminating ones count: they still hold their
    GPUs)."""
    meta = workload["metadata"]
    if bool((workload.get("spec") or {}).get("active", True)) != active:
        ctx.actions.append(PatchWorkload(meta["name"], {"spec": {"active": active}}))
    held = [key for key in ctx.observed.pods if not ctx.per_pipeline or key[0] == p]
    if read_admission(workload).state == "evicted" and not held:
        ctx.actions.append(
            ApplyWorkloadStatus(
                queueing.release_quota(workload, rfc3339(ctx.now)), ADMISSION_MANAGER
            )
        )


def hold_workloads(ctx: Pass, spec: FineTuneJob, *, active: bool) -> None:
    """`hold_workload` for each of the job's Workloads."""
    ctx.per_pipeline = per_pipeline(spec, ctx.status.plan, ctx.observed.workloads_per_pipeline)
    for p, workload in ctx.observed.workloads.items():
        hold_workload(ctx, p, workload, active=active)


def finish_workload(ctx: Pass, succeeded: bool, message: str) -> None:
    """A finished job's Workloads are marked Finished (Kueue frees their quota), before the
    job's own status says so: the job's loop stops once that status is written."""
    if ctx.queue is None:
        return
    for _, workload in sorted(ctx.observed.workloads.items()):
        conditions = (workload.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Finished" and c.get("status") == "True" for c in conditions):
            continue
        ctx.actions.append(
            ApplyWorkloadStatus(
                finished(workload, succeeded, message, rfc3339(ctx.now)), FINISHED_MANAGER
            )
        )


def flavor_placement(ctx: Pass, p: int, pool: str) -> tuple[dict[str, str], list[JsonDict]]:
    """The node labels and tolerations of the flavour Kueue assigned to `pool`'s pod set of
    pipeline `p`'s Workload (none for a job without a queue)."""
    admission = ctx.admissions.get(p if ctx.per_pipeline else 0)
    if admission is None:
        return {}, []
    name = admission.pool_flavors.get(pool)
    flavor = ctx.observed.flavors.get(name) if name else None
    return queueing.flavor_placement(flavor) if flavor is not None else ({}, [])
