"""How a step's micro-batches are shared among pipelines that train together.

A pipeline's `Lane` is its step time as a function of the micro-batches it gets: 0 for none,
and for m of them its 1F1B step played out over its links (`Problem.lane`; for pipelines
whose stages all take one beat b over instant links, ``(m + P - 1) * b``: `Lane.of_beats`).
The step's M micro-batches are split so that the slowest pipeline finishes first:

Give each next micro-batch to the pipeline that would finish it earliest. This is exact.
Each pipeline's finish times ``f_i(1) < f_i(2) < ...`` increase, so a split whose slowest
pipeline takes at most t holds at most ``#{(i, k): f_i(k) <= t}`` micro-batches: the best
possible slowest time is the M-th smallest value of the union of those sequences, and the
greedy, which takes the smallest next value every time, ends exactly there.
(Shares proportional to speed are not: a pipeline's fill costs the same however few
micro-batches it gets, so a long pipeline may deserve none.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Lane:
    """A pipeline's step time for its share of the micro-batches, and a line under it."""

    step: Callable[[int], float]
    """Seconds of a step of m >= 1 micro-batches (increasing in m)."""
    fill: float
    """With `period`, a line no step is under: ``step(m) >= fill + m * period``."""
    period: float
    """Seconds per micro-batch once full: its slowest stage's beat."""
    linear_after: int = 1
    """From this many micro-batches on, the step grows by the same seconds each."""

    @classmethod
    def of_beats(cls, stages: int, beat_seconds: float) -> Lane:
        """1F1B over instant links of ``stages`` whose slowest takes ``beat_seconds``."""
        fill = (stages - 1) * beat_seconds
        return cls(lambda m: fill + m * beat_seconds, fill, beat_seconds)

    def no_slower(self, other: Lane, most: int) -> bool:
        """Whether its step is no longer than ``other``'s for every share up to ``most``
        micro-batches (the whole step first: most pairs differ there). Beyond both lanes'
        ``linear_after`` both grow linearly, so their two ends decide."""
        top = min(most, max(self.linear_after, other.linear_after))
        shares = [most] if most > top else []
        return all(self.seconds(m) <= other.seconds(m) for m in [*shares, *range(top, 0, -1)])

    def seconds(self, micro_batches: int) -> float:
        """The step for ``micro_batches`` (0 when it gets none)."""
        return self.step(micro_batches) if micro_batches > 0 else 0.0

    @property
    def fill_beats(self) -> float:
        """The line's fill in periods: ``P - 1`` for `of_beats`."""
        return self.fill / self.period

    def most_within(self, seconds: float, most: int) -> int:
        """The most micro-batches, to ``most``, whose step takes at most ``seconds``."""
        lo, hi = 0, min(most, max(int((seconds - self.fill) / self.period), 0))
        after = self.linear_after
        if hi > after + 1:  # past `linear_after` the step is a line: read it, then check
            base = self.step(after)
            if seconds >= base:
                rise = self.step(after + 1) - base
                m = min(hi, after + int((seconds - base) / rise)) if rise > 0 else hi
                while m > after and self.step(m) > seconds:
                    m -= 1
                while m < hi and self.step(m + 1) <= seconds:
                    m += 1
                return m
            hi = after
        while lo < hi:  # the line bounds it above; the step decides below that
            mid = (lo + hi + 1) // 2
            if self.step(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


def split_micro_batches(pipelines: Sequence[Lane], micro_batches: int) -> list[int]:
    """Micro-batches per pipeline that minimise the slowest pipeline's time. Ties go to the
    pipeline listed first, so the split is deterministic."""
    if micro_batches < 0:
        raise ValueError(f"micro_batches must be >= 0, got {micro_batches}")
    if not pipelines:
        if micro_batches:
            raise ValueError("micro-batches cannot be shared among no pipelines")
        return []
    return _greedy(pipelines, [0] * len(pipelines), micro_batches)


def _greedy(pipelines: Sequence[Lane], shares: list[int], micro_batches: int) -> list[int]:
    """``shares`` given each next micro-batch, to ``micro_batches`` in all, where it would
    finish earliest."""
    heap = [
        (lane.seconds(m + 1), i) for i, (lane, m) in enumerate(zip(pipelines, shares, strict=True))
    ]
    heapq.heapify(heap)
    for _ in range(micro_batches - sum(shares)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (pipelines[i].seconds(shares[i] + 1), i))
    return shares


def slowest_seconds(pipelines: Sequence[Lane], shares: Sequence[int]) -> float:
    """Time of the slowest pipeline for a given split."""
    return max(
        (lane.seconds(m) for lane, m in zip(pipelines, shares, strict=True)),
        default=0.0,
    )


def split_fast(pipelines: Sequence[Lane], micro_batches: int) -> list[int]:
    """The same optimum as :func:`split_micro_batches`, for the search's inner loop.

    The greedy takes the M smallest finish times of all the pipelines' micro-batches, so
    any time t gives a start that is part of its answer or holds all of it: every
    micro-batch each pipeline finishes by t. From ``t0``, the time by which the lanes'
    lines hold M micro-batches (`_lines_hold`), which no split beats, secant steps bring t
    near the M-th smallest finish time (at 1,024 micro-batches a fleet's lanes finish
    hundreds fewer by ``t0``: one micro-batch at a time, they were most of its plan); the
    greedy then adds what is missing (`_greedy`) or gives back what is too many
    (`_give_back`), and the result is checked: no micro-batch left out may finish before
    the slowest one taken. Where that check fails, the greedy from nothing decides.
    """
    if not pipelines or micro_batches <= 0:
        return split_micro_batches(pipelines, micro_batches)
    close = len(pipelines)
    t = _lines_hold(pipelines, micro_batches)
    shares = [lane.most_within(t, micro_batches) for lane in pipelines]
    count = sum(shares)
    rate = sum(1 / lane.period for lane in pipelines)
    before: tuple[float, int] | None = None
    for _ in range(SECANT_STEPS):
        missing = micro_batches - count
        if abs(missing) <= close:
            break
        if before is None or before[1] == count:
            move = missing / rate
        else:
            move = missing * (t - before[0]) / (count - before[1])
        before, t = (t, count), t + move
        shares = [lane.most_within(t, micro_batches) for lane in pipelines]
        count = sum(shares)
    if count > micro_batches:
        shares = _give_back(pipelines, shares, micro_batches)
    shares = _greedy(pipelines, shares, micro_batches)
    slowest = slowest_seconds(pipelines, shares)
    if min(lane.seconds(m + 1) for lane, m in zip(pipelines, shares, strict=True)) < slowest:
        return split_micro_batches(pipelines, micro_batches)
    return shares


SECANT_STEPS = 8
"""The most secant steps `split_fast` takes toward the M-th finish time (it stops once
within a micro-batch a pipeline)."""


def _give_back(pipelines: Sequence[Lane], shares: list[int], micro_batches: int) -> list[int]:
    """``shares`` less their latest-finishing micro-batches, to ``micro_batches`` in all:
    the greedy run backwards (of equal times, the later pipeline's goes first, as the
    greedy takes the earlier one's first)."""
    heap = [
        (-lane.seconds(m), -i)
        for i, (lane, m) in enumerate(zip(pipelines, shares, strict=True))
        if m
    ]
    heapq.heapify(heap)
    for _ in range(sum(shares) - micro_batches):
        _, neg = heapq.heappop(heap)
        i = -neg
        shares[i] -= 1
        if shares[i]:
            heapq.heappush(heap, (-pipelines[i].seconds(shares[i]), neg))
    return shares


def _lines_hold(pipelines: Sequence[Lane], micro_batches: int) -> float:
    """The least t at which the lanes' lines hold ``micro_batches`` between them, a line
    holding ``(t - fill) / period`` once past its fill and none before: ``(M + sum(fill /
    period)) / sum(1 / period)`` over the lanes whose fill it passes. No split is faster:
    a lane finishes no more micro-batches by t than its line holds. (Over every lane, as
    until 2026-12-02, a lane whose fill is past t counted less than none, so t could pass
    the best split's time; the start then overshot, and the greedy began from nothing: most
    of a 128-GPU fleet's plan at 1,024 micro-batches.)"""
    ordered = sorted(pipelines, key=lambda lane: lane.fill)
    beats = rate = 0.0
    t = 0.0
    for i, lane in enumerate(ordered):
        beats += lane.fill_beats
        rate += 1 / lane.period
        t = (micro_batches + beats) / rate
        if i + 1 == len(ordered) or t <= ordered[i + 1].fill:
            break
    return t
