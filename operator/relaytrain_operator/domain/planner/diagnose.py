"""Why a job does not fit, by how much, and what would make it fit.

Called only when the plan fails: no sequence of GPUs holds every layer, or no pool can train
in the job's dtype. The message names the tightest constraint in bytes; the suggestions are
not guesses. A suggestion *fits* when the planner entry point that refused the job, called
as the job called it (``plan()`` or ``plan_fleet()``: its stage count, replicas, sync and
search limits), returns a plan for the changed settings on the fleet that would run them:
every pool given, left-out ones included, in the order given (one pool grown for "N more
GPUs"). Only suggestions that fit are offered, always in the same order, so one fleet gives
one message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from relaytrain_operator.domain.planner.catalog import Catalog
from relaytrain_operator.domain.planner.cost import GIB, CostSettings
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.pools import Pool
from relaytrain_operator.domain.planner.problem import Problem, build_problem
from relaytrain_operator.domain.planner.result import PlanError
from relaytrain_operator.domain.planner.search import Candidate
from relaytrain_operator.domain.planner.training import TrainingShape

#: Most GPUs the "add more GPUs" suggestion will consider.
MAX_EXTRA_GPUS = 1024

Replan = Callable[[TrainingShape, Sequence[Pool]], object]
"""The planner entry point as the job called it, less the training settings and the pools:
returns a plan, or raises PlanError when the job does not fit (without suggestions)."""


def _gib(nbytes: float) -> str:
    """Bytes for people: GiB, or MiB below one GiB."""
    if abs(nbytes) < GIB:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / GIB:.1f} GiB"


def infeasible_error(
    problem: Problem,
    best: Candidate,
    pools: Sequence[Pool],
    replan: Replan | None,
    *,
    catalog: Catalog | None = None,
    settings: CostSettings | None = None,
) -> PlanError:
    """A PlanError for ``problem`` (priced on ``pools``) whose best candidate still lacks room
    for some layers; with suggestions checked by ``replan`` (None: no suggestions)."""
    model, training = problem.model, problem.training
    layers = model.num_layers
    largest = max(problem.costs, key=lambda c: c.available_bytes)
    last_need = min(c.stage_bytes(1, False, True, 1) - c.available_bytes for c in problem.costs)
    first_need = min(c.stage_bytes(1, True, False, 1) - c.available_bytes for c in problem.costs)
    gpus = sum(problem.gpus)
    if last_need > 0 and gpus > 1:
        reason = (
            f"No GPU can hold the last stage: with one decoder layer it needs "
            f"{_gib(largest.stage_bytes(1, False, True, 1))} (output head "
            f"{_gib(largest.head_bytes or largest.embed_bytes)}, fp32 logits of one micro-batch "
            f"{_gib(largest.logits_bytes)} for {training.tokens_per_micro_batch} tokens x "
            f"{model.vocab_size} vocabulary), but the largest GPU ({largest.pool.product}) "
            f"offers {_gib(largest.available_bytes)}: short by {_gib(last_need)}."
        )
    elif first_need > 0 and gpus > 1:
        reason = (
            f"No GPU can hold the first stage: the embedding alone needs "
            f"{_gib(largest.embed_bytes)}, and with one layer "
            f"{_gib(largest.stage_bytes(1, True, False, 1))}, but the largest GPU "
            f"({largest.pool.product}) offers {_gib(largest.available_bytes)}: short by "
            f"{_gib(first_need)}."
        )
    else:
        per_layer = largest.layer_static_bytes + largest.layer_activation_bytes
        held = max(layers - best.deficit, 0)
        reason = (
            f"The model's {layers} decoder layers do not fit on the {gpus} usable GPU(s): "
            f"each layer needs {_gib(largest.layer_static_bytes)} of weights and training "
            f"state plus {_gib(largest.layer_activation_bytes)} of activations per micro-batch "
            f"in flight, and the best arrangement found holds {held} of {layers} layers: short "
            f"by {best.deficit} layer(s), about {_gib(best.deficit * per_layer)}."
        )
    if problem.notes:
        reason += " " + " ".join(problem.notes)
    if replan is None:
        return PlanError(reason)
    job = _Job(model, tuple(pools), replan, catalog, settings)
    return PlanError(reason, job.suggestions(training, largest.pool, problem.excluded))


def unusable_dtype_error(
    err: PlanError,
    model: ModelShape,
    training: TrainingShape,
    pools: Sequence[Pool],
    replan: Replan | None,
) -> PlanError:
    """``err`` (no pool can train in the job's dtype) with "dtype float16" when that fits."""
    if replan is None:
        return err
    fits = _Job(model, tuple(pools), replan, None, None).fits(replace(training, dtype="float16"))
    return PlanError(err.reason, ["dtype float16"] if fits else [])


@dataclass(frozen=True)
class _Job:
    """What a what-if re-plan needs besides the changed training settings or pools."""

    model: ModelShape
    pools: tuple[Pool, ...]
    """Every pool given to the plan, left-out ones included, in the order given."""
    replan: Replan
    catalog: Catalog | None
    settings: CostSettings | None

    def fits(self, training: TrainingShape, pools: tuple[Pool, ...] | None = None) -> bool:
        """Whether the job's own planner call plans ``training`` on ``pools`` (default: the
        pools given), as defined in the module docstring."""
        try:
            self.replan(training, self.pools if pools is None else pools)
        except PlanError:
            return False
        return True

    def suggestions(
        self, training: TrainingShape, largest: Pool, excluded: tuple[Pool, ...] = ()
    ) -> list[str]:
        """Changes that make the job fit, each checked by re-planning, in a fixed order."""
        found = []
        if excluded and self.fits(replace(training, dtype="float16")):
            found.append("dtype float16 (which lets the left-out pools join)")
        if training.method != "qlora" and self.fits(replace(training, method="qlora")):
            found.append("method qlora (4-bit base weights)")
        if training.micro_batch_size > 1 and self.fits(replace(training, micro_batch_size=1)):
            found.append(f"microBatchSize 1 (now {training.micro_batch_size})")
        length = training.sequence_length // 2
        while length >= 64:
            if self.fits(replace(training, sequence_length=length)):
                found.append(f"sequenceLength {length} (now {training.sequence_length})")
                break
            length //= 2
        extra = self.extra_gpus(training, largest)
        if extra:
            found.append(f"{extra} more {largest.product} GPU(s) in pool {largest.name!r}")
        return found

    def one_layer_per_stage_fits(self, training: TrainingShape, largest: Pool) -> bool:
        """Whether GPUs like ``largest`` can hold one layer in every stage position (else no
        number of them helps, and the search for one is skipped)."""
        try:
            problem = build_problem(self.model, training, [largest], self.catalog, self.settings)
        except PlanError:
            return False
        cost, m = problem.costs[0], training.micro_batches
        return (
            cost.max_layers(True, False, m) >= 1
            and cost.max_layers(False, False, m) >= 1
            and cost.max_layers(False, True, 1) >= 1
        )

    def extra_gpus(self, training: TrainingShape, largest: Pool) -> int | None:
        """Fewest GPUs to add to the largest-memory pool so the job fits (None: none do).

        The number returned is one that was re-planned and fits, whatever the search does.
        """
        if not self.one_layer_per_stage_fits(training, largest):
            return None

        def fits_with(n: int) -> bool:
            grown = tuple(
                replace(p, gpus=p.gpus + n) if p.name == largest.name else p for p in self.pools
            )
            return self.fits(training, grown)

        high = 1
        while not fits_with(high):
            high *= 2
            if high > MAX_EXTRA_GPUS:
                return None
        low = high // 2  # known not to fit (or 0)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if fits_with(mid) else (mid, high)
        return high
