"""The first plan, and Kueue's admission of a job submitted to a LocalQueue (queueing.py).

A job's first pass plans it (`planning.make_plan`) and records the plan and `startTime`
before any pod exists (Planned, ModelUnavailable, Unschedulable). A job with a queue label
is planned for the whole fleet, not for the GPUs free now; its Workload is created from the
recorded plan, kept active as spec.suspend asks, and its pods are created only once Kueue
admits it, with the labels and tolerations of the flavours Kueue assigned. Until then, or
once evicted, it has no pods and is Suspended with Kueue's words; an evicted Workload's
quota is handed back once no pod is left, and a finished job's Workload is marked Finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relaytrain_operator.domain import queueing
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
    QueueError,
    StageDemand,
    build_workload,
    finished,
    priority_class_of,
    read_admission,
)
from relaytrain_operator.domain.status import (
    READY,
    Verdict,
    condition,
    idle_stage,
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
from relaytrain_operator.spec import FineTuneJob, PlanStatus, StageStatus

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


def admitted(ctx: Pass, spec: FineTuneJob) -> bool:
    """A job submitted to a LocalQueue: its Workload created, kept active, and True once
    Kueue admits it; otherwise its pods go (an evicted workload's quota is handed back
    once none is left) and the job is Suspended with Kueue's words."""
    admission = read_admission(ctx.observed.workload)
    ctx.admission = admission
    if admission.state == "missing":
        return _submit(ctx, spec)
    if not admission.active:
        hold_workload(ctx, active=True)
    if admission.state == "admitted":
        ready = condition(ctx.written, READY)
        if ready is not None and ready.reason in QUEUE_REASONS:
            flavors = ", ".join(f"{p} → {f}" for p, f in sorted(admission.pool_flavors.items()))
            ctx.event("Normal", "Admitted", f"{admission.message} (flavors: {flavors}).")
        return True
    if admission.state in ("evicted", "released"):
        release_quota(ctx)
        wait_for_kueue(
            ctx,
            "Evicted",
            f"Kueue evicted the workload ({admission.reason}: {admission.message}); the "
            "stage pods are removed and it resumes from the last committed checkpoint "
            "when Kueue admits it again.",
        )
        return False
    if admission.message:
        # Pending: no quota now; Inadmissible: it cannot be admitted as it stands (its
        # LocalQueue or ClusterQueue missing or inactive): Kueue's words either way.
        reason = "WaitingForQuota" if admission.reason == "Pending" else "Inadmissible"
        wait_for_kueue(ctx, reason, f"LocalQueue {ctx.queue}: {admission.message}")
    else:
        wait_for_kueue(
            ctx, "Queued", f"Submitted to LocalQueue {ctx.queue}: waiting for Kueue to admit it."
        )
    return False


def _submit(ctx: Pass, spec: FineTuneJob) -> bool:
    """Create the job's Workload (it has none yet) and wait; False always."""
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
        workload = job_workload(ctx, spec, active=True)
    except QueueError as err:
        ctx.settle(Verdict("Failed", False, False, "InvalidSpec", str(err)))
        return False
    ctx.actions.append(Create(workload))
    wait_for_kueue(
        ctx, "Queued", f"Submitted to LocalQueue {ctx.queue}: waiting for Kueue to admit it."
    )
    return False


def wait_for_kueue(ctx: Pass, reason: str, message: str) -> None:
    ctx.remove_pods()
    ctx.update(stages=[idle_stage(s) for s in ctx.status.stages])
    ctx.settle(Verdict("Suspended", False, False, reason, message))


def job_workload(ctx: Pass, spec: FineTuneJob, *, active: bool) -> JsonDict:
    """The job's Workload for its recorded plan: one demand per planned stage."""
    plan = ctx.status.plan
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
        for split in plan.splits()
        for stage in split
    ]
    return build_workload(
        ctx.job,
        demands,
        active=active,
        tolerations=[t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations],
        priority_class_name=placement.priority_class_name,
        priority=ctx.observed.priority,
    )


def hold_workload(ctx: Pass, *, active: bool) -> None:
    """Keep the Workload's spec.active as spec.suspend asks (Kueue evicts an inactive
    one and hands its quota on); an evicted one's quota is handed back once no pod is
    left."""
    workload = ctx.observed.workload
    if workload is None:
        return
    meta = workload["metadata"]
    if bool((workload.get("spec") or {}).get("active", True)) != active:
        ctx.actions.append(PatchWorkload(meta["name"], {"spec": {"active": active}}))
    if not active:
        release_quota(ctx)


def release_quota(ctx: Pass) -> None:
    """Hand an evicted Workload's quota back once no stage pod is left (terminating ones
    count: they still hold their GPUs)."""
    workload = ctx.observed.workload
    if (
        workload is not None
        and read_admission(workload).state == "evicted"
        and not ctx.observed.pods
    ):
        ctx.actions.append(
            ApplyWorkloadStatus(
                queueing.release_quota(workload, rfc3339(ctx.now)), ADMISSION_MANAGER
            )
        )


def finish_workload(ctx: Pass, succeeded: bool, message: str) -> None:
    """A finished job's Workload is marked Finished (Kueue frees its quota), before the
    job's own status says so: the job's loop stops once that status is written."""
    workload = ctx.observed.workload
    if ctx.queue is None or workload is None:
        return
    conditions = (workload.get("status") or {}).get("conditions") or []
    if any(c.get("type") == "Finished" and c.get("status") == "True" for c in conditions):
        return
    ctx.actions.append(
        ApplyWorkloadStatus(
            finished(workload, succeeded, message, rfc3339(ctx.now)), FINISHED_MANAGER
        )
    )


def flavor_placement(ctx: Pass, pool: str) -> tuple[dict[str, str], list[JsonDict]]:
    """The node labels and tolerations of the flavour Kueue assigned to `pool`'s pod
    set (none for a job without a queue)."""
    if ctx.admission is None:
        return {}, []
    name = ctx.admission.pool_flavors.get(pool)
    flavor = ctx.observed.flavors.get(name) if name else None
    return queueing.flavor_placement(flavor) if flavor is not None else ({}, [])
