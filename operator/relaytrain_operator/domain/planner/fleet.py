"""`plan_fleet()`: several pipelines of different shapes on one fleet, or one when that wins.

A plan is a set of pipelines, each on its own GPUs and each split by the exact
single-pipeline splitter (search.py). The step's M micro-batches are shared so that the
slowest pipeline finishes first (shares.py, exact), and the pipelines then reduce their
gradients (sync.py). The plan minimises the step: slowest pipeline + sync per step.

The search, in two parts:

1. Candidate pipelines (fleet_candidates.py): every multiset of pools' GPUs of a useful
   size, each with its best order and split, and the best single pipeline (``plan()``);
   a candidate that another on a subset of its GPUs replaces without loss is dropped.

2. Sets of candidates within the pools' GPU counts (fleet_combiner.py, :class:`Combiner`):
   greedy and fill starts per class of links, local moves, then a branch and bound that is
   exact over the candidates when it finishes within ``SET_BUDGET`` sets ("exhaustive"),
   else the best found ("heuristic").

One pipeline is the answer when it wins — with ``replicas`` left to the planner, unless
several beat it by `growth.GROWTH_MARGIN` (5 %: a pipeline more costs GPUs another job could
use, a sync every step and a join on each return, the margin a running job grows by); it is
then exactly ``plan()``'s result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from relaytrain_operator.domain.planner.api import plan, to_plan
from relaytrain_operator.domain.planner.catalog import Catalog
from relaytrain_operator.domain.planner.cost import CostSettings
from relaytrain_operator.domain.planner.fleet_candidates import (
    CANDIDATE_EXHAUSTIVE_LIMIT,
    EXTRA_STAGES,
    MAX_VECTORS,
    Pipe,
    candidates,
    pipe_of_plan,
    undominated,
    with_single,
)
from relaytrain_operator.domain.planner.fleet_combiner import SET_BUDGET, Combiner
from relaytrain_operator.domain.planner.fleet_result import FleetPlan
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.pools import Pool
from relaytrain_operator.domain.planner.problem import Problem, build_problem
from relaytrain_operator.domain.planner.result import Plan, PlanError
from relaytrain_operator.domain.planner.search import DEFAULT_EXHAUSTIVE_LIMIT
from relaytrain_operator.domain.planner.shares import split_fast
from relaytrain_operator.domain.planner.sync import (
    Gradients,
    Sync,
    SyncPrice,
    collective_of,
    fold_rounds,
    top_two,
)
from relaytrain_operator.domain.planner.training import TrainingShape

__all__ = [
    "CANDIDATE_EXHAUSTIVE_LIMIT",
    "EXTRA_STAGES",
    "MAX_VECTORS",
    "SET_BUDGET",
    "Combiner",
    "Pipe",
    "candidates",
    "plan_fleet",
    "undominated",
]


def plan_fleet(
    model: ModelShape,
    training: TrainingShape,
    pools: Sequence[Pool],
    catalog: Catalog | None = None,
    *,
    settings: CostSettings | None = None,
    stages: int | None = None,
    replicas: int | None = None,
    sync: Sync | None = None,
    exhaustive_limit: int = DEFAULT_EXHAUSTIVE_LIMIT,
    set_budget: int = SET_BUDGET,
    suggest: bool = True,
) -> FleetPlan:
    """Plan ``replicas`` pipelines (None: the best number, 1 included) on ``pools``.

    ``stages`` fixes every pipeline's stage count. Raises :class:`PlanError` when not even one
    pipeline fits (the message of :func:`plan`, its suggestions re-planned by this call; none
    with ``suggest`` False) or when ``replicas`` pipelines cannot be made.
    """
    sync = sync or Sync()
    collective = collective_of(sync, (settings or CostSettings()).sync_collective)
    if replicas is not None and (isinstance(replicas, bool) or replicas < 1):
        raise ValueError(f"replicas must be a positive integer or None, got {replicas!r}")
    # With None or 1 replicas this call fails only where plan() does: plan() checks its own.
    replan = (
        None
        if replicas in (None, 1)
        else partial(
            plan_fleet,
            model,
            catalog=catalog,
            settings=settings,
            stages=stages,
            replicas=replicas,
            sync=sync,
            exhaustive_limit=exhaustive_limit,
            set_budget=set_budget,
            suggest=False,
        )
    )
    single = plan(
        model,
        training,
        pools,
        catalog,
        settings=settings,
        stages=stages,
        exhaustive_limit=exhaustive_limit,
        suggest=suggest,
        replan=replan,
    )
    problem = build_problem(model, training, pools, catalog, settings)
    grads = Gradients.of(model, training, sync)
    usable = sum(problem.gpus)
    one = FleetPlan(
        pipelines=(single,),
        micro_batches=training.micro_batches,
        tokens_per_micro_batch=training.tokens_per_micro_batch,
        sync=SyncPrice(sync, collective, 1, grads, grads.total(model.num_layers), 0.0, 0.0),
        single=single,
        usable_gpus=usable,
        search="single",
        notes=problem.notes,
    )
    if replicas == 1:
        return one
    if replicas is not None and replicas > training.micro_batches:
        raise PlanError(
            f"{replicas} pipelines need at least one micro-batch each, but a step has "
            f"{training.micro_batches}; use at most {training.micro_batches} or 'auto'."
        )
    m = training.micro_batches
    pipes = undominated(candidates(problem, grads, stages), m)
    pipes = with_single(pipes, pipe_of_plan(problem, grads, single), m)
    combiner = Combiner(
        pipes,
        problem.gpus,
        [(c.latency_s, c.bandwidth_bytes_per_s) for c in problem.costs],
        micro_batches=training.micro_batches,
        sync=sync,
        collective=collective,
        adapters=training.method != "full",
        replicas=replicas,
        budget=set_budget,
    )
    chosen, exact = combiner.run(
        single.step_seconds / (1 + GROWTH_MARGIN) if replicas is None else None
    )
    if chosen is None:
        most = combiner.most_pipelines()
        raise PlanError(
            f"{replicas} pipelines do not fit on the usable GPUs ({usable}): at most {most} "
            f"pipeline(s) of the candidates fit side by side; use at most {most} or 'auto'."
        )
    if len(chosen) <= 1:  # the single pipeline wins
        return replace(
            one,
            search="exhaustive" if exact else "heuristic",
            candidates=len(pipes),
            sets_evaluated=combiner.evaluated,
        )
    return _fleet_plan(
        problem,
        grads=grads,
        sync=sync,
        single=single,
        chosen=chosen,
        combiner=combiner,
        exact=exact,
        candidates=len(pipes),
    )


def _fleet_plan(
    problem: Problem,
    *,
    grads: Gradients,
    sync: Sync,
    single: Plan,
    chosen: Sequence[Pipe],
    combiner: Combiner,
    exact: bool,
    candidates: int,
) -> FleetPlan:
    training = problem.training
    # The split the search priced (every share at least one; the same optimum as the greedy).
    shares = split_fast([p.lane for p in chosen], training.micro_batches)
    # Most micro-batches first, then the fastest (beat, then step: links can tie the beats).
    order = sorted(
        range(len(chosen)),
        key=lambda i: (-shares[i], chosen[i].beat, chosen[i].lane.seconds(shares[i])),
    )
    plans = []
    for i in order:
        p, m = chosen[i], shares[i]
        own = replace(problem, training=replace(training, micro_batches=m))
        plans.append(to_plan(own, replace(p.cand, micro_batches=m), p.search, p.evaluated))
    price = SyncPrice(
        sync,
        combiner.collective,
        len(chosen),
        grads,
        grads.total(problem.model.num_layers),
        max(p.load for p in chosen),
        top_two([p.latency for p in chosen]),
        fold_rounds(combiner.sync, combiner.collective, combiner.adapters, shares),
    )
    return FleetPlan(
        pipelines=tuple(plans),
        micro_batches=training.micro_batches,
        tokens_per_micro_batch=training.tokens_per_micro_batch,
        sync=price,
        single=single,
        usable_gpus=sum(problem.gpus),
        search="exhaustive" if exact else "heuristic",
        candidates=candidates,
        sets_evaluated=combiner.evaluated,
        notes=problem.notes,
    )
