"""The pipelines of a running job as its fleet changes: those whose node announced its end
leave, and those out of the job come back where they fit (domain/membership.py decides
which; docs/operator.md, "The job follows the fleet").

A pipeline that leaves has its pods deleted (SIGTERM, then the pod's grace period) without
a failure counted, its stages idle, and its life recorded in status.pipelines[] (at which
step, when, why); the stages of the others learn from the store that it is out, as of a
pipeline given up. One that comes back has its stages created afresh, their restart
counts at zero, on the pools the placement found free, after the store no longer names it:
its stages rejoin the pipelines training at a step boundary with their state (or, with none
training, every pipeline restores the last commit). One pipeline comes back per pass, so
the next pass sees its pods hold their GPUs before it places another. One whose return
would not raise the job's predicted tokens/s by `GROWTH_MARGIN` stays out, and says so in
status.pipelines[i].heldOut and a PipelineHeldOut Event (once per different reason).
"""

from __future__ import annotations

from datetime import timedelta

from relaytrain_operator.domain.builders.labels import StageKey
from relaytrain_operator.domain.membership import (
    Layout,
    ReturnPrice,
    departure,
    price_return,
    return_wait,
    worth_returning,
)
from relaytrain_operator.domain.placement import Choice, job_pools, place_replacements
from relaytrain_operator.domain.planner import ModelShape, PlanError, PoolError
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN
from relaytrain_operator.domain.planning import job_sync, training_shape
from relaytrain_operator.domain.resplit import resplit_wait
from relaytrain_operator.domain.status import (
    OUT_PHASES,
    idle_stage,
    parse_time,
    pipeline_statuses,
    rfc3339,
    short_of,
)
from relaytrain_operator.loop.decide.context import Pass, stage_memory
from relaytrain_operator.loop.decide.resplit import waiting_since
from relaytrain_operator.loop.decide.waiting import waiting_moves
from relaytrain_operator.spec import (
    FineTuneJob,
    PipelineStatus,
    PlanStatus,
    StageStatus,
    is_s3,
)

NEXT_RETURN_SECONDS = 5.0
"""After a pipeline came back, how soon the pass looks for room for the next."""


def leave_departing(ctx: Pass, spec: FineTuneJob, plan: PlanStatus, out: set[int]) -> set[int]:
    """The pipelines not `out` with a stage pod on a node that announced its end, or whose
    stage's replacement waited for a GPU as long as a re-split costs (`_outwaited`): each
    leaves now (its pods deleted, its stages idled, a PipelineLeaving
    Event with the job's predicted tokens/s before and while it is out). Returns them."""
    leaving: dict[int, str] = {}
    if not plan.several():
        return set()  # one pipeline: a drained stage is moved, uncounted (stages._move)
    for (p, _), pod in sorted(ctx.observed.pods.items()):
        # A pod being deleted counts too: a drain evicts the pods of a cordoned node.
        if p in out or p in leaving:
            continue
        node_name = (pod.get("spec") or {}).get("nodeName")
        why = departure(ctx.observed.nodes.get(node_name)) if node_name else None
        if why is not None:
            leaving[p] = why
    for entry in ctx.status.stages:
        # A pod already gone (an eviction the pass did not see) from a node that announced
        # its end left with it: no failure either.
        p = entry.pipeline or 0
        if p in out or p in leaving or (p, entry.index) in ctx.observed.pods or not entry.node:
            continue
        why = departure(ctx.observed.nodes.get(entry.node))
        if why is not None:
            leaving[p] = why
    outwaited = _outwaited(ctx, spec, out | set(leaving))
    leaving.update(outwaited)
    retiring = set(outwaited) if ctx.queue is not None else set()
    queued = _unadmitted(ctx, out | set(leaving))
    leaving.update(queued)
    for p, why in leaving.items():
        price = _price(ctx, spec, plan, out=out | {p}, p=p)
        ctx.remove_pods(p)
        stages = [idle_stage(s) if (s.pipeline or 0) == p else s for s in ctx.status.stages]
        # The first pass of a job whose pipeline Kueue has not admitted records none yet.
        known = ctx.status.pipelines or pipeline_statuses(plan, stages, out)
        before = departed(ctx, known, p, "Left", why, retired=p in retiring)
        ctx.update(stages=stages, pipelines=pipeline_statuses(plan, stages, out | {p}, before))
        out = out | {p}
        ctx.event(
            "Warning",
            "PipelineLeaving",
            f"Pipeline {p} leaves at step {ctx.step()}: {why}. Its stage pods are removed "
            "without counting a failure; the other pipelines train on"
            + (f" ({ReturnPrice(price.after, price.before).words()})" if price is not None else "")
            + _after_leaving(ctx, p in retiring, p in queued),
        )
    return set(leaving)


def _after_leaving(ctx: Pass, retiring: bool, queued: bool) -> str:
    """What becomes of a pipeline that leaves, in its PipelineLeaving Event."""
    if retiring:
        return (
            f". It does not come back: its Workload is given back to LocalQueue {ctx.queue} "
            "(its quota released once its pods are gone), and a pipeline shaped for the GPUs "
            "free is asked of Kueue in its place, where one pays."
        )
    if queued:
        return ". It comes back once Kueue admits its Workload."
    return ". It comes back where its stages fit on free GPUs."


def _unadmitted(ctx: Pass, skip: set[int]) -> dict[int, str]:
    """With one Workload per pipeline (admission.per_pipeline): the pipelines (not in
    `skip`) whose Workload Kueue has not admitted, or evicted (a higher priority took its
    quota), and why. Each is out until Kueue admits it; an evicted one's quota is handed
    back once its pods are gone (admission.hold_workload)."""
    if not ctx.per_pipeline:
        return {}
    return {
        p: admission.why_out()
        for p, admission in sorted(ctx.admissions.items())
        if p not in skip and admission.state != "admitted"
    }


def _outwaited(ctx: Pass, spec: FineTuneJob, skip: set[int]) -> dict[int, str]:
    """The pipelines (not in `skip`) whose stage's replacement has waited for a GPU as long
    as a re-split costs (`--join-seconds`, the rule of resplit.py): each leaves, why, so that
    it comes back where its stages fit, or the GPUs free are priced for a pipeline shaped
    for them (grow.py: growth past pipelines out; with a fixed count, one that takes its
    place). Under Kueue only with one Workload per pipeline, and for good (`retired`): its
    Workload is given back, and the pipeline shaped for the GPUs free is asked of Kueue with
    a Workload of its own (its admission was for the pools it cannot fit on now). Not with a
    store the stages cannot be told through (s3://), nor a job under one Workload."""
    if not is_s3(spec.spec.checkpoint.uri) or (ctx.queue is not None and not ctx.per_pipeline):
        return {}
    cost = ctx.settings.join_seconds
    outwaited: dict[int, str] = {}
    assert ctx.status.plan is not None
    # One a pool has a GPU for moves there alone instead (create.rehome_waiting).
    movable = {p for p, _ in waiting_moves(ctx, spec, ctx.status.plan)}
    for (p, k), pod in sorted(ctx.observed.pods.items()):
        since = waiting_since([pod])
        if p in skip or p in outwaited or p in movable or since is None:
            continue
        wait = resplit_wait(since, ctx.now, cost)
        if wait:
            ctx.wake_within(wait.total_seconds())
            continue
        outwaited[p] = (
            f"the replacement of its stage {k} waited {int((ctx.now - since).total_seconds())} s "
            f"for a GPU (as long as a re-split costs: --join-seconds {cost:.0f})"
        )
    return outwaited


def stage_departure(ctx: Pass, key: StageKey, entry: StageStatus) -> str | None:
    """Why the node of stage `key`'s pod (or, the pod gone, the node its entry recorded)
    announced its end, or None: a stage that ends there moved, it did not fail."""
    pod = ctx.observed.pods.get(key)
    node_name = ((pod or {}).get("spec") or {}).get("nodeName") or entry.node
    return departure(ctx.observed.nodes.get(node_name)) if node_name else None


def departed(
    ctx: Pass,
    pipelines: list[PipelineStatus] | None,
    p: int,
    phase: str,
    why: str,
    *,
    retired: bool = False,
) -> list[PipelineStatus]:
    """`pipelines` with pipeline `p` out (`phase` Left or Failed) since now, at the job's
    last step, for `why` (`retired`: for good, its Workload given back)."""
    life: dict[str, object] = {
        "phase": phase, "left_at_step": ctx.step(), "left_time": rfc3339(ctx.now),
    }  # fmt: skip
    if retired:
        life["retired"] = True
    return [
        s.model_copy(update={**life, "left_reason": why}) if s.index == p else s
        for s in pipelines or ()
    ]


def bring_back(
    ctx: Pass,
    spec: FineTuneJob,
    plan: PlanStatus,
    out: set[int],
    entries: dict[StageKey, StageStatus],
) -> list[StageKey]:
    """The first pipeline `out` that may come back now and fits: its stages' entries made
    fresh on the pools found free (in `entries`), its return recorded and told in a
    PipelineAdded Event; returns its stages to create ([] when none comes back)."""
    cluster_pods = ctx.observed.cluster_pods
    progress = ctx.status.progress
    eta = parse_time(progress.eta) if progress is not None else None
    if cluster_pods is None or not worth_returning(eta, ctx.now, ctx.settings.join_seconds):
        return []
    nodes = list(ctx.observed.nodes.values())
    waits: list[timedelta] = []
    wanted = spec.spec.pipeline.replicas
    for pipeline in ctx.status.pipelines or ():
        p = pipeline.index
        if p not in out or pipeline.phase not in OUT_PHASES or pipeline.retired:
            continue
        if ctx.per_pipeline and ctx.admissions[p].state != "admitted":
            continue  # it waits for Kueue to admit its Workload (again)
        if wanted != "auto" and not short_of(plan, len(out), int(wanted)):
            continue  # a fixed count trains its N (one added in the place of one out)
        if any(key[0] == p for key in ctx.observed.pods):
            continue  # its last pods are still going: their names are taken
        dated = pipeline if pipeline.left_time else _since_now(ctx, pipeline)  # given up before
        wait = return_wait(dated, spec.spec.failure_policy, ctx.now)
        if wait is None:
            continue
        if wait:
            waits.append(wait)
            continue
        keys = [key for key in sorted(entries) if key[0] == p]
        stages = {
            key: (
                entries[key].pool or plan.splits()[p][key[1]].pool,
                stage_memory(plan, key),
            )
            for key in keys
        }
        choices = place_replacements(spec, stages, nodes, cluster_pods, ctx.settings.catalog)
        # Under Kueue a stage stays on the pool it was admitted on (quota Kueue granted).
        if not all(
            c.free and (ctx.queue is None or c.pool == stages[k][0]) for k, c in choices.items()
        ):
            continue
        price = _price(
            ctx, spec, plan, out=out, p=p, chosen={k: c.pool for k, c in choices.items()}
        )
        # With `replicas: auto` only a return that pays; a fixed count is what the user asked,
        # and a pipeline Kueue admitted holds its quota whether it trains or not.
        if price is not None and wanted == "auto" and not price.pays and not ctx.per_pipeline:
            _hold_out(ctx, dated, price, choices)
            continue
        for key in keys:
            entries[key] = StageStatus(
                index=key[1], pipeline=p if plan.several() else None, pool=choices[key].pool
            )
        _record_return(ctx, dated)
        pools = ", ".join(choices[key].pool for key in keys)
        ctx.event(
            "Normal",
            "PipelineAdded",
            f"Pipeline {p} comes back after step {ctx.step()} ({_was(dated)}): its "
            f"{len(keys)} stages fit on free GPUs ({pools}). It rejoins the pipelines "
            "training at a step boundary with their state."
            + (f" With it: {price.words()}." if price is not None else ""),
        )
        ctx.wake_within(NEXT_RETURN_SECONDS)
        return keys
    if waits:
        ctx.wake_within(min(waits).total_seconds())
    return []


def _price(
    ctx: Pass,
    spec: FineTuneJob,
    plan: PlanStatus,
    *,
    out: set[int],
    p: int,
    chosen: dict[StageKey, str] | None = None,
) -> ReturnPrice | None:
    """What pipeline `p` on the pools `chosen` (None: those its stages hold now) adds to the
    pipelines not `out` (each on the pools its stages hold now, with its planned share);
    None where it cannot be priced (the model's config unread, nodes the planner cannot make
    pools of, a stage on a pool no node makes now): then the Events say no figure, and a
    pipeline comes back as before the rule."""
    model, planned = ctx.observed.model, plan.pipelines
    if model is None or model.config is None:
        return None
    assert planned, "only a job of several pipelines has one out"
    pools_now = {(s.pipeline or 0, s.index): s.pool for s in ctx.status.stages if s.pool}

    def layout(i: int, pool_of: dict[StageKey, str]) -> Layout:
        stages = plan.splits()[i]
        return planned[i].micro_batches, [
            (pool_of.get((i, s.index)) or s.pool, s.layer_end - s.layer_start) for s in stages
        ]

    try:
        training = training_shape(spec, plan.compression, plan.forwards_ahead)
        nodes = list(ctx.observed.nodes.values())
        return price_return(
            ModelShape.from_hf_config(model.config),
            training,
            [layout(i, pools_now) for i in range(len(planned)) if i not in out],
            layout(p, pools_now if chosen is None else chosen),
            job_pools(spec, nodes, [], default_link=ctx.settings.default_link,
                      require_ready=False),
            catalog=ctx.settings.catalog,
            sync=job_sync(spec),
        )  # fmt: skip
    except (PlanError, PoolError, ValueError):
        return None


def _hold_out(
    ctx: Pass, pipeline: PipelineStatus, price: ReturnPrice, choices: dict[StageKey, Choice]
) -> None:
    """Keep `pipeline` out although it fits: say why in its status and, when the reason is
    new, in a PipelineHeldOut Event."""
    pools = ", ".join(choices[key].pool for key in sorted(choices))
    why = (
        f"its stages fit on free GPUs ({pools}), but its return would not raise the job's "
        f"predicted tokens/s by {GROWTH_MARGIN:.0%}: {price.words()}"
    )
    if pipeline.held_out == why:
        return
    _replace(ctx, pipeline.model_copy(update={"held_out": why}))
    ctx.event(
        "Normal",
        "PipelineHeldOut",
        f"Pipeline {pipeline.index} stays out: {why}. It comes back when a return pays.",
    )


def _record_return(ctx: Pass, pipeline: PipelineStatus) -> None:
    update = {
        "phase": "Pending",
        "returns": pipeline.returns + 1,
        "returned_at_step": ctx.step(),
        "held_out": None,
    }
    _replace(ctx, pipeline.model_copy(update=update))


def _since_now(ctx: Pass, pipeline: PipelineStatus) -> PipelineStatus:
    dated = pipeline.model_copy(update={"left_time": rfc3339(ctx.now)})
    _replace(ctx, dated)
    return dated


def _replace(ctx: Pass, pipeline: PipelineStatus) -> None:
    ctx.update(
        pipelines=[pipeline if p.index == pipeline.index else p for p in ctx.status.pipelines or ()]
    )


def _was(pipeline: PipelineStatus) -> str:
    what = "it left" if pipeline.phase == "Left" else "given up"
    at = f" at step {pipeline.left_at_step}" if pipeline.left_at_step is not None else ""
    return f"{what}{at}: {pipeline.left_reason}" if pipeline.left_reason else f"{what}{at}"
