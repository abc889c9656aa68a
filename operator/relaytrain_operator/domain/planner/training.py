"""The training settings that shape a plan: batch, sequence, method, precision, compression."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from relaytrain_contract.order import in_flight
from relaytrain_contract.stage import GRADIENT_BITS

from relaytrain_operator.domain.planner.model_shape import EXPERT_NAMES, FUSED_NAMES, LINEAR_NAMES

Method = Literal["lora", "qlora", "full"]
Dtype = Literal["bfloat16", "float16", "float32"]
#: The worker's wire formats (relaytrain_worker.pipeline.compression); kept in step by name.
Compression = Literal["none", "bf16", "int8", "int4", "delta"]
ActivationBasis = Literal["identity", "fitted"]

METHODS: tuple[str, ...] = get_args(Method)
DTYPES: tuple[str, ...] = get_args(Dtype)
COMPRESSIONS: tuple[str, ...] = get_args(Compression)
ACTIVATION_BASES: tuple[str, ...] = get_args(ActivationBasis)

#: Bytes per element of each dtype.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class TrainingShape:
    """What of a FineTuneJob's settings the planner needs."""

    micro_batch_size: int
    """Sequences per micro-batch."""
    micro_batches: int
    """Micro-batches per optimizer step (M); 1F1B keeps up to min(M, P - k) in flight."""
    sequence_length: int
    """Tokens per sequence."""
    method: Method = "lora"
    """``lora`` (frozen base in ``dtype``), ``qlora`` (frozen 4-bit base) or ``full``."""
    lora_rank: int = 8
    """LoRA rank r (ignored for ``full``)."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Linear layers that get adapters; ``("all-linear",)`` means all seven. MoE expert
    weights (peft's ``target_parameters``) are named ``experts.gate_up_proj`` and
    ``experts.down_proj`` (a longer path ending so, ``mlp.experts.down_proj``, is the same);
    whether the model has them is checked with the model (``planner.targets``)."""
    compression: Compression = "int8"
    """How boundary activations and gradients travel (see the worker's compression)."""
    dtype: Dtype = "bfloat16"
    """Compute and weight dtype of the base model."""
    lora_dropout: float = 0.0
    """LoRA dropout (``spec.method.dropout``): peft cannot apply it to expert weights."""
    forwards_ahead: int = 0
    """Forwards every stage but the last runs ahead of 1F1B (``spec.pipeline.forwardsAhead``):
    that many more micro-batches of activations held (`in_flight`)."""
    forwards_ahead_chosen: bool = False
    """Whether the planner chose ``forwards_ahead`` (``forwardsAhead: auto``) rather than the
    job: its advice then does not ask the job for what it already lets the planner choose."""
    gradient_tokens: float = 1.0
    """The share of tokens whose gradients cross a boundary (``spec.pipeline.gradientTokens``,
    `delta` only): the gradients' bytes are priced at that share."""
    gradient_bits: int = GRADIENT_BITS
    """The bits a value of `delta`'s gradient codes (``spec.pipeline.gradientBits``, 1-4)."""
    gradient_fill: bool = False
    """Whether `delta`'s gradients take more tokens than ``gradient_tokens``, up to all, while
    they fit in their activations' bytes (``spec.pipeline.gradientFill: activations``): priced
    at the share the activations' price leaves room for."""
    epochs: int | None = None
    """Passes over the data (``spec.training.epochs``; None: a job of steps, whose passes the
    plan does not know): `delta`'s activations are priced at the run's mean over them."""
    activation_bits: int = 4
    """The code whose error `delta`'s activations are held to (``spec.pipeline.activationError``:
    int4 or int3): a row's first crossing is priced at about that code's bits."""
    activation_basis: ActivationBasis = "identity"
    """What `delta` codes a token's change in (``spec.pipeline.activationBasis``): ``fitted``
    bases are counted in the stages' memory, and each activation frame pays a share of a
    basis's bytes and fit (`link_cost.BASIS_REFIT`); the rows in them are priced as in the
    identity (what a basis saves depends on the rows, measured 14-18 % of the activations' on
    a tiny model)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "micro_batches", "sequence_length", "lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"training {name} must be a positive integer, got {value!r}")
        checks = (
            ("method", self.method, METHODS),
            ("dtype", self.dtype, DTYPES),
            ("compression", self.compression, COMPRESSIONS),
            ("activation_basis", self.activation_basis, ACTIVATION_BASES),
        )
        for name, value, valid in checks:
            if value not in valid:
                raise ValueError(f"training {name} {value!r} is not one of {', '.join(valid)}")
        if self.activation_bits not in (3, 4):
            raise ValueError(f"training activation_bits must be 3 or 4, got {self.activation_bits}")
        if self.gradient_bits not in (1, 2, 3, 4):
            raise ValueError(f"training gradient_bits must be 1 to 4, got {self.gradient_bits}")
        epochs = self.epochs
        if epochs is not None and (type(epochs) is not int or epochs < 1):
            raise ValueError(f"training epochs must be a positive integer or None, got {epochs!r}")
        if not 0.0 < self.gradient_tokens <= 1.0:
            raise ValueError(
                "training gradient_tokens must be above 0 and at most 1, "
                f"got {self.gradient_tokens}"
            )
        targets = tuple(self.lora_targets)
        if targets in (("all-linear",), ("all_linear",)):
            targets = LINEAR_NAMES
        targets = tuple(_expert_name(t) for t in targets)
        valid = LINEAR_NAMES + FUSED_NAMES + EXPERT_NAMES
        bad = [t for t in targets if t not in valid]
        if bad or not targets:
            raise ValueError(
                f"spec.method.targetModules (lora_targets) {list(self.lora_targets)!r} must name "
                f"some of "
                f"{', '.join(LINEAR_NAMES + FUSED_NAMES)} (or 'all-linear'), and on "
                f"mixture-of-experts models {', '.join(EXPERT_NAMES)} (peft's "
                f"target_parameters); not {', '.join(map(repr, bad)) or 'nothing'}"
            )
        experts = [t for t in targets if t in EXPERT_NAMES]
        if experts and self.lora_dropout:
            raise ValueError(
                f"spec.method.targetModules names expert weights ({', '.join(experts)}), which "
                f"peft adapts only without dropout; spec.method.dropout is "
                f"{self.lora_dropout}: set it to 0 or drop those targets"
            )
        object.__setattr__(self, "lora_targets", targets)

    def in_flight(self, k: int, stages: int) -> int:
        """Micro-batches of activations stage ``k`` of ``stages`` holds at most."""
        return in_flight(k, stages, self.micro_batches, self.forwards_ahead)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one micro-batch carries."""
        return self.micro_batch_size * self.sequence_length

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.dtype]


def _expert_name(name: str) -> str:
    """``mlp.experts.down_proj`` and ``experts.down_proj`` name the same expert weight."""
    for expert in EXPERT_NAMES:
        if name.endswith("." + expert):
            return expert
    return name
