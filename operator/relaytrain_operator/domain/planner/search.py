"""The search: which GPUs serve the stages, in which order, with how many layers each.

A candidate is a *sequence* of pools, one entry per stage (stage k runs on a GPU of pool
``seq[k]``; a pool appears at most as often as it has GPUs). For a sequence, stage k's beat
(its time per micro-batch once the pipeline is full) with n layers is ``f_k(n) = max(n * a_k
+ c_k, s_k)``: a_k one layer's compute, c_k its head's, s_k the busiest of what runs beside
the compute (its sends' link directions, its encoder: `link_cost.LinkCost.side_seconds`). It fits
at most ``cap_k`` layers in memory.

Layer split (exact): all decoder layers cost the same, so a contiguous split is fixed by the
layer counts alone, and the best counts minimise ``max_k f_k(n_k)`` with ``1 <= n_k <=
cap_k`` and ``sum n_k = L``. No s_k depends on the layers, so that is ``max(max_k s_k,
min max_k (n_k a_k + c_k))``: the split that balances the compute alone. Giving every stage
one layer and then, L - P times, one more layer to the stage whose compute after the
increment is smallest is optimal for that: each stage's compute grows with its layers, so
the greedy takes the L - P smallest increments of the union, and no other allocation can
have a smaller largest element. O(L log P). (Balancing the beats instead would pile layers
onto the stages whose links wait least, for no shorter beat.)

Sequences: a 1F1B step takes about (M + P - 1) beats of its slowest stage (``Candidate.
step_seconds``, the search's model), so for each stage count P the search minimises the
slowest beat. When the number of distinct sequences is at most ``exhaustive_limit`` every one
is evaluated (exact). Otherwise a stated heuristic: for every P, seed sequences (the P
fastest GPUs fastest-first and fastest-last, the P largest-memory GPUs largest-first, the P
with the fastest links, then the shortest latencies) and, for the few P whose best seed's
step is shortest (by its floor, when `problem.solve` asks), local search (swap two stages, or
move a stage to a spare GPU of another pool) until no move improves (memory deficit, slowest
beat, total time). Each keeps, of every stage count, the ``SHORTLIST`` sequences with the
lowest floors under their steps (`Problem.step_floor`); `problem.solve` plays their steps out
over their links (`steptime`: latencies, round trips, fill and drain) and takes the fastest.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from math import factorial
from typing import Any

from relaytrain_contract.order import in_flight

from relaytrain_operator.domain.planner.cost import PoolCost
from relaytrain_operator.domain.planner.link_cost import LinkCost

#: Sequences evaluated before switching from exhaustive search to the heuristic.
DEFAULT_EXHAUSTIVE_LIMIT = 20_000
#: Stage counts refined by local search in heuristic mode.
REFINED_STAGE_COUNTS = 3
#: Sequences of each stage count kept for the step played out (`problem.solve`), those with
#: the lowest floors: the beats leave out the links' latencies and the round trips that pace
#: 1F1B over them, which can reorder sequences by far.
SHORTLIST = 8


@dataclass(frozen=True)
class StageTerms:
    """A stage's beat as a function of its layers (see the module docstring)."""

    layer: float
    """One decoder layer's compute (a_k)."""
    fixed: float
    """Compute beyond the layers: the head on the last stage (c_k)."""
    side: float
    """The busiest of its sends' directions and its encoder (s_k)."""
    cap: int
    """Most layers its memory holds."""

    def compute(self, layers: int) -> float:
        return self.layer * layers + self.fixed

    def beat(self, layers: int) -> float:
        return max(self.compute(layers), self.side)


@dataclass(frozen=True)
class Candidate:
    """One evaluated sequence: its layer counts and per-stage times."""

    seq: tuple[int, ...]
    """Pool index per stage."""
    deficit: int
    """Layers that do not fit anywhere (0 when the sequence is feasible)."""
    counts: tuple[int, ...]
    """Decoder layers per stage (meaningful when deficit is 0)."""
    seconds: tuple[float, ...]
    """Each stage's beat with those counts (`StageTerms.beat`)."""
    micro_batches: int

    @property
    def bottleneck(self) -> float:
        return max(self.seconds) if self.seconds else float("inf")

    @property
    def step_seconds(self) -> float:
        return (self.micro_batches + len(self.seq) - 1) * self.bottleneck

    def key(self) -> tuple[int, float, float]:
        """Order within one stage count: fits first, then slowest stage, then total time."""
        return (self.deficit, self.bottleneck, sum(self.seconds))

    def overall_key(self) -> tuple[int, float, int]:
        """Order across stage counts: fits first, then step time, then fewer stages."""
        return (self.deficit, 0.0 if self.deficit else self.step_seconds, len(self.seq))


class Evaluator:
    """Evaluates sequences of pools for one job; caches what does not depend on order."""

    def __init__(
        self,
        costs: Sequence[PoolCost],
        link: LinkCost,
        num_layers: int,
        micro_batches: int,
        ignore_memory: bool = False,
        *,
        ahead: int = 0,
        floor: Callable[[Candidate], float] | None = None,
    ) -> None:
        self.costs = list(costs)
        self.ahead = ahead
        """Forwards run ahead of 1F1B (TrainingShape.forwards_ahead)."""
        self.link = link
        self.num_layers = num_layers
        self.micro_batches = micro_batches
        self.ignore_memory = ignore_memory
        self._caps: dict[tuple[int, bool, bool, int], int] = {}
        self.calls = 0
        """Sequences evaluated so far."""
        self.floor = floor
        """A floor under a feasible candidate's step (`Problem.step_floor`); None: its M
        beats."""
        self._kept: dict[int, list[tuple[float, Candidate]]] = {}
        """Of each stage count, the ``SHORTLIST`` feasible sequences evaluated so far with the
        lowest floors, and their floors."""

    def shortlist(self) -> list[tuple[float, Candidate]]:
        """The feasible sequences of each stage count evaluated so far with the lowest floors
        under their steps (``SHORTLIST`` each), with those floors."""
        return [kept for each in self._kept.values() for kept in each]

    def forget(self) -> None:
        """Start a new shortlist (another search with the same caches)."""
        self._kept.clear()

    def _keep(self, cand: Candidate) -> None:
        kept = self._kept.setdefault(len(cand.seq), [])
        beats = self.micro_batches * cand.bottleneck  # under every floor: spare the rest
        if len(kept) == SHORTLIST and beats >= kept[-1][0]:
            return
        floor = beats if self.floor is None else self.floor(cand)
        if len(kept) == SHORTLIST and floor >= kept[-1][0]:
            return
        if any(c.seq == cand.seq for _, c in kept):
            return
        kept.append((floor, cand))
        kept.sort(key=lambda fc: (fc[0], fc[1].key()))
        del kept[SHORTLIST:]

    def stage_terms(self, seq: Sequence[int]) -> list[StageTerms]:
        """The beat's terms of each stage of ``seq``."""
        p = len(seq)
        terms = []
        for k, i in enumerate(seq):
            cost = self.costs[i]
            first, last = k == 0, k == p - 1
            prev = self.costs[seq[k - 1]] if k > 0 else None
            nxt = self.costs[seq[k + 1]] if k < p - 1 else None
            side = self.link.side_seconds(prev, cost, nxt)
            held = in_flight(k, p, self.micro_batches, self.ahead)
            key = (i, first, last, held)
            if key not in self._caps:
                self._caps[key] = cost.max_layers(first, last, held)
            cap = self.num_layers if self.ignore_memory else self._caps[key]
            terms.append(StageTerms(cost.layer_seconds, cost.fixed_seconds(first, last), side, cap))
        return terms

    def evaluate(self, seq: Sequence[int]) -> Candidate:
        """Best layer counts for ``seq`` (exact; see the module docstring)."""
        self.calls += 1
        terms = self.stage_terms(seq)
        caps = [min(t.cap, self.num_layers) for t in terms]
        if min(caps) < 1 or sum(caps) < self.num_layers or len(seq) > self.num_layers:
            # Layers left over; at least 1 when every layer has room but some stage has none.
            short = max(self.num_layers - sum(caps), 1)
            return Candidate(tuple(seq), short, (), (), self.micro_batches)
        counts = [1] * len(seq)

        def increment(k: int) -> tuple[float, int]:
            return (terms[k].compute(counts[k] + 1), k)

        heap = [increment(k) for k in range(len(seq)) if caps[k] > 1]
        heapq.heapify(heap)
        for _ in range(self.num_layers - len(seq)):
            _, k = heapq.heappop(heap)
            counts[k] += 1
            if counts[k] < caps[k]:
                heapq.heappush(heap, increment(k))
        seconds = tuple(t.beat(n) for t, n in zip(terms, counts, strict=True))
        cand = Candidate(tuple(seq), 0, tuple(counts), seconds, self.micro_batches)
        self._keep(cand)
        return cand


def count_sequences(gpus: Sequence[int], length: int) -> int:
    """Distinct sequences of ``length`` pools using pool i at most ``gpus[i]`` times."""
    # Exponential generating functions: coefficient of x^n/n! counts arrangements.
    poly = [1.0] + [0.0] * length
    for g in gpus:
        factor = [1 / factorial(n) if n <= g else 0.0 for n in range(length + 1)]
        poly = [sum(poly[j] * factor[n - j] for j in range(n + 1)) for n in range(length + 1)]
    return round(poly[length] * factorial(length))


def sequences(gpus: Sequence[int], length: int) -> Iterator[tuple[int, ...]]:
    """Every distinct sequence of ``length`` pools within the GPU counts."""
    left = list(gpus)
    seq: list[int] = []

    def extend() -> Iterator[tuple[int, ...]]:
        if len(seq) == length:
            yield tuple(seq)
            return
        for i, n in enumerate(left):
            if n:
                left[i] -= 1
                seq.append(i)
                yield from extend()
                seq.pop()
                left[i] += 1

    return extend()


def _better(a: Candidate, b: Candidate | None) -> bool:
    """Whether ``a`` beats ``b`` across stage counts: fits, then step time, then fewer stages."""
    return b is None or a.overall_key() < b.overall_key()


def exhaustive(evaluator: Evaluator, gpus: Sequence[int], stage_counts: Sequence[int]) -> Candidate:
    """The best sequence over every distinct sequence of each stage count."""
    best: Candidate | None = None
    for p in stage_counts:
        for seq in sequences(gpus, p):
            cand = evaluator.evaluate(seq)
            if _better(cand, best):
                best = cand
    assert best is not None
    return best


def _seeds(evaluator: Evaluator, gpus: Sequence[int], p: int) -> list[tuple[int, ...]]:
    costs = evaluator.costs
    units = [i for i, g in enumerate(gpus) for _ in range(g)]
    by_speed = sorted(units, key=lambda i: (costs[i].layer_seconds, -costs[i].available_bytes))
    by_memory = sorted(units, key=lambda i: (-costs[i].available_bytes, costs[i].layer_seconds))
    by_link = sorted(
        units,
        key=lambda i: (-costs[i].bandwidth_bytes_per_s, costs[i].latency_s, costs[i].layer_seconds),
    )
    fast = by_speed[:p]
    return [tuple(fast), tuple(reversed(fast)), tuple(by_memory[:p]), tuple(by_link[:p])]


def _neighbours(seq: tuple[int, ...], gpus: Sequence[int]) -> Iterator[tuple[int, ...]]:
    p = len(seq)
    spare = [g - seq.count(i) for i, g in enumerate(gpus)]
    # Every pairwise swap while cheap; adjacent swaps and swaps with the ends when long.
    if p <= 16:
        pairs: Iterator[tuple[int, int]] = itertools.combinations(range(p), 2)
    else:
        pairs = itertools.chain(
            ((k, k + 1) for k in range(p - 1)),
            ((0, k) for k in range(2, p)),
            ((k, p - 1) for k in range(1, p - 2)),
        )
    for a, b in pairs:
        if seq[a] != seq[b]:
            s = list(seq)
            s[a], s[b] = s[b], s[a]
            yield tuple(s)
    for k in range(p):
        for i, n in enumerate(spare):
            if n > 0 and i != seq[k]:
                s = list(seq)
                s[k] = i
                yield tuple(s)


def local_search(
    evaluator: Evaluator, start: Candidate, gpus: Sequence[int],
    key: Callable[[Candidate], Any] = Candidate.key,
) -> Candidate:  # fmt: skip
    """First-improvement descent from ``start`` over the moves of :func:`_neighbours`."""
    best = start
    best_key = key(best)
    improved = True
    while improved:
        improved = False
        for seq in _neighbours(best.seq, gpus):
            cand = evaluator.evaluate(seq)
            cand_key = key(cand)
            if cand_key < best_key:
                best_key = cand_key
                best, improved = cand, True
                break
    return best


def heuristic(
    evaluator: Evaluator,
    gpus: Sequence[int],
    stage_counts: Sequence[int],
    step: Callable[[Candidate], float] | None = None,
) -> Candidate:
    """Seeds for every stage count, then local search on the most promising counts: those
    whose best seed has the shortest ``step`` (None: `Candidate.step_seconds`), each
    descending by the same ``step`` (None: by its beats, `Candidate.key`). By the beats, a
    descent left a plan 16.5 % slower than the best on one of bench_planner.py's 40 random
    fleets (a faster GPU at both ends of a slow link, which no beat sees); by the played-out
    step's floor, 3.4 % (2026-12-02)."""
    per_count = []
    for p in stage_counts:
        cands = [evaluator.evaluate(s) for s in _seeds(evaluator, gpus, p)]
        per_count.append(min(cands, key=Candidate.key))
    key: Callable[[Candidate], tuple[int, float, int]]
    if step is None:
        key = Candidate.overall_key
        descend: Callable[[Candidate], Any] = Candidate.key
    else:
        key = descend = lambda c: (c.deficit, c.bottleneck if c.deficit else step(c), len(c.seq))
    per_count.sort(key=key)
    best: Candidate | None = None
    for cand in per_count[:REFINED_STAGE_COUNTS]:
        refined = local_search(evaluator, cand, gpus, descend)
        if _better(refined, best):
            best = refined
    assert best is not None
    return best
