"""`pipeline.compression: auto`: the most faithful boundary code that costs (almost) no speed.

Every code is planned (`plan_fleet`, or `plan` for one pipeline, through ``plan_with``), from
the most faithful to the smallest: ``none`` (exact), ``bf16``, ``int8``, ``int4``, ``delta``.
The first whose predicted tokens/s is within ``AUTO_MARGIN`` of the fastest is the choice. On
fast links every code computes at the same speed and ``none`` is chosen; where a link is the
bottleneck the smallest code that lifts it is. Why a margin: the codes lose precision in that
order (int4 about 8 % of a value, delta's gradients about 34 %, docs/links-and-checkpoints.md),
so a code is only worth its loss where it buys more than 5 % of speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, TypeVar

from relaytrain_operator.domain.planner.result import PlanError
from relaytrain_operator.domain.planner.training import Compression, TrainingShape

AUTO = "auto"
"""The spec value that asks the planner to choose."""
AUTO_ORDER: tuple[Compression, ...] = ("none", "bf16", "int8", "int4", "delta")
"""Candidates, most faithful first."""
AUTO_MARGIN = 0.05
"""A code is chosen over a smaller one when it is at most this much slower."""


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
