"""`plan_growth()`: which pipelines to add to a running job when GPUs become free.

A running job's pipelines stay as they are (no survivor moves: moving one would roll back
its work and re-load its slice). On the GPUs free for the job, the candidates of
`fleet_candidates` (every useful multiset of free GPUs with its best split) are added one at
a time, the one that shortens the step the most first, while one does and the job may take
another pipeline; the step of every set is the fleet planner's (`Combiner.value`: the
slowest pipeline for its exact share of the micro-batches, plus the sync of the whole set).

Whether the additions are made is a rule, not a preference, so that a fleet that changes
often does not churn the job:

- they must raise predicted tokens/s by at least `GROWTH_MARGIN` (5 %): the cost model's
  predictions land within a few percent of measured runs (docs/planner.md, "plan against
  measured"), so a smaller predicted gain may be no gain at all; and
- the time they save over the steps left, once they have joined, must exceed what joining
  costs (`join_seconds`: the new stages' pods start and load their slices, and a live
  pipeline hands them its state): a job near its end keeps its fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from relaytrain_operator.domain.planner.api import to_plan
from relaytrain_operator.domain.planner.catalog import Catalog
from relaytrain_operator.domain.planner.cost import CostSettings
from relaytrain_operator.domain.planner.fleet_candidates import (
    Pipe,
    candidates,
    pipe_of_plan,
    undominated,
)
from relaytrain_operator.domain.planner.fleet_combiner import Combiner
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.pools import Pool
from relaytrain_operator.domain.planner.problem import Problem, build_problem
from relaytrain_operator.domain.planner.result import Plan, PlanError
from relaytrain_operator.domain.planner.shares import split_fast
from relaytrain_operator.domain.planner.sync import Gradients, Sync, collective_of
from relaytrain_operator.domain.planner.training import TrainingShape

__all__ = ["GROWTH_MARGIN", "JOIN_SECONDS", "Growth", "plan_growth"]

GROWTH_MARGIN = 0.05
"""The least rise of predicted tokens/s for which pipelines are added (module doc)."""
FILL_STARTS = 8
"""Shapes (the best per GPU) the search also starts from, as many copies as help."""
JOIN_SECONDS = 120.0
"""What joining costs by default: pods started, slices loaded, the state handed over."""


@dataclass(frozen=True)
class Growth:
    """What adding pipelines to a running job would do, and whether to do it."""

    added: tuple[Plan, ...]
    """The pipelines to add, each with its share of the step (`Plan.micro_batches`); empty
    when none shortens the step."""
    shares: tuple[int, ...]
    """Micro-batches per step of every pipeline after the change: the running ones in the
    order given, then the added ones."""
    step_seconds_before: float
    step_seconds_after: float
    tokens_per_second_before: float
    tokens_per_second_after: float
    pays: bool
    """Whether to make the change (the module doc's rule)."""
    reason: str
    """Why, or why not, in words for an Event."""
    sets_evaluated: int
    """Sets of pipelines priced."""

    @property
    def gain(self) -> float:
        """Predicted tokens/s after over before, less one."""
        return self.tokens_per_second_after / self.tokens_per_second_before - 1.0


def plan_growth(
    model: ModelShape,
    training: TrainingShape,
    running: Sequence[Plan],
    pools: Sequence[Pool],
    free: Sequence[Pool],
    *,
    steps_left: int,
    catalog: Catalog | None = None,
    settings: CostSettings | None = None,
    sync: Sync | None = None,
    stages: int | None = None,
    max_pipelines: int | None = None,
    join_seconds: float = JOIN_SECONDS,
    margin: float = GROWTH_MARGIN,
) -> Growth:
    """The pipelines to add to ``running`` (the job's pipelines, on ``pools``: every pool
    they use, with its GPU count) on the GPUs of ``free`` (pools with the GPUs free for the
    job now; empty: none), at most ``max_pipelines`` in all (None: one per micro-batch),
    each of ``stages`` stages if given. ``training.micro_batches`` is the whole step's.

    Raises ValueError when ``running`` is empty (a job without a pipeline is planned anew
    with ``plan_fleet``) or names a pool ``pools`` lacks.
    """
    if not running:
        raise ValueError("a running job has at least one pipeline: plan it with plan_fleet")
    sync = sync or Sync()
    collective = collective_of(sync, (settings or CostSettings()).sync_collective)
    grads = Gradients.of(model, training, sync)
    whole = build_problem(model, training, pools, catalog, settings)
    known = {cost.pool.name for cost in whole.costs}
    missing = sorted({s.pool for p in running for s in p.stages} - known)
    if missing:
        raise ValueError(f"the running pipelines use pools the fleet lacks: {missing}")
    fixed = [pipe_of_plan(whole, grads, p) for p in running]
    limit = min(max_pipelines or training.micro_batches, training.micro_batches)
    extra = _free_problem(model, training, free, catalog, settings) if len(fixed) < limit else None
    options = (
        undominated(candidates(extra, grads, stages), training.micro_batches)
        if extra is not None
        else []
    )
    room = list(extra.gpus) if extra is not None else [0]
    combiner = Combiner(
        options,
        room,
        [(c.latency_s, c.bandwidth_bytes_per_s) for c in extra.costs] if extra else [(0.0, 1.0)],
        micro_batches=training.micro_batches,
        sync=sync,
        collective=collective,
        adapters=training.method != "full",
    )
    before = combiner.value(fixed)
    if before is None:
        raise ValueError("a running pipeline would get no micro-batch of the step")
    # Greedy from the running set, and greedy after the best number of copies of one of the
    # best shapes per GPU (a fleet of like GPUs is often best cut into like pipelines, and
    # one copy may not pay where two do: one greedy pass misses both); the shortest wins.
    step, chosen = before, list[Pipe]()
    for first in [None, *combiner.pipes[:FILL_STARTS]]:
        value, picked = _grow(combiner, fixed, room, limit - len(fixed), before, first=first)
        if value < step * (1 - 1e-9) or (value <= step * (1 + 1e-9) and len(picked) < len(chosen)):
            step, chosen = value, picked
    shares = split_fast([p.lane for p in [*fixed, *chosen]], training.micro_batches)
    added = []
    if extra is not None:
        for p, m in zip(chosen, shares[len(fixed) :], strict=True):
            own = replace(extra, training=replace(training, micro_batches=m))
            added.append(to_plan(own, replace(p.cand, micro_batches=m), p.search, p.evaluated))
    tokens = training.micro_batches * training.tokens_per_micro_batch
    pays, reason = _verdict(
        before, step, len(chosen), steps_left=steps_left, join_seconds=join_seconds, margin=margin
    )
    if len(fixed) >= limit:
        reason = f"the job runs as many pipelines as it may ({limit})"
    return Growth(
        added=tuple(added),
        shares=tuple(shares),
        step_seconds_before=before,
        step_seconds_after=step,
        tokens_per_second_before=tokens / before,
        tokens_per_second_after=tokens / step,
        pays=pays,
        reason=reason,
        sets_evaluated=combiner.evaluated,
    )


def _grow(
    combiner: Combiner,
    fixed: Sequence[Pipe],
    room: Sequence[int],
    most: int,
    before: float,
    *,
    first: Pipe | None,
) -> tuple[float, list[Pipe]]:
    """Up to `most` pipelines added to `fixed` within the GPUs `room`: of `first`, the
    number of copies that gives the shortest step (every count that fits is priced: one
    copy can lose where two win, when the shares only even out with both), then the
    candidate that shortens the step most, one at a time, while one does. Returns the step
    and the pipelines added."""
    chosen: list[Pipe] = []
    step, left = before, list(room)

    def fits(p: Pipe, left: Sequence[int]) -> bool:
        return all(c <= x for c, x in zip(p.counts, left, strict=True))

    if first is not None:
        copies: list[Pipe] = []
        free = list(left)
        while len(copies) < most and fits(first, free):
            copies.append(first)
            free = [x - c for x, c in zip(free, first.counts, strict=True)]
            value = combiner.value([*fixed, *copies])
            if value is not None and value < step * (1 - 1e-9):
                step, chosen, left = value, list(copies), list(free)
    while len(chosen) < most:
        priced = [
            (value, p)
            for p in combiner.pipes
            if fits(p, left) and (value := combiner.value([*fixed, *chosen, p])) is not None
        ]
        if not priced:
            break
        value, best = min(priced, key=lambda vp: (vp[0], vp[1].stages))
        if value >= step * (1 - 1e-9):
            break  # nothing left shortens the step
        chosen.append(best)
        left = [x - c for x, c in zip(left, best.counts, strict=True)]
        step = value
    return step, chosen


def _free_problem(
    model: ModelShape,
    training: TrainingShape,
    free: Sequence[Pool],
    catalog: Catalog | None,
    settings: CostSettings | None,
) -> Problem | None:
    """The planning problem of the free GPUs; None when there are none this job can use."""
    if not free:
        return None
    try:
        return build_problem(model, training, free, catalog, settings)
    except PlanError:
        return None  # no free pool can train in this dtype


def _verdict(
    before: float, after: float, added: int, *, steps_left: int, join_seconds: float,
    margin: float,
) -> tuple[bool, str]:  # fmt: skip
    """Whether adding `added` pipelines that take the step from `before` to `after` seconds
    pays (module doc), and why."""
    if not added:
        return False, "no pipeline on the free GPUs would shorten the step"
    gain = before / after - 1.0
    what = f"adding {added} pipeline(s) would raise predicted tokens/s by {gain:.1%}"
    if gain < margin:
        return False, f"{what}, less than the {margin:.0%} margin"
    joined = max(steps_left - join_seconds / before, 0.0)  # steps left once they have joined
    saved = joined * (before - after)
    if saved <= join_seconds:
        return False, (
            f"{what} but save {saved:.0f} s over the {steps_left} steps left, no more than "
            f"joining costs ({join_seconds:.0f} s)"
        )
    return True, f"{what} and save about {saved:.0f} s over the {steps_left} steps left"
