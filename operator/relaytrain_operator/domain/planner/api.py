"""`plan()`: from a model, training settings and pools to an ordered pipeline plan."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial

from relaytrain_contract.order import MAX_FORWARDS_AHEAD, in_flight

from relaytrain_operator.domain.planner.catalog import Catalog
from relaytrain_operator.domain.planner.cost import CostSettings, PoolCost
from relaytrain_operator.domain.planner.diagnose import (
    Replan,
    infeasible_error,
    unusable_dtype_error,
)
from relaytrain_operator.domain.planner.link_cost import BASIS_REFIT, basis_share
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.pools import Pool
from relaytrain_operator.domain.planner.problem import (
    Problem,
    UnusableDtypeError,
    build_problem,
    solve,
)
from relaytrain_operator.domain.planner.result import Bottleneck, Plan, PlanError, StagePlan
from relaytrain_operator.domain.planner.search import DEFAULT_EXHAUSTIVE_LIMIT, Candidate
from relaytrain_operator.domain.planner.training import TrainingShape


def plan(
    model: ModelShape,
    training: TrainingShape,
    pools: Sequence[Pool],
    catalog: Catalog | None = None,
    *,
    settings: CostSettings | None = None,
    stages: int | None = None,
    max_stages: int | None = None,
    exhaustive_limit: int = DEFAULT_EXHAUSTIVE_LIMIT,
    suggest: bool = True,
    replan: Replan | None = None,
) -> Plan:
    """Plan a pipeline for ``model`` and ``training`` on ``pools`` (one GPU per stage).

    ``stages`` fixes the number of stages (``pipeline.stages``); None chooses it. Raises
    :class:`PlanError` when the job cannot fit, saying what does not fit and what would:
    each suggestion re-planned by ``replan`` (None: this same call; ``plan_fleet`` passes
    itself), none with ``suggest`` False (what a re-plan asks for).
    """
    if not suggest:
        replan = None
    elif replan is None:
        replan = partial(
            plan,
            model,
            catalog=catalog,
            settings=settings,
            stages=stages,
            max_stages=max_stages,
            exhaustive_limit=exhaustive_limit,
            suggest=False,
        )
    try:
        problem = build_problem(model, training, pools, catalog, settings)
    except UnusableDtypeError as err:
        raise unusable_dtype_error(err, model, training, pools, replan) from None
    counts = problem.stage_counts(stages, max_stages)
    best, search, evaluated = solve(problem, counts, exhaustive_limit)
    if best.deficit:
        raise infeasible_error(problem, best, pools, replan, catalog=catalog, settings=settings)
    return to_plan(problem, best, search, evaluated)


def assess(
    model: ModelShape,
    training: TrainingShape,
    pools: Sequence[Pool],
    stages: Sequence[tuple[str, int]],
    catalog: Catalog | None = None,
    *,
    settings: CostSettings | None = None,
) -> Plan:
    """Predict a given split: ``stages`` is ``[(pool name, decoder layers), ...]`` in order.

    For comparing with other splits (benchmarks) and with measured runs. Memory is not
    enforced: check ``Plan.fits``.
    """
    problem = build_problem(model, training, pools, catalog, settings)
    index = {cost.pool.name: i for i, cost in enumerate(problem.costs)}
    unknown = sorted({name for name, _ in stages} - set(index))
    if unknown:
        raise PlanError(f"Split names pools that are not usable here: {', '.join(unknown)}.")
    names = [name for name, _ in stages]
    over = sorted(c.pool.name for c in problem.costs if names.count(c.pool.name) > c.pool.gpus)
    if over:
        raise PlanError(f"Split uses more GPUs than these pools have: {', '.join(over)}.")
    counts = tuple(n for _, n in stages)
    if min(counts, default=0) < 1 or sum(counts) != model.num_layers:
        raise PlanError(
            f"Split must give every stage at least one layer and {model.num_layers} in all, "
            f"got {list(counts)}."
        )
    seq = tuple(index[name] for name, _ in stages)
    terms = problem.evaluator(ignore_memory=True).stage_terms(seq)
    seconds = tuple(t.beat(n) for t, n in zip(terms, counts, strict=True))
    candidate = Candidate(seq, 0, counts, seconds, training.micro_batches)
    return to_plan(problem, candidate, "fixed", 1)


def to_plan(problem: Problem, best: Candidate, search: str, evaluated: int) -> Plan:
    """The Plan of one evaluated sequence (its micro-batches: ``problem.training``'s)."""
    seq, p = best.seq, len(best.seq)
    link, costs = problem.link, problem.costs
    stages = []
    starts = [0, *itertools.accumulate(best.counts)]
    for k, i in enumerate(seq):
        cost = costs[i]
        first, last = k == 0, k == p - 1
        prev = costs[seq[k - 1]] if k > 0 else None
        nxt = costs[seq[k + 1]] if k < p - 1 else None
        in_flight = problem.training.in_flight(k, p)
        stages.append(
            StagePlan(
                index=k,
                pool=cost.pool.name,
                gpu_product=cost.pool.product,
                layer_start=starts[k],
                layer_end=starts[k + 1],
                compute_seconds=best.counts[k] * cost.layer_seconds
                + cost.fixed_seconds(first, last),
                link_seconds=link.stage_seconds(prev, cost, nxt),
                side_seconds=link.side_seconds(prev, cost, nxt),
                memory_bytes=cost.stage_bytes(best.counts[k], first, last, in_flight),
                memory_available_bytes=cost.available_bytes,
                in_flight=in_flight,
                encode_seconds=link.encode_seconds(prev, nxt),
            )
        )
    slow = max(range(p), key=lambda k: best.seconds[k])
    unconstrained = problem.evaluator(ignore_memory=True).evaluate(seq)
    stage = stages[slow]
    if unconstrained.bottleneck < best.bottleneck * (1 - 1e-9):
        full = [s.index for s in stages if s.index != slow and _is_full(s, costs[seq[s.index]])]
        detail = (
            f"Stage {slow} carries extra layers because stages {full} are full; with more "
            f"memory it would take {unconstrained.bottleneck:.3g}s instead of "
            f"{best.bottleneck:.3g}s per micro-batch."
        )
        bottleneck = Bottleneck(slow, "memory", detail)
    elif stage.side_seconds > stage.compute_seconds and stage.encode_seconds >= (
        stage.side_seconds
    ):
        detail = f"Stage {slow} computes {stage.compute_seconds:.3g}s per micro-batch, " + (
            encoder_detail(problem, stage.encode_seconds, sends_activations=slow < p - 1)
        )
        bottleneck = Bottleneck(slow, "link", detail)
    elif stage.side_seconds > stage.compute_seconds:
        detail = (
            f"Stage {slow} computes {stage.compute_seconds:.3g}s per micro-batch, and beside "
            f"it its busiest link direction takes {stage.side_seconds:.3g}s."
            + link_bound_advice(
                problem.training.micro_batches,
                len(stages),
                problem.training.forwards_ahead,
                chosen=problem.training.forwards_ahead_chosen,
            )
        )
        bottleneck = Bottleneck(slow, "link", detail)
    else:
        detail = f"Stage {slow} computes {stage.compute_seconds:.3g}s per micro-batch" + (
            f", and beside it its busiest link direction takes {stage.side_seconds:.3g}s."
            if stage.side_seconds
            else "."
        )
        bottleneck = Bottleneck(slow, "compute", detail)
    pools = [costs[i] for i in seq]
    return Plan(
        stages=tuple(stages),
        micro_batches=problem.training.micro_batches,
        tokens_per_micro_batch=problem.training.tokens_per_micro_batch,
        bottleneck=bottleneck,
        search=search,  # type: ignore[arg-type]
        sequences_evaluated=evaluated,
        notes=problem.notes,
        timeline=problem.timeline(seq, best.counts),
        most_ahead=most_ahead(problem, pools, stages),
    )


def most_ahead(problem: Problem, pools: Sequence[PoolCost], stages: Sequence[StagePlan]) -> int:
    """The most forwards ahead (to `MAX_FORWARDS_AHEAD`) whose activations fit every stage of
    the plan: each holds `in_flight` micro-batches' more of them, the last stage none."""
    m, p = problem.training.micro_batches, len(stages)

    def fits(ahead: int) -> bool:
        return all(
            pool.stage_bytes(s.layers, k == 0, k == p - 1, in_flight(k, p, m, ahead))
            <= s.memory_available_bytes
            for k, (pool, s) in enumerate(zip(pools, stages, strict=True))
        )

    return max((a for a in range(MAX_FORWARDS_AHEAD + 1) if fits(a)), default=0)


LINK_BOUND_MICRO_BATCHES = 32
"""Micro-batches a step that leave a link-bound step 97 % of its time to streaming."""
LINK_BOUND_AHEAD = 2
"""Forwards ahead that hide a link's round trip (measured: docs/links-and-checkpoints.md)."""


def link_bound_advice(micro_batches: int, stages: int, ahead: int, *, chosen: bool) -> str:
    """What keeps a link-bound pipeline's link busy, when the job has not asked for it: a
    1F1B step of m micro-batches over p stages streams at most m / (m + p - 1) of its time
    (the bubble: the first activation and the last gradient cross alone), and without
    forwards ahead the stage before the link also waits a round trip for each gradient
    (the played-out step counts both). Measured over a kernel-shaped link with 32
    micro-batches and four ahead: 90-98 % of the link's bound at 200, 50 and 10 Mbit/s.
    ``chosen``: the planner chose ``ahead`` (``forwardsAhead: auto``), so the advice names
    micro-batches alone."""
    enough_ahead = chosen or ahead >= LINK_BOUND_AHEAD
    if micro_batches >= LINK_BOUND_MICRO_BATCHES and enough_ahead:
        return ""
    share = micro_batches / (micro_batches + stages - 1)
    more = f"more micro-batches (training.microBatches, {LINK_BOUND_MICRO_BATCHES} or so)"
    if chosen:
        ahead_advice = (
            f"{more} keep it busy (pipeline.forwardsAhead auto chose {ahead}, from the step "
            f"played out over these links)"
        )
    elif enough_ahead:
        ahead_advice = f"{more} keep it busy (pipeline.forwardsAhead {ahead})"
    else:
        ahead_advice = (
            f"{more} and pipeline.forwardsAhead {LINK_BOUND_AHEAD}-4, or auto to have the step "
            f"played out over these links (now {ahead}: one micro-batch's activations of "
            f"memory each), keep it busy"
        )
    return (
        f" With {micro_batches} micro-batches a step the link streams at most {share:.0%} of "
        f"it (fill and drain); {ahead_advice}: 90-98 % of the link's bound measured so "
        f"(docs/links-and-checkpoints.md)."
    )


def encoder_detail(problem: Problem, seconds: float, *, sends_activations: bool) -> str:
    """Where a stage's encoder sets the pace (``delta``'s codes beside its compute, its link
    directions less busy): what of it a fitted basis is, and what shrinks it."""
    training = problem.training
    text = f"and beside it its encoder (delta's codes) takes {seconds:.3g}s, more than its links."
    if training.activation_basis != "fitted" or not sends_activations:
        return text
    _, fit = basis_share(problem.model.hidden_size)
    return text + (
        f" Of that, {fit:.3g}s is its share of the bases it fits (pipeline.activationBasis "
        f"fitted: one every {BASIS_REFIT} frames, whatever a frame's tokens): identity fits "
        "none, and more tokens a micro-batch share each fit among more."
    )


def _is_full(stage: StagePlan, cost: PoolCost) -> bool:
    """Whether one more layer would not fit on this stage."""
    per_layer = cost.layer_static_bytes + stage.in_flight * cost.layer_activation_bytes
    return stage.memory_bytes + per_layer > stage.memory_available_bytes
