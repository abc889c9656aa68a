"""The planner's choices under `auto`: the boundary code and the forwards run ahead.

`pipeline.compression: auto`: the most faithful boundary code that costs (almost) no speed.

Every code is planned (`plan_fleet`, or `plan` for one pipeline, through ``plan_with``), from
the most faithful to the smallest: ``none`` (exact), ``bf16``, ``int8``, ``int4``, ``delta``.
The first whose predicted tokens/s is within ``AUTO_MARGIN`` of the fastest is the choice. On
fast links every code computes at the same speed and ``none`` is chosen; where a link is the
bottleneck the smallest code that lifts it is. Why a margin: the codes lose precision in that
order (int4 about 8 % of a value, delta's gradients about 34 %, docs/links-and-checkpoints.md),
so a code is only worth its loss where it buys more than 5 % of speed.

`pipeline.forwardsAhead: auto`: the fewest forwards ahead of 1F1B whose step, played out over
the plan's links (`Plan.step_seconds_ahead`), is within ``AHEAD_MARGIN`` of the fastest that
every stage's memory holds. Over fast links a round trip is nothing against a micro-batch's
compute and 0 is chosen; over slow ones with long latencies the stage before a link would
wait a round trip for each gradient, and forwards ahead fill that wait (measured through the
worker over paced links, bench/bench_pipeline_time.py: 8 micro-batches over 2 Mbit/s, 50 ms
took 5.7 s a step with none ahead and 5.0 s with four). A stage holds one more micro-batch's
activations for each, so the fewest that buy the speed are taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from relaytrain_operator.domain.planner.fleet_result import FleetPlan
from relaytrain_operator.domain.planner.result import Plan, PlanError
from relaytrain_operator.domain.planner.training import Compression, TrainingShape

AUTO = "auto"
"""The spec value that asks the planner to choose."""
AUTO_ORDER: tuple[Compression, ...] = ("none", "bf16", "int8", "int4", "delta")
"""Candidates, most faithful first."""
AUTO_MARGIN = 0.05
"""A code is chosen over a smaller one when it is at most this much slower."""
AHEAD_MARGIN = 0.05
"""Fewer forwards ahead are chosen over more when their step is at most this much slower:
the played-out step is within -3 to +6 % of the worker's measured ones (2026-12-01)
(bench/bench_pipeline_time.py), so a smaller gain is not worth a micro-batch's memory."""


class _Priced(Protocol):
    @property
    def tokens_per_second(self) -> float: ...


P = TypeVar("P", bound=_Priced)


def choose_compression(
    plan_with: Callable[[TrainingShape], P], training: TrainingShape
) -> tuple[Compression, P]:
    """The chosen code and its plan. Raises the most faithful code's PlanError when no code
    gives a plan (then none fits, whatever the code: the codes change link time, not memory)."""
    plans: dict[Compression, P] = {}
    first: PlanError | None = None
    for mode in AUTO_ORDER:
        try:
            plans[mode] = plan_with(replace(training, compression=mode))
        except PlanError as err:
            first = first or err
    if not plans:
        assert first is not None
        raise first
    fastest = max(p.tokens_per_second for p in plans.values())
    for mode, result in plans.items():
        if result.tokens_per_second >= (1 - AUTO_MARGIN) * fastest:
            return mode, result
    raise AssertionError("the fastest plan is within the margin of itself")


def choose_forwards_ahead(pipelines: Sequence[Plan]) -> int:
    """`pipeline.forwardsAhead` for a job of these pipelines (one value for all: their step
    waits for the slowest): the fewest within ``AHEAD_MARGIN`` of the fastest step, of those
    whose activations every pipeline's stages hold."""
    most = min(p.most_ahead for p in pipelines)
    seconds = [max(p.step_seconds_ahead(a) for p in pipelines) for a in range(most + 1)]
    fastest = min(seconds)
    return next(a for a, s in enumerate(seconds) if s <= (1 + AHEAD_MARGIN) * fastest)


def plan_forwards_ahead(
    plan_with: Callable[[TrainingShape], Plan | FleetPlan],
    training: TrainingShape,
    searched: Plan | FleetPlan,
) -> tuple[int, Plan | FleetPlan]:
    """`forwardsAhead: auto` for ``searched``, a plan of ``training`` searched with none ahead
    (the least memory): the choice, and the plan planned again with it, so that its stages'
    memory counts the activations (``searched`` and 0 where the search finds no split that
    holds them)."""
    ahead = choose_forwards_ahead(
        searched.pipelines if isinstance(searched, FleetPlan) else (searched,)
    )
    if not ahead:
        return 0, searched
    try:
        return ahead, plan_with(replace(training, forwards_ahead=ahead))
    except PlanError:
        return 0, searched
