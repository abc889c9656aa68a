"""The price of keeping several pipelines' trainable weights the same.

Every pipeline holds every decoder layer exactly once, on one of its stages, and the layer
ranges differ between pipelines. After a step (``synchronous``) each trainable gradient is
reduced among the R stages that hold it: LoRA A and B (kept in fp32, as the cost model's
memory says: 4 bytes a value), or for ``full`` every weight in the job's dtype, plus the
embedding on first stages and the head and final norm on last stages. Every H steps
(``periodic``, DiLoCo-style outer steps) the same stages average the trainable *weights*
instead, which the worker sends as float64 (``relaytrain_worker.replicas.periodic``: the
token-weighted sum must be exact): 8 bytes a value, twice a float32 LoRA gradient. With
an outer code (``spec.pipeline.sync.outerCode`` int4, int2 or int1;
``relaytrain_worker.replicas.outer_codec``) they send each pipeline's update as a rotated
low-bit code instead, ``(bits + 0.25) / 8`` bytes a value, and every pipeline receives every
code: a gather whatever ``sync_collective`` says (codes do not add, so there is no
reduce-scatter to make a ring cheaper). In the worker's star the leading holder receives
R - 1 codes and sends each of the R - 1 others the R - 1 codes it lacks: (R - 1)^2 codes
its busiest way, two hops. An explicit exact LoRA merge (``loraMerge: exact``) needs every
pipeline's factors, so its float64 weights are gathered so too.

Two ways to reduce (``CostSettings.sync_collective``); with B_g the gradient bytes a GPU
holds, and a hop = one send between the two slowest-to-reach pipelines (the two largest of
the pipelines' slowest one-way link latencies):

* ``all-gather`` (the worker's ``relaytrain_worker.replicas.group.LinkGroup``): every holder
  sends its gradients to the holders of the same names in every other pipeline, all at
  once, and folds what it receives in pipeline order. A GPU moves (R - 1) x B_g each way;
  one hop. With adapters and ``synchronous`` sync the worker adds every micro-batch's
  gradient in the global micro-batch order, so that any shares give single-process
  training's bits (``relaytrain_worker.replicas.arithmetic``): a pipeline with more than
  one micro-batch, other than the one leading the fold (pipeline 0, the largest share),
  takes a *round* (``relaytrain_worker.replicas.star``): the leader sends it the sum so
  far, it adds its terms and sends the sum back, one copy each way (the last round's sum is
  that pipeline's result: nothing comes back). The rounds run one after another, two hops
  each, and every round but the last costs the leader one more copy out (``fold_rounds``);
  the shares are known once a set is chosen, and no round is a lower bound for any.
* ``ring``: a reduce-scatter and an all-gather around a ring per layer: 2(R - 1)/R x B_g
  each way, 2(R - 1) hops. Cheaper in bytes, dearer in latency.

Every layer's exchange runs at once, so the bytes take ``max over GPUs (moved / bandwidth)``
(the busiest link). ``synchronous`` adds one hop per step: the first stages swap their
label-token counts before the first forward (the loss is normalised by the whole step's).
``periodic`` pays one reduction every H steps. Conservative: nothing overlaps the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from relaytrain_operator.domain.planner.cost import (
    FP32_TRAINABLE_BYTES,
    Collective,
    PoolCost,
    lora_params_per_layer,
)
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.training import TrainingShape

SyncMode = Literal["synchronous", "periodic"]
SYNC_MODES: tuple[str, ...] = get_args(SyncMode)
#: Bytes of an fp32 LoRA gradient value (the trainable state is 4 such values).
LORA_GRADIENT_BYTES = FP32_TRAINABLE_BYTES // 4
#: Bytes of a value in a periodic outer step (float64 weights, whatever the training dtype).
OUTER_VALUE_BYTES = 8
OuterCode = Literal["float64", "int4", "int2", "int1"]
OUTER_CODES: tuple[str, ...] = get_args(OuterCode)
#: Bits of a low-bit outer code's values, with its bf16 scale per 64 values.
CODE_BITS = {"int4": 4.25, "int2": 2.25, "int1": 1.25}


@dataclass(frozen=True)
class Sync:
    """How often the pipelines reduce their gradients (``spec.pipeline`` sync settings)."""

    mode: SyncMode = "synchronous"
    """``synchronous``: every step, so every pipeline's copy stays identical; ``periodic``:
    every ``every`` steps (outer steps for slow links)."""
    every: int = 1
    """Steps between synchronisations (1 for ``synchronous``)."""
    code: str = "float64"
    """What a periodic outer step sends (``outerCode``): float64 weights or a low-bit code."""
    exact: bool = False
    """A LoRA job's ``loraMerge: exact``: every pipeline needs every pipeline's factors, so
    even float64 weights are gathered (``auto`` merges exactly only where a gather costs what
    a sum does, and is priced as the sum)."""

    @property
    def gathered(self) -> bool:
        """Whether an outer step gathers (codes, or the exact merge's weights) rather than
        reduces."""
        return self.mode == "periodic" and (self.code != "float64" or self.exact)

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(f"sync mode {self.mode!r} is not one of {', '.join(SYNC_MODES)}")
        if self.code not in OUTER_CODES:
            raise ValueError(f"outer code {self.code!r} is not one of {', '.join(OUTER_CODES)}")
        if self.code != "float64" and self.mode != "periodic":
            raise ValueError(f"outer code {self.code} needs periodic sync (outer steps)")
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"sync every must be a positive integer, got {self.every!r}")
        if self.mode == "synchronous" and self.every != 1:
            raise ValueError(
                f"sync every is {self.every}, but synchronous sync happens every step; "
                "use periodic to synchronise every H steps"
            )


@dataclass(frozen=True)
class Gradients:
    """Bytes of what one copy of the model reduces per synchronisation (trainable gradients,
    or with periodic sync the trainable weights), by where they live."""

    per_layer: float
    """One decoder layer's trainable gradient."""
    first: float
    """Extra on a pipeline's first stage (the embedding, when it is trained)."""
    last: float
    """Extra on a pipeline's last stage (output head and final norm, when trained)."""
    dtype: str
    """What the values are: ``float32`` for LoRA, the job's dtype for full training."""
    what: str
    """``LoRA`` or ``full``."""
    kind: str = "gradients"
    """``gradients`` (synchronous) or ``weights`` (periodic outer steps)."""

    @classmethod
    def of(cls, model: ModelShape, training: TrainingShape, sync: Sync | None = None) -> Gradients:
        periodic = sync is not None and sync.mode == "periodic"
        kind = "weights" if periodic else "gradients"
        coded = sync is not None and periodic and sync.code != "float64"
        outer = CODE_BITS[sync.code] / 8 if coded and sync else OUTER_VALUE_BYTES
        label = f"{sync.code} codes of" if coded and sync else "float64"
        if coded:
            kind = "updates"
        if training.method != "full":
            e = outer if periodic else LORA_GRADIENT_BYTES
            per_layer = lora_params_per_layer(model, training) * e
            return cls(float(per_layer), 0.0, 0.0, label if periodic else "float32", "LoRA",
                       kind)  # fmt: skip
        e = outer if periodic else training.dtype_bytes
        head = 0 if model.tie_word_embeddings else model.embedding_params
        return cls(
            float(model.layer_params * e),
            float(model.embedding_params * e),
            float((head + model.hidden_size) * e),
            label if periodic else training.dtype,
            "full",
            kind,
        )

    def total(self, num_layers: int) -> float:
        """Bytes of one whole copy."""
        return self.per_layer * num_layers + self.first + self.last


def pipeline_load_seconds(
    grads: Gradients,
    costs: Sequence[PoolCost],
    seq: Sequence[int],
    counts: Sequence[int],
) -> float:
    """max over a pipeline's stages of (gradient bytes it holds / its link bandwidth)."""
    p = len(seq)
    worst = 0.0
    for k, (i, n) in enumerate(zip(seq, counts, strict=True)):
        nbytes = n * grads.per_layer
        nbytes += grads.first if k == 0 else 0.0
        nbytes += grads.last if k == p - 1 else 0.0
        worst = max(worst, nbytes / costs[i].bandwidth_bytes_per_s)
    return worst


def pipeline_latency_seconds(costs: Sequence[PoolCost], seq: Sequence[int]) -> float:
    """The slowest one-way link latency among a pipeline's stages."""
    return max(costs[i].latency_s for i in seq)


def top_two(values: Sequence[float]) -> float:
    """Sum of the two largest values (the one value when there is one)."""
    ordered = sorted(values, reverse=True)
    return sum(ordered[:2])


def collective_of(sync: Sync, collective: Collective) -> Collective:
    """The collective that prices `sync`: an outer code's are gathered (see the module doc)."""
    return "all-gather" if sync.gathered else collective


def fold_rounds(sync: Sync, collective: Collective, adapters: bool, shares: Sequence[int]) -> int:
    """Rounds of an ``all-gather`` synchronisation (see the module doc) for pipelines given
    ``shares`` micro-batches, the largest leading: with adapters and ``synchronous`` sync,
    the other pipelines with more than one micro-batch; else none."""
    if not (adapters and sync.mode == "synchronous" and collective == "all-gather"):
        return 0
    several = sum(1 for share in shares if share > 1)
    return several - (1 if shares and max(shares) > 1 else 0)


def sync_seconds(
    sync: Sync,
    collective: Collective,
    pipelines: int,
    load: float,
    hop: float,
    *,
    rounds: int = 0,
) -> tuple[float, float]:
    """(bytes, latency) seconds of one synchronisation of ``pipelines`` (0 for one), where
    ``load`` is max over GPUs of gradient bytes / bandwidth and ``hop`` one slowest send;
    ``rounds``: of an ``all-gather`` (``fold_rounds``; see the module doc)."""
    r = pipelines
    if r <= 1:
        return 0.0, 0.0
    if sync.gathered:  # the star's gather: the leader sends each the others' codes
        moved, latency = (r - 1) ** 2 * load, 2 * hop
    elif collective == "ring":
        moved, latency = 2 * (r - 1) / r * load, 2 * (r - 1) * hop
    else:
        moved, latency = (r - 1 + max(rounds - 1, 0)) * load, max(1, 2 * rounds) * hop
    if sync.mode == "synchronous":
        latency += hop  # the label-token counts, before the step's first forward
    return moved, latency


@dataclass(frozen=True)
class SyncPrice:
    """What synchronising R pipelines costs, for the plan's output."""

    sync: Sync
    collective: Collective
    pipelines: int
    gradients: Gradients
    gradient_bytes: float
    """Bytes of one copy of the trainable gradients."""
    load_seconds: float
    """max over GPUs of its gradient bytes / its bandwidth."""
    hop_latency_seconds: float
    """One send between the two slowest-to-reach pipelines."""
    rounds: int = 0
    """Rounds of the all-gather (``fold_rounds``)."""

    def _parts(self) -> tuple[float, float]:
        return sync_seconds(
            self.sync,
            self.collective,
            self.pipelines,
            self.load_seconds,
            self.hop_latency_seconds,
            rounds=self.rounds,
        )

    @property
    def bandwidth_seconds(self) -> float:
        """Moving the bytes over the busiest link, per synchronisation."""
        return self._parts()[0]

    @property
    def latency_seconds(self) -> float:
        """Waiting on the slowest links, per synchronisation."""
        return self._parts()[1]

    @property
    def seconds(self) -> float:
        """One synchronisation."""
        return sum(self._parts())

    @property
    def per_step_seconds(self) -> float:
        """Its share of each optimizer step."""
        return self.seconds / self.sync.every
