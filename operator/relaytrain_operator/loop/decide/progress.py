"""How a started job ends: the workers' progress folded into status, and the two outcomes.

The job Succeeded once progress.json says done, or once every stage pod of the pipelines
not given up Succeeded: its pods go and `status.output` names the result. It Failed once
the last pipeline left used up spec.failurePolicy.maxStageRestarts: its pods go. Either way
a job submitted to Kueue has its Workload marked Finished before its own status says so.
"""

from __future__ import annotations

from relaytrain_operator.domain.stage_config import output_uri
from relaytrain_operator.domain.status import OUT_PHASES, Verdict, idle_stage
from relaytrain_operator.loop.decide.admission import finish_workload
from relaytrain_operator.loop.decide.context import Pass
from relaytrain_operator.spec import FineTuneJob, OutputStatus, ProgressStatus


def follow_progress(ctx: Pass, spec: FineTuneJob, out: set[int]) -> bool:
    """Fold progress.json into status; True if the job finished (and was settled)."""
    progress = ctx.observed.progress
    if progress is not None:
        ctx.update(progress=ProgressStatus.model_validate(progress.status))
    stages, pods = ctx.status.stages, ctx.observed.pods
    live = [s for s in stages if (s.pipeline or 0) not in out]
    all_done = (
        bool(live)
        and len(pods) == len(live)
        and all((p.get("status") or {}).get("phase") == "Succeeded" for p in pods.values())
    )
    reported_done = progress is not None and progress.done
    if not (reported_done or all_done):
        return False
    uri = (progress.output if progress is not None else None) or output_uri(spec)
    ctx.update(output=OutputStatus(uri=uri))
    ctx.remove_pods()
    # Every pipeline not given up finished with the job, whatever its pods said last.
    pipelines = [
        p if p.phase in OUT_PHASES else p.model_copy(update={"phase": "Succeeded"})
        for p in ctx.status.pipelines or ()
    ]
    ctx.update(stages=[idle_stage(s) for s in stages], pipelines=pipelines or None)
    finish_workload(ctx, True, f"Training finished; the result is at {uri}.")
    ctx.settle(
        Verdict(
            "Succeeded",
            True,
            False,
            "Succeeded",
            f"Training finished; the result is at {uri}.",
        )
    )
    return True


def fail(ctx: Pass, why: str, reason: str = "BackoffLimitExceeded") -> None:
    """The job is Failed and its pods go: the policy allows no more restarts (of the last
    pipeline left), or a stage stopped on input no restart can fix (`reason` one of
    domain.status.WORKER_REASONS)."""
    ctx.remove_pods()
    ctx.update(stages=[idle_stage(s) for s in ctx.status.stages])
    finish_workload(ctx, False, why)
    ctx.settle(Verdict("Failed", False, False, reason, why))
