"""A job priced on its pools: the shared input of the search, the plan and the diagnosis."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from relaytrain_operator.domain.planner.catalog import DEFAULT_CATALOG, Catalog, UnknownGpuError
from relaytrain_operator.domain.planner.cost import CostSettings, PoolCost, pool_cost
from relaytrain_operator.domain.planner.link_cost import LinkCost
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.pools import Pool
from relaytrain_operator.domain.planner.result import PlanError
from relaytrain_operator.domain.planner.search import (
    DEFAULT_EXHAUSTIVE_LIMIT,
    Candidate,
    Evaluator,
    count_sequences,
    exhaustive,
    heuristic,
)
from relaytrain_operator.domain.planner.shares import Lane
from relaytrain_operator.domain.planner.steptime import (
    BACKWARD_SHARE,
    PLAYED_MICROS,
    PlannedSteps,
    StepShape,
    planned_step_seconds,
)
from relaytrain_operator.domain.planner.training import TrainingShape

PLAYED_MOST = 32
"""Of the search's shortlist, the most candidates `solve` plays out (fewest floors first): a
step of 64 micro-batches over 15 stages takes about 2 ms to play on the 2-core dev VM, and
where round trips set the pace (no forwards ahead, long latencies) the floors say little."""


REFINE_GAIN = 0.01
"""The least share of the step a layer moved by `refine_split` must save: where round trips
set the pace a stage's layers barely change the step, and moves for crumbs would pile a
plan's layers onto one stage on the model's word alone (it is within -3 to +6 % of the
worker's measured steps)."""


class UnusableDtypeError(PlanError):
    """No pool given can train in the job's dtype (``plan()`` adds "dtype float16" when
    re-planning says it fits)."""


@dataclass(frozen=True)
class Problem:
    """A job's costs on the usable pools: what the search and the diagnosis share."""

    model: ModelShape
    training: TrainingShape
    pools: tuple[Pool, ...]
    costs: tuple[PoolCost, ...]
    link: LinkCost
    notes: tuple[str, ...]
    """Why pools were left out."""
    excluded: tuple[Pool, ...] = ()
    """Pools left out because their GPU cannot train in the job's dtype."""

    @property
    def gpus(self) -> list[int]:
        return [p.gpus for p in self.pools]

    def evaluator(self, ignore_memory: bool = False) -> Evaluator:
        return Evaluator(
            self.costs,
            self.link,
            self.model.num_layers,
            self.training.micro_batches,
            ignore_memory,
            ahead=self.training.forwards_ahead,
            floor=self.step_floor,
        )

    def timeline(self, seq: Sequence[int], counts: Sequence[int]) -> StepShape:
        """The step of the sequence ``seq`` of pools with ``counts`` layers each, as `steptime`
        plays it (with the job's forwards ahead): each stage's compute, each link's frames
        over its slower end's bandwidth and its two ends' latencies, the ``delta`` codec's
        time beside the compute (a GPU stage's side stream)."""
        link, p = self.link, len(seq)
        pools = [self.costs[i] for i in seq]
        pairs = list(itertools.pairwise(pools))
        rates = [min(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s) for a, b in pairs]
        return StepShape(
            p,
            self.training.micro_batches,
            compute=tuple(
                n * pool.layer_seconds + pool.fixed_seconds(k == 0, k == p - 1)
                for k, (pool, n) in enumerate(zip(pools, counts, strict=True))
            ),
            down=tuple(link.forward_bytes / r for r in rates),
            up=tuple(link.backward_bytes / r for r in rates),
            latency=tuple(a.latency_s + b.latency_s for a, b in pairs),
            encode_down=link.forward_codec_seconds + link.deflate_seconds,
            encode_up=link.backward_codec_seconds,
            ahead=self.training.forwards_ahead,
        )

    def played_out(self, cand: Candidate) -> float:
        """The step of a feasible candidate, played out (`timeline`)."""
        return planned_step_seconds(self.timeline(cand.seq, cand.counts))

    def step_floor(self, cand: Candidate) -> float:
        """No step of ``cand`` played out is shorter: `floor_lines` at its M, and its round
        trips (`round_trip_floor`)."""
        m = self.training.micro_batches
        shape = self.timeline(cand.seq, cand.counts)
        lines = floor_lines(shape)
        return max(*(a + m * b for a, b in lines), m * cand.bottleneck, round_trip_floor(shape))

    def lane(self, cand: Candidate) -> Lane:
        """``cand``'s step for any share of the micro-batches as plans price it
        (`planned_step_seconds`, each share once), over the line of its slowest resource
        (`floor_lines`): its beat."""
        shape = self.timeline(cand.seq, cand.counts)
        beat = cand.bottleneck
        fill = max((a for a, b in floor_lines(shape) if b >= beat * (1 - 1e-12)), default=0.0)
        return Lane(PlannedSteps(shape), fill, beat, linear_after=PLAYED_MICROS)

    def stage_counts(self, stages: int | None, max_stages: int | None) -> list[int]:
        most = min(sum(self.gpus), self.model.num_layers, max_stages or sum(self.gpus))
        if stages is None:
            return list(range(1, most + 1))
        if stages > min(sum(self.gpus), self.model.num_layers):
            raise PlanError(
                f"pipeline.stages is {stages}, but there are only {sum(self.gpus)} usable GPUs "
                f"and {self.model.num_layers} decoder layers; use at most "
                f"{min(sum(self.gpus), self.model.num_layers)} or 'auto'."
            )
        return [stages]


def floor_lines(shape: StepShape) -> list[tuple[float, float]]:
    """Lines ``(a, b)``: no step of ``shape`` with m micro-batches played out is shorter than
    ``a + m * b``. Each resource serves m micro-batches in turn: a stage computes m forwards
    and backwards, a link's direction carries m frames. The first of them waits for the
    first micro-batch to reach it (its forwards on the stages before, their frames and
    latencies; for a gradient, the whole way to the last stage and back), and after the last
    the step waits for that micro-batch's gradient to cross back to the first stage."""
    p = shape.stages
    compute = [_at(shape.compute, k) for k in range(p)]
    fwd = [c * (1 - BACKWARD_SHARE) for c in compute]
    bwd = [c * BACKWARD_SHARE for c in compute]
    down = [_at(shape.down, k) for k in range(p - 1)]
    up = [_at(shape.up, k) for k in range(p - 1)]
    lat = [_at(shape.latency, k) for k in range(p - 1)]
    back = _way_back(shape)
    reach = [0.0] * p  # when the first activation is at stage k
    for k in range(1, p):
        reach[k] = reach[k - 1] + fwd[k - 1] + down[k - 1] + lat[k - 1]
    turn = reach[p - 1] + compute[p - 1]  # the first gradient leaves the last stage
    lines = [(reach[k] + back[k], compute[k]) for k in range(p)]
    beyond = 0.0  # the first gradient's way from the last stage to link j's upper end
    for j in range(p - 2, -1, -1):
        leaves = reach[j] + fwd[j]
        then = lat[j] + compute[j + 1] + up[j] + lat[j] + bwd[j] + back[j]
        lines.append((leaves + then, down[j]))
        lines.append((turn + beyond + lat[j] + bwd[j] + back[j], up[j]))
        beyond += up[j] + lat[j] + bwd[j]
    return lines


def round_trip_floor(shape: StepShape) -> float:
    """No step of ``shape`` played out is shorter. Stage k runs micro-batch i + w's forward
    after i's backward (`one_f_one_b`: w = P - k plus the forwards ahead), and between i's
    forward and its backward i makes its whole way to the last stage and back, R_k at least
    (every stage's compute from k on, every link's two frames and two latencies). So its last
    backward ends ceil(M / w) round trips in, and the step its gradient's way to the first
    stage later."""
    p, m = shape.stages, shape.micros
    compute = [_at(shape.compute, k) for k in range(p)]
    hops = [_at(shape.down, j) + _at(shape.up, j) + 2 * _at(shape.latency, j) for j in range(p - 1)]
    back = _way_back(shape)
    floor, trip = 0.0, 0.0
    for k in range(p - 1, -1, -1):
        trip += compute[k] + (hops[k] if k < p - 1 else 0.0)
        window = min(p - k + (shape.ahead if k < p - 1 else 0), m)
        floor = max(floor, -(-m // window) * trip + back[k])
    return floor


def _way_back(shape: StepShape) -> list[float]:
    """Per stage k: from the end of its backward of a micro-batch, the time that micro-batch's
    gradient takes at least to finish on the first stage (each link's frame and latency up,
    each stage's backward before k)."""
    back = [0.0] * shape.stages
    for k in range(1, shape.stages):
        back[k] = (
            back[k - 1]
            + _at(shape.up, k - 1)
            + _at(shape.latency, k - 1)
            + _at(shape.compute, k - 1) * BACKWARD_SHARE
        )
    return back


def _at(value: float | tuple[float, ...], k: int) -> float:
    return value[k] if isinstance(value, tuple) else value


def build_problem(
    model: ModelShape,
    training: TrainingShape,
    pools: Sequence[Pool],
    catalog: Catalog | None = None,
    settings: CostSettings | None = None,
) -> Problem:
    """Look the pools' GPUs up and price the job on each; drop pools that cannot run it."""
    if not pools:
        raise PlanError("No GPU pools were given; the job needs at least one GPU.")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise PlanError(f"Pool names must be unique, got {names}.")
    catalog = catalog if catalog is not None else DEFAULT_CATALOG
    settings = settings or CostSettings()
    usable, costs, notes, excluded = [], [], [], []
    for pool in pools:
        try:
            gpu = catalog[pool.product]
        except UnknownGpuError as err:
            raise UnknownGpuError(f"Pool {pool.name!r}: {err}") from err
        if not gpu.supports(training.dtype):
            notes.append(
                f"Pool {pool.name!r} ({pool.product}) was left out: it has no native "
                f"{training.dtype}; use float16 to include it."
            )
            excluded.append(pool)
            continue
        usable.append(pool)
        costs.append(pool_cost(model, training, pool, gpu, settings))
    if not usable:
        raise UnusableDtypeError(f"No pool can train in {training.dtype}: {' '.join(notes)}")
    return Problem(
        model,
        training,
        tuple(usable),
        tuple(costs),
        LinkCost.of(model, training),
        tuple(notes),
        tuple(excluded),
    )


def solve(
    problem: Problem,
    stage_counts: Sequence[int],
    exhaustive_limit: int = DEFAULT_EXHAUSTIVE_LIMIT,
    *,
    gpus: Sequence[int] | None = None,
    evaluator: Evaluator | None = None,
) -> tuple[Candidate, str, int]:
    """Best candidate, the search used, and how many sequences were evaluated: on ``gpus``
    per pool (None: all the problem's), with ``evaluator`` (None: a new one; the fleet's
    candidates share one and its caches).

    The search ranks sequences by their beats (`search`), and keeps of each stage count the
    ``SHORTLIST`` with the lowest floors under their steps (`Problem.step_floor`). Its best,
    and those kept whose floor is under the fastest step found, at most ``PLAYED_MOST`` in the
    floors' order, are played out over their links (`Problem.played_out`); the fastest (fewer
    stages on a tie) has its split refined (`refine_split`). So the plan's step is never
    longer than the search's best played out. A search that finds no feasible sequence
    returns its least infeasible one (for the diagnosis).
    """
    evaluator = evaluator or problem.evaluator()
    evaluator.forget()
    gpus = problem.gpus if gpus is None else gpus
    before = evaluator.calls
    total = sum(count_sequences(gpus, p) for p in stage_counts)
    if total <= exhaustive_limit:
        best, search = exhaustive(evaluator, gpus, stage_counts), "exhaustive"
    else:
        best = heuristic(evaluator, gpus, stage_counts, step=problem.step_floor)
        search = "heuristic"
    if best.deficit:
        return best, search, evaluator.calls - before
    kept = sorted(
        (floor, len(c.seq), c.seq, c) for floor, c in evaluator.shortlist() if c.seq != best.seq
    )
    played = [(problem.played_out(best), len(best.seq), best)]
    for floor, size, _, cand in kept[:PLAYED_MOST]:
        if floor > min(step for step, _, _ in played):
            break
        played.append((problem.played_out(cand), size, cand))
    fastest = min(played, key=lambda p: (p[0], p[1]))[2]
    return refine_split(problem, evaluator, fastest), search, evaluator.calls - before


def refine_split(problem: Problem, evaluator: Evaluator, cand: Candidate) -> Candidate:
    """``cand`` with its layers moved one at a time between neighbouring stages (within their
    memory) while each move shortens its played-out step by ``REFINE_GAIN`` or more. The
    beats' best split can leave the step's fill and drain longer than they need be: the
    latencies and the first and last stages' shares of them are not in a beat."""
    terms = evaluator.stage_terms(cand.seq)
    counts = list(cand.counts)
    step = problem.played_out(cand)
    improved = True
    while improved:
        improved = False
        for k, j in itertools.chain(
            itertools.pairwise(range(len(counts))),
            ((b, a) for a, b in itertools.pairwise(range(len(counts)))),
        ):
            if counts[k] <= 1 or counts[j] >= terms[j].cap:
                continue
            counts[k] -= 1
            counts[j] += 1
            moved = planned_step_seconds(problem.timeline(cand.seq, counts))
            if moved < step * (1 - REFINE_GAIN):
                step, improved = moved, True
                break
            counts[k] += 1
            counts[j] -= 1
    if counts == list(cand.counts):
        return cand
    beats = tuple(t.beat(n) for t, n in zip(terms, counts, strict=True))
    return replace(cand, counts=tuple(counts), seconds=beats)
