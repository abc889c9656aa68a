"""A job priced on its pools: the shared input of the search, the plan and the diagnosis."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relaytrain_operator.domain.planner.catalog import DEFAULT_CATALOG, Catalog, UnknownGpuError
from relaytrain_operator.domain.planner.cost import CostSettings, LinkCost, PoolCost, pool_cost
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
from relaytrain_operator.domain.planner.training import TrainingShape


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
        )

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
) -> tuple[Candidate, str, int]:
    """Best candidate, the search used, and how many sequences were evaluated."""
    evaluator = problem.evaluator()
    total = sum(count_sequences(problem.gpus, p) for p in stage_counts)
    if total <= exhaustive_limit:
        return exhaustive(evaluator, problem.gpus, stage_counts), "exhaustive", evaluator.calls
    return heuristic(evaluator, problem.gpus, stage_counts), "heuristic", evaluator.calls
