"""Which pipelines of a running job leave and which come back, decided from the nodes and
the job's record (docs/operator.md, "The job follows the fleet").

- **Leaving.** A node that announces its own end — cordoned (a drain, maintenance), or
  tainted by the cluster autoscaler's scale-down, Karpenter's disruption, a cloud's spot
  or preemption notice, or the out-of-service taint — is a planned departure, not a crash:
  every pipeline with a stage on it leaves (`departure`). Its pods go without counting a
  failure, and the other pipelines train on.
- **Coming back.** A pipeline out of the job — left, or given up once a stage used up
  `maxStageRestarts` — comes back when every one of its stages fits on a free GPU of an
  eligible node (the placement of replacements decides, so a pool that is gone is
  replaced by another whose memory fits), when its wait is over (`return_wait`), and when
  the job has enough left to pay for the join (`worth_returning`).
- **Whether a return pays.** A pipeline comes back only where the job's predicted tokens/s
  rise by `GROWTH_MARGIN` (5 %) with it (`price_return`): on slower GPUs, or over links whose
  synchronisation costs more than its share brings, it would slow the pipelines it joins.
- **What if.** `if_left` answers, for a job as planned, what these rules would do if some
  of its fleet's GPUs left (`relaytrain plan --leave`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from relaytrain_operator.domain.placement import PoolRoom, choose_pool
from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    Catalog,
    ModelShape,
    Plan,
    PlanError,
    Pool,
    Sync,
    TrainingShape,
    assess,
    plan,
    plan_growth,
)
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN, JOIN_SECONDS
from relaytrain_operator.domain.status import parse_time
from relaytrain_operator.spec import FailurePolicy, PipelineStatus

DEPARTURE_TAINTS: dict[str, str] = {
    "ToBeDeletedByClusterAutoscaler": "the cluster autoscaler is removing it",
    "karpenter.sh/disrupted": "Karpenter is disrupting it",
    "karpenter.sh/disruption": "Karpenter is disrupting it",
    "cloud.google.com/impending-node-termination": "its spot or preemptible VM ends soon",
    "aws-node-termination-handler/spot-itn": "its spot instance is being reclaimed",
    "aws-node-termination-handler/scheduled-maintenance": "it has scheduled maintenance",
    "aws-node-termination-handler/asg-lifecycle-termination": "its auto-scaling group ends it",
    "node.kubernetes.io/out-of-service": "it is out of service",
    "node.cloudprovider.kubernetes.io/shutdown": "its cloud provider shut it down",
}
"""Taints that announce a node's end, by key, with why in words. Any effect counts: a
scale-down taint is NoSchedule, the out-of-service one NoExecute."""

MAX_DOUBLINGS = 6
"""A pipeline given up again and again waits at most 2**6 times returnAfterSeconds."""

MIB = 1 << 20

Layout = tuple[int, Sequence[tuple[str, int]]]
"""A pipeline as it runs: its share of each step's micro-batches and its stages' (pool,
decoder layers) in order."""


@dataclass(frozen=True)
class ReturnPrice:
    """The job's predicted tokens/s without and with a pipeline that would come back."""

    before: float
    """The pipelines training now (0: none)."""
    after: float
    """With the returning one on the pools found for it."""

    @property
    def pays(self) -> bool:
        """Whether the return raises tokens/s by `GROWTH_MARGIN` (always, with none
        training): the margin pipelines are added by (planner/growth.py says why)."""
        return self.after >= self.before * (1 + GROWTH_MARGIN) and self.after > 0

    def words(self) -> str:
        return (
            f"{self.before:,.0f} -> {self.after:,.0f} predicted tokens/s "
            f"({self.after / self.before - 1:+.0%})"
            if self.before > 0
            else f"{self.after:,.0f} predicted tokens/s"
        )


def departure(node: Mapping[str, Any] | None) -> str | None:
    """Why `node` is going away, in words ("node n1 is cordoned..."), or None when it has
    announced no end (a node already gone is a crash: recovery's, not this)."""
    if node is None:
        return None
    name = (node.get("metadata") or {}).get("name", "?")
    spec = node.get("spec") or {}
    for taint in spec.get("taints") or []:
        why = DEPARTURE_TAINTS.get(str(taint.get("key")))
        if why is not None:
            return f"node {name} has the taint {taint.get('key')}: {why}"
    if spec.get("unschedulable"):
        return f"node {name} is cordoned (a drain or maintenance)"
    return None


def return_wait(pipeline: PipelineStatus, policy: FailurePolicy, now: datetime) -> timedelta | None:
    """How long pipeline `pipeline`, out of the job, still waits before it may come back:
    zero when it may now, None when never (given up, with returnAfterSeconds 0).

    A pipeline that left with its node may come back at once on other GPUs (the node that
    announced its end is not eligible any more). One given up waits returnAfterSeconds,
    doubled for each return it has had (up to 2**MAX_DOUBLINGS), counted from when it was
    given up: a pipeline whose stages fail wherever they run costs the others little."""
    if pipeline.phase == "Left":
        return timedelta(0)
    if policy.return_after_seconds == 0:
        return None
    wait = timedelta(
        seconds=policy.return_after_seconds * 2 ** min(pipeline.returns, MAX_DOUBLINGS)
    )
    since = parse_time(pipeline.left_time)
    if since is None:
        return wait  # given up before the time was recorded: counts from this pass
    return max(timedelta(0), since + wait - now)


def worth_returning(
    eta: datetime | None, now: datetime, join_seconds: float = JOIN_SECONDS
) -> bool:
    """Whether a pipeline joining now pays: its stages load the model and take a peer's
    state before they add anything (`join_seconds`: the operator's --join-seconds, by
    default planner.growth.JOIN_SECONDS, 120 s), so a job whose estimated end is nearer
    than that finishes without it. Unknown: it pays."""
    return eta is None or eta - now > timedelta(seconds=join_seconds)


@dataclass(frozen=True)
class IfLeft:
    """What the job would do if some GPUs of its fleet left (`if_left`)."""

    lost: Mapping[str, int]
    """Pool -> GPUs that leave."""
    hit: tuple[tuple[int, int], ...]
    """(pipeline, stage) on a leaving GPU: the job's stages are assumed to sit on the leaving
    nodes first (the worst case; the scheduler decides which), highest pipeline first."""
    leaving: tuple[int, ...]
    """Pipelines that leave at a step boundary (several pipelines; one is moved instead)."""
    moves: Mapping[tuple[int, int], str]
    """(pipeline, stage) -> the pool it goes to: a moved stage (one pipeline) or a stage of
    a pipeline that comes back at once on the GPUs still free."""
    waiting: tuple[int, ...]
    """Pipelines that cannot go on or come back until their pools have room again."""
    tokens_per_second_before: float
    tokens_per_second_out: float
    """While the hit pipelines are out (0: no pipeline trains, as while one moves)."""
    shares_out: tuple[int, ...]
    """Micro-batches of each pipeline that trains on, in order (empty: none)."""
    tokens_per_second_after: float
    """Once every pipeline that fits has moved or come back (0: the job waits)."""
    held_out: Mapping[int, tuple[tuple[str, ...], ReturnPrice]] = field(default_factory=dict)
    """Pipelines that fit (on these pools) but stay out: their return does not pay
    (`paying_only`)."""
    resplit: Plan | None = None
    """One pipeline whose moved stages fit nowhere: the plan it is re-split to once its
    replacement has waited as long as that costs (domain/resplit.py); None when none fits
    either (or the job has several pipelines)."""


def price_return(
    model: ModelShape,
    training: TrainingShape,
    training_now: Sequence[Layout],
    returning: Layout,
    pools: Sequence[Pool],
    *,
    catalog: Catalog | None = None,
    sync: Sync | None = None,
) -> ReturnPrice:
    """What `returning` adds to the pipelines `training_now` (each priced where it runs,
    the step's micro-batches shared among them as the planner shares them): the operator's
    rule for a pipeline that fits on free GPUs. PlanError when a layout names a pool not in
    `pools`."""
    catalog = catalog or DEFAULT_CATALOG
    live = [assess_layout(model, training, pools, layout, catalog) for layout in training_now]
    back = assess_layout(model, training, pools, returning, catalog)
    before, _ = _speed(model, training, live, pools, catalog=catalog, sync=sync)
    after, _ = _speed(model, training, [*live, back], pools, catalog=catalog, sync=sync)
    return ReturnPrice(before, after)


def assess_layout(
    model: ModelShape,
    training: TrainingShape,
    pools: Sequence[Pool],
    layout: Layout,
    catalog: Catalog | None = None,
) -> Plan:
    """The planner's prediction of a pipeline as it runs (`layout`: its share, its stages'
    pools and layers) on `pools`."""
    micro_batches, stages = layout
    own = replace(training, micro_batches=micro_batches)
    return assess(model, own, pools, list(stages), catalog)


def shrunk_pools(pools: Sequence[Pool], leaving: Sequence[Pool]) -> list[Pool]:
    """The fleet once ``leaving`` has left ``pools``: each pool loses their GPUs (a pool
    left with none is gone). ValueError when they are not the fleet's."""
    gpus = {p.name: p.gpus for p in pools}
    for p in leaving:
        have = next((q for q in pools if q.name == p.name), None)
        if have is None or have.product != p.product:
            names = ", ".join(f"{q.name} ({q.product})" for q in pools)
            raise ValueError(f"pool {p.name!r} ({p.product}) is not in the fleet: {names}")
        gpus[p.name] -= p.gpus
    return [replace(p, gpus=gpus[p.name]) for p in pools if gpus[p.name] > 0]


def if_left(
    model: ModelShape,
    training: TrainingShape,
    pipelines: Sequence[Plan],
    pools: Sequence[Pool],
    leaving: Sequence[Pool],
    *,
    catalog: Catalog | None = None,
    sync: Sync | None = None,
    paying_only: bool = False,
    fixed_stages: int | None = None,
) -> IfLeft:
    """What the operator's rules do if ``leaving``'s GPUs leave ``pools`` while
    ``pipelines`` (the job as planned on ``pools``) train: one pipeline moves each stage on
    a leaving GPU to a free one (``choose_pool``: its pool, else the smallest that fits),
    uncounted; several lose every pipeline with such a stage, which leaves at a step
    boundary and comes back at once where all its stages fit on the GPUs still free — with
    ``paying_only`` (a job of ``replicas: auto``), only where its return pays
    (`ReturnPrice.pays`, against the pipelines training then). One pipeline whose moved
    stages fit nowhere is re-split on the GPUs left (at most its stage count;
    ``fixed_stages``: the job's fixed count, None for ``auto``), as the operator does after
    waiting."""
    catalog = catalog or DEFAULT_CATALOG
    after = shrunk_pools(pools, leaving)
    lost = {p.name: p.gpus for p in leaving}
    hit: list[tuple[int, int]] = []
    for name, k in lost.items():
        on_pool = [(i, s.index) for i in reversed(range(len(pipelines)))
                   for s in pipelines[i].stages if s.pool == name]  # fmt: skip
        hit += on_pool[:k]
    several = len(pipelines) > 1
    leaving_pipes = tuple(sorted({i for i, _ in hit})) if several else ()
    rooms = _rooms(after, pipelines, set(hit), set(leaving_pipes), catalog=catalog,
                   dtype=training.dtype)  # fmt: skip
    moves: dict[tuple[int, int], str] = {}
    waiting: list[int] = []
    back: dict[int, Plan] = {}
    held: dict[int, tuple[tuple[str, ...], ReturnPrice]] = {}
    on = [p for i, p in enumerate(pipelines) if i not in leaving_pipes] if several else []
    for i in leaving_pipes if several else sorted({i for i, _ in hit}):
        stages = pipelines[i].stages
        todo = [s for s in stages if several or (i, s.index) in hit]
        free = dict(rooms)
        chosen = _place(todo, rooms)
        if chosen is None:
            waiting.append(i)
            continue
        where = dict(zip((s.index for s in todo), chosen, strict=True))
        pools_now = [where.get(s.index, s.pool) for s in stages]
        own = replace(training, micro_batches=pipelines[i].micro_batches)
        plan_i = assess(model, own, after, [(pool, s.layer_end - s.layer_start)
                                            for pool, s in zip(pools_now, stages, strict=True)],
                        catalog)  # fmt: skip
        if several and paying_only:
            now = [*on, *back.values()]
            price = ReturnPrice(
                _speed(model, training, now, after, catalog=catalog, sync=sync)[0],
                _speed(model, training, [*now, plan_i], after, catalog=catalog, sync=sync)[0],
            )
            if not price.pays:
                rooms.clear()
                rooms.update(free)  # its GPUs stay free
                held[i] = (tuple(pools_now), price)
                continue
        moves.update({(i, k): pool for k, pool in where.items()})
        back[i] = plan_i
    out, shares = 0.0, tuple[int, ...]()
    if several:
        out, shares = _speed(model, training, on, after, catalog=catalog, sync=sync)
    finally_on = [
        back.get(i, p) for i, p in enumerate(pipelines) if i not in waiting and i not in held
    ]
    final, _ = _speed(model, training, finally_on, after, catalog=catalog, sync=sync)
    before, _ = _speed(model, training, list(pipelines), pools, catalog=catalog, sync=sync)
    resplit = None
    if waiting and not several:
        with suppress(PlanError):
            resplit = plan(model, training, after, catalog, stages=fixed_stages,
                           max_stages=len(pipelines[0].stages), suggest=False)  # fmt: skip
            final = resplit.tokens_per_second
    return IfLeft(lost, tuple(sorted(hit)), leaving_pipes, moves, tuple(waiting), before,
                  out, shares, final, held, resplit)  # fmt: skip


def _rooms(
    after: Sequence[Pool],
    pipelines: Sequence[Plan],
    hit: set[tuple[int, int]],
    leaving: set[int],
    *,
    catalog: Catalog,
    dtype: str,
) -> dict[str, PoolRoom]:
    """Free GPUs per pool once the GPUs have left: what no stage that stays holds."""
    used: dict[str, int] = {}
    for i, p in enumerate(pipelines):
        for s in p.stages:
            if i not in leaving and (i, s.index) not in hit:
                used[s.pool] = used.get(s.pool, 0) + 1
    return {
        p.name: PoolRoom(max(p.gpus - used.get(p.name, 0), 0),
                         p.memory_mib or catalog[p.product].memory_mib)
        for p in after
        if catalog[p.product].supports(dtype)  # the operator's rule: a V100 takes no bf16
    }  # fmt: skip


def _place(stages: Sequence[Any], rooms: dict[str, PoolRoom]) -> list[str] | None:
    """A pool for every one of ``stages`` (the operator's choose_pool, in stage order), the
    GPUs taken from ``rooms``; None, ``rooms`` untouched, when one does not fit."""
    trial = dict(rooms)
    chosen = []
    for s in stages:
        pool = choose_pool(s.pool, -(-s.memory_bytes // MIB), trial)
        room = trial.get(pool)
        if room is None or room.free_gpus <= 0:
            return None
        trial[pool] = PoolRoom(room.free_gpus - 1, room.memory_mib)
        chosen.append(pool)
    rooms.update(trial)
    return chosen


def _speed(
    model: ModelShape,
    training: TrainingShape,
    pipelines: Sequence[Plan],
    pools: Sequence[Pool],
    *,
    catalog: Catalog,
    sync: Sync | None,
) -> tuple[float, tuple[int, ...]]:
    """Tokens/s of ``pipelines`` training together (the step's micro-batches shared among
    them, their sync priced) and their shares; (0, ()) for none."""
    if not pipelines:
        return 0.0, ()
    growth = plan_growth(model, training, pipelines, pools, [], steps_left=1, catalog=catalog,
                         sync=sync)  # fmt: skip
    return growth.tokens_per_second_before, growth.shares
