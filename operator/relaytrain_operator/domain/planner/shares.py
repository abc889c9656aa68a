"""How a step's micro-batches are shared among pipelines that train together.

A pipeline of P stages whose slowest stage takes b seconds per micro-batch finishes m
micro-batches in ``(m + P - 1) * b`` seconds under 1F1B (P - 1 beats of fill and drain, then
one micro-batch per beat), and 0 seconds when it gets none. The step's M micro-batches are
split so that the slowest pipeline finishes first:

Give each next micro-batch to the pipeline that would finish it earliest. This is exact.
Each pipeline's finish times ``f_i(1) < f_i(2) < ...`` increase, so a split whose slowest
pipeline takes at most t holds at most ``#{(i, k): f_i(k) <= t}`` micro-batches: the best
possible slowest time is the M-th smallest value of the union of those sequences, and the
greedy, which takes the smallest next value every time, ends exactly there.
(Shares proportional to speed are not: a pipeline's fill costs P - 1 beats however few
micro-batches it gets, so a long pipeline may deserve none.)
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def pipeline_seconds(stages: int, beat_seconds: float, micro_batches: int) -> float:
    """1F1B time of a pipeline of ``stages`` for ``micro_batches`` (0 when it gets none)."""
    if micro_batches <= 0:
        return 0.0
    return (micro_batches + stages - 1) * beat_seconds


def split_micro_batches(pipelines: Sequence[tuple[int, float]], micro_batches: int) -> list[int]:
    """Micro-batches per pipeline that minimise the slowest pipeline's time.

    ``pipelines`` is ``[(stages, seconds per micro-batch of its slowest stage), ...]``. Ties go
    to the pipeline listed first, so the split is deterministic.
    """
    if micro_batches < 0:
        raise ValueError(f"micro_batches must be >= 0, got {micro_batches}")
    if not pipelines:
        if micro_batches:
            raise ValueError("micro-batches cannot be shared among no pipelines")
        return []
    shares = [0] * len(pipelines)
    heap = [(pipeline_seconds(p, b, 1), i) for i, (p, b) in enumerate(pipelines)]
    heapq.heapify(heap)
    for _ in range(micro_batches):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        p, b = pipelines[i]
        heapq.heappush(heap, (pipeline_seconds(p, b, shares[i] + 1), i))
    return shares


def slowest_seconds(pipelines: Sequence[tuple[int, float]], shares: Sequence[int]) -> float:
    """Time of the slowest pipeline for a given split."""
    return max(
        (pipeline_seconds(p, b, m) for (p, b), m in zip(pipelines, shares, strict=True)),
        default=0.0,
    )


def split_fast(pipelines: Sequence[tuple[int, float]], micro_batches: int) -> list[int]:
    """The same optimum as :func:`split_micro_batches`, for the search's inner loop.

    Starts every pipeline at the micro-batches it finishes by the continuous optimum
    ``t0 = (M + sum(P - 1)) / sum(1 / b)`` (no split beats t0 when every pipeline gets a
    micro-batch), finishes with the greedy, and checks the result: no micro-batch left out
    may finish before the slowest one taken. If that check fails (some pipeline deserves
    none), the greedy from nothing decides. Ties may fall differently.
    """
    if not pipelines or micro_batches <= 0:
        return split_micro_batches(pipelines, micro_batches)
    t0 = (micro_batches + sum(p - 1 for p, _ in pipelines)) / sum(1 / b for _, b in pipelines)
    shares = []
    for p, b in pipelines:
        m = int(t0 / b) - p + 1
        if m > 0 and (m + p - 1) * b > t0:
            m -= 1  # rounding put it just past t0
        shares.append(max(m, 0))
    if sum(shares) > micro_batches:
        return split_micro_batches(pipelines, micro_batches)
    heap = [((m + p) * b, i) for i, ((p, b), m) in enumerate(zip(pipelines, shares, strict=True))]
    heapq.heapify(heap)
    for _ in range(micro_batches - sum(shares)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        p, b = pipelines[i]
        heapq.heappush(heap, ((shares[i] + p) * b, i))
    slowest = slowest_seconds(pipelines, shares)
    if heap[0][0] < slowest:
        return split_micro_batches(pipelines, micro_batches)
    return shares
