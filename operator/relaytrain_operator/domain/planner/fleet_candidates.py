"""The candidate pipelines of the fleet planner (fleet.py, part 1 of its search).

GPUs of a pool are identical, so a pipeline is a *multiset* of pools, a vector ``c`` of GPUs
per pool, and its best order and split are those ``plan()``'s search finds for exactly those
GPUs (`problem.solve`: every order tried up to ``CANDIDATE_EXHAUSTIVE_LIMIT`` orders, the
heuristic beyond; the best played out over their links). Vectors are enumerated by size,
from 1 GPU up to the smallest size at which any fits plus ``EXTRA_STAGES`` (and at most
``MAX_VECTORS`` in all): longer pipelines only add links and bubble per GPU, where memory does
not force them. The best single pipeline on the whole
fleet (``plan()``, any length) is a candidate too. A candidate is dropped when one on a
subset of its GPUs is at least as fast for every share of the step's micro-batches, with no
more gradient load per link: it can replace it in any set without loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from relaytrain_operator.domain.planner.problem import Problem, solve
from relaytrain_operator.domain.planner.result import Plan
from relaytrain_operator.domain.planner.search import Candidate
from relaytrain_operator.domain.planner.shares import Lane
from relaytrain_operator.domain.planner.sync import (
    Gradients,
    pipeline_latency_seconds,
    pipeline_load_seconds,
)

#: Candidate pipelines are at most this many stages longer than the shortest that fits.
EXTRA_STAGES = 2
#: Most GPU multisets priced as candidate pipelines.
MAX_VECTORS = 400
#: Orders of one candidate's GPUs tried exhaustively; the splitter's heuristic beyond.
CANDIDATE_EXHAUSTIVE_LIMIT = 720


@dataclass(frozen=True)
class Pipe:
    """A candidate pipeline: its GPUs, its best order and split, and what it adds to a sync."""

    counts: tuple[int, ...]
    """GPUs per usable pool."""
    cand: Candidate
    load: float
    """max over its stages of gradient bytes / link bandwidth (sync.py)."""
    latency: float
    """Its slowest stage link's one-way latency."""
    lane: Lane
    """Its step for any share of the micro-batches, played out: what the split needs."""
    search: str = "exhaustive"
    """How its order of GPUs was found."""
    evaluated: int = 1
    """Orders evaluated for it."""

    @property
    def stages(self) -> int:
        return len(self.cand.seq)

    @property
    def beat(self) -> float:
        return self.cand.bottleneck

    @property
    def rate(self) -> float:
        """Micro-batches per second once full."""
        return 1.0 / self.beat

    def no_slower(self, other: Pipe, micro_batches: int) -> bool:
        """Whether its step is no longer than ``other``'s for every share, to
        ``micro_batches`` (`Lane.no_slower`)."""
        return self.lane.no_slower(other.lane, micro_batches)


def _pipe_of_candidate(
    problem: Problem,
    grads: Gradients,
    counts: Sequence[int],
    cand: Candidate,
    *,
    search: str,
    evaluated: int,
) -> Pipe:
    load = pipeline_load_seconds(grads, problem.costs, cand.seq, cand.counts)
    latency = pipeline_latency_seconds(problem.costs, cand.seq)
    return Pipe(tuple(counts), cand, load, latency, problem.lane(cand), search, evaluated)


def pipe_of_plan(problem: Problem, grads: Gradients, single: Plan) -> Pipe:
    """The single-pipeline plan as a candidate."""
    index = {cost.pool.name: i for i, cost in enumerate(problem.costs)}
    seq = tuple(index[s.pool] for s in single.stages)
    cand = Candidate(
        seq,
        0,
        tuple(s.layers for s in single.stages),
        tuple(s.beat_seconds for s in single.stages),
        problem.training.micro_batches,
    )
    counts = [seq.count(i) for i in range(len(problem.costs))]
    return _pipe_of_candidate(
        problem, grads, counts, cand, search=single.search, evaluated=single.sequences_evaluated
    )


def _vectors(gpus: Sequence[int], size: int) -> Iterator[tuple[int, ...]]:
    """Every vector of GPUs per pool with ``size`` GPUs in all, within ``gpus``."""
    if not gpus:
        if size == 0:
            yield ()
        return
    for n in range(min(gpus[0], size), -1, -1):
        for rest in _vectors(gpus[1:], size - n):
            yield (n, *rest)


def candidates(problem: Problem, grads: Gradients, stages: int | None = None) -> list[Pipe]:
    """Candidate pipelines: every GPU multiset of a useful size that fits, with its best
    split (dominated ones included; see :func:`undominated`)."""
    evaluator = problem.evaluator()
    gpus = problem.gpus
    most = min(sum(gpus), problem.model.num_layers)
    sizes = [stages] if stages is not None else list(range(1, most + 1))
    found: list[Pipe] = []

    def price(counts: tuple[int, ...]) -> bool:
        size = sum(counts)
        cand, search, evaluated = solve(
            problem, [size], CANDIDATE_EXHAUSTIVE_LIMIT, gpus=counts, evaluator=evaluator
        )
        if cand.deficit:
            return False
        found.append(
            _pipe_of_candidate(problem, grads, counts, cand, search=search, evaluated=evaluated)
        )
        return True

    fit_size: int | None = None
    priced, top = 0, 0
    for size in sizes:
        if fit_size is not None and size > fit_size + EXTRA_STAGES:
            break
        vectors = list(_vectors(gpus, size))
        if priced + len(vectors) > MAX_VECTORS:
            break  # mixed pipelines this long are too many to price; plan() and below remain
        priced, top = priced + len(vectors), size
        for counts in vectors:
            if price(counts) and fit_size is None:
                fit_size = size
    if stages is None:
        # A pool whose GPUs need longer pipelines than the fleet's shortest: its own ones.
        for i, n in enumerate(gpus):
            own = [sum(p.counts) for p in found if p.counts[i] == sum(p.counts)]
            fit = min(own, default=None)
            for size in range(top + 1, min(n, problem.model.num_layers) + 1):
                if fit is not None and size > fit + EXTRA_STAGES:
                    break
                counts = tuple(size if k == i else 0 for k in range(len(gpus)))
                if price(counts) and fit is None:
                    fit = size
    return found


def undominated(pipes: Sequence[Pipe], micro_batches: int) -> list[Pipe]:
    """Drop a pipe when another on a subset of its GPUs is no slower for any share of the
    ``micro_batches`` and loads no link more."""

    def beats(a: Pipe, b: Pipe) -> bool:
        subset = all(x <= y for x, y in zip(a.counts, b.counts, strict=True))
        return (
            subset
            and a.counts != b.counts
            and a.load <= b.load
            and a.latency <= b.latency
            and a.no_slower(b, micro_batches)
        )

    return [p for p in pipes if not any(beats(q, p) for q in pipes)]


def with_single(pipes: list[Pipe], single: Pipe, micro_batches: int) -> list[Pipe]:
    """Add the whole-fleet single pipeline unless a candidate on the same GPUs is as good
    for every share of the ``micro_batches``."""
    same = [p for p in pipes if p.counts == single.counts]
    if any(p.no_slower(single, micro_batches) for p in same):
        return pipes
    return [*pipes, single]
