"""The flow of one pass: which branch a job is in, and what the pass must read for it.

The branches, in order: a job gone or being deleted (nothing: the garbage collector takes
its children); a spec the operator cannot run (InvalidSpec); a finished job (its pods go);
a suspended one (pods go, plan and counts stay); the first plan (Planned, ModelUnavailable,
Unschedulable); then per stage keep, create, replace or wait (recovery.decide), with a
replacement placed by `placement.place_replacements` after `failurePolicy.backoffSeconds`
(and a job of one pipeline re-split when its replacement waited for a GPU as long as that
costs: resplit.py), and the job Failed once a stage has used up `maxStageRestarts`; finally
progress and completion. A job submitted to Kueue waits for its admission between the plan
and the stages (admission.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from relaytrain_operator.domain.builders.labels import StageKey
from relaytrain_operator.domain.queueing import queue_name
from relaytrain_operator.domain.status import (
    Verdict,
    idle_stage,
    is_terminal,
    load_status,
    parse_time,
)
from relaytrain_operator.loop.decide.admission import admitted, hold_workloads, plan
from relaytrain_operator.loop.decide.context import (
    Decision,
    JsonDict,
    Needs,
    Observed,
    Pass,
    Settings,
    given_up,
    parse_spec,
    planned_keys,
    started,
)
from relaytrain_operator.loop.decide.grow import growable
from relaytrain_operator.loop.decide.resplit import waiting_since
from relaytrain_operator.loop.decide.stages import run_stages
from relaytrain_operator.spec import FineTuneJob, is_s3


def needs(job: JsonDict, pods: Mapping[StageKey, JsonDict], now: datetime | None = None) -> Needs:
    """Which costly inputs `decide` needs for `job`, given its stage pods as indexed, at
    `now` (None: no time-driven read, the link Secret's)."""
    spec = parse_spec(job)
    status = load_status(job.get("status"))
    if isinstance(spec, str) or is_terminal(status):
        return Needs()
    queued = queue_name(job) is not None
    if spec.spec.suspend:
        return Needs(workload=queued)
    if not started(status):
        return Needs(room=True, model=True, inputs=True, workload=queued)
    assert status.plan is not None
    out = given_up(status)
    missing = any(key not in pods for key in planned_keys(status.plan) if key[0] not in out)
    links = status.link_certificates
    due = parse_time(links.next_step_at) if links is not None else None
    returned = any(p.returns for p in status.pipelines or ())
    # A pipeline out comes back where it fits (and, with `replicas: auto`, where its
    # return pays): one that left, or one given up while the policy tries those again. The
    # model prices leaving and coming back (the observer reads its config once a job).
    again = spec.spec.failure_policy.return_after_seconds > 0
    returnable = any(
        p.phase == "Left" or (p.phase == "Failed" and again) for p in status.pipelines or ()
    )
    # A replacement waiting for a GPU moves to a pool with one free (create.rehome_waiting):
    # that needs the nodes and the pods. In a job of one pipeline it may also have the job
    # re-split for the GPUs free (resplit.py): the planner needs the model too.
    waiting = waiting_since(pods.values()) is not None
    waits = not status.plan.several() and waiting
    # A job of `replicas: auto` whose pipelines train may grow on GPUs that joined (grow.py):
    # the free GPUs, the model and the link Secret (certificates for the added stages, and
    # for any planned stage still without one: a pass stopped after the plan). Under Kueue
    # only with a Workload per pipeline: the layout is not read yet, the one it would have.
    grows = growable(spec, status, queued)
    # A job of one pipeline trains on a re-split: it may be re-split back as GPUs free up
    # (resplit.resplit_back): the planner needs the nodes, the pods and the model.
    back = status.plan.resplit_from is not None
    # A pipeline added under Kueue that has not started (it waits for its Workload): its
    # stages' certificates are made sure of before Kueue admits it and its pods start.
    unborn = any(
        p.phase == "Left" and p.added_at_step is not None and not p.returns
        for p in status.pipelines or ()
    )
    return Needs(
        link_secret=now is not None and (due is None or now >= due or missing or grows or unborn),
        pods=missing,
        room=missing or returnable or waiting or grows or back,
        model=status.plan.several() or waits or grows or back,
        progress=is_s3(spec.spec.checkpoint.uri),
        workload=queued,
        given_up=(bool(out) or returned) and is_s3(spec.spec.checkpoint.uri),
    )


def decide(observed: Observed, settings: Settings) -> Decision:
    """The actions and new status for the job in `observed`."""
    job = observed.job
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        # Gone, or going: the garbage collector deletes its children (owner references).
        return Decision()
    ctx = Pass(job, observed, settings)
    _reconcile(ctx)
    return ctx.decision()


def _reconcile(ctx: Pass) -> None:
    spec = parse_spec(ctx.job)
    if isinstance(spec, str):
        ctx.settle(Verdict("Failed", False, False, "InvalidSpec", spec))
        return
    if is_terminal(ctx.written):
        ctx.remove_pods()
        return
    if spec.spec.suspend:
        _suspend(ctx, spec)
        return
    if not started(ctx.status) and not plan(ctx, spec):
        return
    if ctx.queue is not None and not admitted(ctx, spec):
        return
    run_stages(ctx, spec)


def _suspend(ctx: Pass, spec: FineTuneJob) -> None:
    """spec.suspend: the pods go (and a queued job's Workload goes inactive); plan, counts
    and progress stay."""
    ctx.stop_every_stage()
    ctx.update(stages=[idle_stage(s) for s in ctx.status.stages])
    if ctx.queue is not None:
        hold_workloads(ctx, spec, active=False)
    ctx.settle(
        Verdict(
            "Suspended",
            False,
            False,
            "Suspended",
            "spec.suspend is true: the stage pods are removed; setting it to false "
            "resumes from the last committed checkpoint.",
        )
    )
