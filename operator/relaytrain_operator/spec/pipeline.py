"""The pipeline section of a FineTuneJob's spec: stages, replicas, the boundary code and
its settings, and the sync between pipelines (the other sections are in sections.py and
placement.py; job.py assembles them). As there, the docstrings are the CRD's descriptions,
the annotations its types, bounds and defaults, and a CEL rule sits beside the validator
that is its pydantic twin."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import ConfigDict, Field, PlainValidator, model_validator
from relaytrain_contract import Compression, PipelineSchedule
from relaytrain_contract.order import MAX_FORWARDS_AHEAD
from relaytrain_contract.stage import (
    GRADIENT_BITS,
    ActivationBasis,
    ActivationError,
    GradientBits,
    GradientFill,
    LoraMerge,
    OuterCode,
    SyncMode,
    check_sync,
)

from relaytrain_operator.spec.errors import field_error
from relaytrain_operator.spec.openapi import Rule, cel, int_or_string
from relaytrain_operator.spec.sections import SpecModel

__all__ = ["MAX_FORWARDS_AHEAD", "MAX_REPLICAS", "MAX_STAGES", "PipelineSpec", "SyncSpec"]

MAX_STAGES = 64
MAX_REPLICAS = 64


def _auto_or_int(value: object, most: int, least: int = 1) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and least <= value <= most:
        return value
    raise ValueError(f'must be "auto" or an integer from {least} to {most}, got {value!r}')


def _stages(value: object) -> int | Literal["auto"]:
    return _auto_or_int(value, MAX_STAGES)


def _replicas(value: object) -> int | Literal["auto"]:
    return _auto_or_int(value, MAX_REPLICAS)


def _forwards_ahead(value: object) -> int | Literal["auto"]:
    return _auto_or_int(value, MAX_FORWARDS_AHEAD, least=0)


def _auto_or_count(field: str, most: int, least: int = 1) -> Rule:
    """The CEL twin of _stages, _replicas and _forwards_ahead."""
    return Rule(
        f"type(self) == string ? self == 'auto' : (self >= {least} && self <= {most})",
        f'spec.pipeline.{field} must be "auto" or an integer from {least} to {most}.',
    )


class SyncSpec(SpecModel):
    """How several pipelines keep their weights equal."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "(has(self.mode) && self.mode == 'periodic') == has(self.everySteps)",
                "spec.pipeline.sync.everySteps must be set exactly when "
                "spec.pipeline.sync.mode is periodic.",
                field=".everySteps",
            ),
            Rule(
                "!has(self.outerCode) || self.outerCode == 'float64' || "
                "(has(self.mode) && self.mode == 'periodic')",
                "spec.pipeline.sync.outerCode int4, int2 or int1 needs "
                "spec.pipeline.sync.mode periodic (only periodic sync has outer steps).",
                field=".outerCode",
            ),
        )
    )

    mode: SyncMode = "synchronous"
    """`synchronous`: gradients reduced every step (every pipeline's copy stays identical);
    `periodic`: each pipeline takes local steps on its share and the weights are averaged,
    token-weighted, every `everySteps` steps (DiLoCo-style outer steps, for slow links)."""
    every_steps: Annotated[int, Field(ge=2)] | None = None
    """Steps between outer steps (at least 2); set exactly with `periodic`."""
    outer_code: OuterCode = "float64"
    """What a periodic outer step sends: `float64`, every pipeline's weights (the exact
    token-weighted mean), or `int4`, `int2`, `int1`, an error-fed, rotated low-bit code of
    each pipeline's update since the last outer step (what a code leaves out goes with the
    next one): 15x, 28x, 51x fewer bytes on the replica links than `float64` with two
    pipelines, 7.5x, 14x, 26x with four (every pipeline receives every other's code)."""
    lora_merge: LoraMerge = "auto"
    """How a periodic outer step merges the pipelines' LoRA adapters: `exact` (every
    replica's layer becomes exactly the token-weighted mean of the pipelines' layers: the
    factors' means, with the rest of ``mean(B_q A_q)`` folded into the frozen weight, which
    is then part of checkpoints and the output as a float32 delta of each adapted weight),
    `average` (B and A averaged one by one: ``mean(B) mean(A)`` is not ``mean(B A)``), or
    `auto`: `exact` for `lora` wherever it sends no more bytes (with an outer code, or
    between two pipelines), else `average`; `qlora` (4-bit weights take no fold) and `full`
    (no factors) always average."""

    @model_validator(mode="after")
    def _every(self) -> SyncSpec:
        check_sync(self.mode, self.every_steps, self.outer_code)
        return self


_STORED_BITS = (GRADIENT_BITS, 3)
"""The ``gradientBits`` a job without ``compression: delta`` may hold: the default, and 3, the
default until 2026-12-07, which the API server stored in every job created before (a job
with `delta` keeps its 3 bits; one without ignores them)."""
_DELTA_BITS = " or ".join(str(b) for b in get_args(GradientBits) if b not in _STORED_BITS)
"""The ``gradientBits`` only `delta` takes, for the error that says so."""


class PipelineSpec(SpecModel):
    """How the model is split into stages and what crosses the links between them."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!has(self.gradientTokens) || self.gradientTokens >= 1.0"
                " || (has(self.compression) && self.compression == 'delta')",
                "spec.pipeline.gradientTokens below 1 needs compression: delta; set "
                "compression: delta, or leave gradientTokens at 1.",
                field=".gradientTokens",
            ),
            Rule(
                "!has(self.gradientFill) || self.gradientFill == 'none'"
                " || (has(self.gradientTokens) && self.gradientTokens < 1.0)",
                "spec.pipeline.gradientFill: activations sends more than gradientTokens' share "
                "of the tokens, and at 1 every token goes already; set gradientTokens below 1 "
                "(with compression: delta), or leave gradientFill out.",
                field=".gradientFill",
            ),
            Rule(
                f"!has(self.gradientBits) || self.gradientBits in {list(_STORED_BITS)}"
                " || (has(self.compression) && self.compression == 'delta')",
                f"spec.pipeline.gradientBits {_DELTA_BITS} needs compression: delta; set "
                "compression: delta, or leave gradientBits out.",
                field=".gradientBits",
            ),
            Rule(
                "!has(self.activationError) || self.activationError == 'int4'"
                " || (has(self.compression) && self.compression == 'delta')",
                "spec.pipeline.activationError int3 needs compression: delta; set "
                "compression: delta, or leave activationError at int4.",
                field=".activationError",
            ),
            Rule(
                "!has(self.activationBasis) || self.activationBasis == 'identity'"
                " || (has(self.compression) && self.compression in ['delta', 'auto'])",
                "spec.pipeline.activationBasis fitted needs compression: delta (or auto, which "
                "uses it where it takes delta); set one of them, or leave activationBasis at "
                "identity.",
                field=".activationBasis",
            ),
        )
    )

    stages: Annotated[
        int | Literal["auto"],
        PlainValidator(_stages),
        Field(json_schema_extra=int_or_string(_auto_or_count("stages", MAX_STAGES))),
    ] = "auto"
    """Number of pipeline stages (1 to 64), or `auto` to let the planner choose."""
    replicas: Annotated[
        int | Literal["auto"],
        PlainValidator(_replicas),
        Field(json_schema_extra=int_or_string(_auto_or_count("replicas", MAX_REPLICAS))),
    ] = 1
    """Pipelines that train together on one global batch per step (1 to 64, each its own GPUs
    and layer split, every step's micro-batches shared among them), or `auto` to let the
    planner choose. At most training.microBatches. A failed stage takes only its pipeline out: the
    others train on."""
    schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule; one-forward-one-backward."""
    compression: Literal[Compression, "auto"] = "int8"
    """Compression of activations and their gradients on the links between stages: `none`
    (the model's dtype), `bf16`, `int8` (blockwise absmax), `int4`, `delta` (each training
    row's activation as a change against what the next stage decoded for it the epoch
    before, each block of 64 values in 0 to 4 bits, within int4's error; gradients at 2
    bits, or gradientBits; each frame deflated where that makes it smaller: for slow links
    and several epochs), or `auto`: the planner takes the most faithful of these whose
    predicted tokens/s is within 5 % of the fastest (status.plan.compression says which)."""
    forwards_ahead: Annotated[
        int | Literal["auto"],
        PlainValidator(_forwards_ahead),
        Field(
            json_schema_extra=int_or_string(
                _auto_or_count("forwardsAhead", MAX_FORWARDS_AHEAD, least=0)
            )
        ),
    ] = 0
    """Forwards each stage but the last runs ahead of 1F1B before its first backward (0 to
    16), or `auto`: the planner plays each step out over the plan's links and takes the
    fewest within 5 % of the fastest step that every stage's memory holds
    (status.plan.forwardsAhead says which). More activations cross a slow link while the
    previous micro-batches compute, at the memory of that many more micro-batches in flight
    (the planner counts it). The gradients are the same, in the same order. 1-2 lift a
    50-200 Mbit/s link's use (docs/links-and-checkpoints.md, "The link bound")."""
    gradient_tokens: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """With `compression: delta`: the share of tokens whose gradients cross each boundary
    (above 0, at most 1; 1, the default: every token). Each micro-batch's tokens are drawn
    at random in proportion to their gradients' norms and divided by their probability, so
    the gradients stay unbiased; the others are zero and cost 1 bit. For fine-tunes of a
    pretrained base, where most tokens' gradients are small: at 0.25 the gradients took 19x
    fewer bytes than bf16 and the held-out loss ended within 1 % of uncompressed training; a
    LoRA that learns from a random model lost 17-43 % (docs/links-and-checkpoints.md)."""
    gradient_bits: GradientBits = GRADIENT_BITS
    """With `compression: delta`: the bits a value of the gradients' code, 1 to 4 (2, the
    default since 2026-12-07, 3 before; a bf16 scale a block of 64 besides). 2 bits ended as
    near uncompressed training as 3 on SmolLM2-135M (held-out loss, three seeds' mean:
    +0.14 % against +0.16 %) at 14-17 % fewer bytes both ways. Fewer bits, more noise: a
    1-bit code's error is about 57 % of a token's energy, a 2-bit code's 13 %, a 3-bit's 4 %.
    Below a gradientTokens of 1 the tokens sent are divided by their probability, their
    codes' error with them, and the draw's own noise is the larger where the tokens' norms
    are alike: there, for the same bytes, more tokens at fewer bits add less noise than
    fewer tokens at more. On a fine-tune of a pretrained base, 1 bit with 0.375 of the
    tokens (gradients 33x fewer bytes than bf16) ended +0.09 % held-out loss (three seeds'
    mean) where 3 bits with 0.18 (as many bytes) ended +0.57 % and 3 bits with 0.25 (20x)
    +0.31 % (docs/links-and-checkpoints.md, "Gradients at one bit")."""
    gradient_fill: GradientFill = "none"
    """With gradientTokens below 1: `activations` sends more of a micro-batch's tokens than
    that share, up to all of them, while their gradients' code fits in the bytes the
    micro-batch's activations took on the same link the other way, which a link otherwise
    leaves idle: the slower direction stays the activations', and the gradients lose less to
    the draw. `none` (the default) keeps the share. On the tiny fine-tune a quarter of the
    tokens, filled, reached none's final loss + 1 % in as many steps as every token, 4 and 10
    fewer than a fixed quarter, at 6-7 % fewer bytes than every token; where the draw costs
    few steps it mostly spends bytes. A micro-batch's share follows what its activations
    cost, so a step redone after a failure, whose rows cross as full codes again, may draw
    other tokens (docs/links-and-checkpoints.md, "Gradients that fill the link")."""
    activation_error: ActivationError = "int4"
    """With `compression: delta`: the expected error each training row's activation code is
    held to, what an `int4` code leaves (about 10 % of the row's norm; the default) or an
    `int3` code (about 19 %). The codes then take about two thirds of the bits, and the next
    stage trains on noisier activations: for fine-tunes of a pretrained base, like
    gradientTokens below 1, and costlier at width: within 1 % at a hidden size of 256 but
    +2.8 % at 1024, where int4 ended +0.46 and +1.19 % on two seeds
    (docs/links-and-checkpoints.md, "The delta compression"; docs/gpu-check.md, "The loss gap
    at width")."""
    activation_basis: ActivationBasis = "identity"
    """With `compression: delta` (or `auto`, where it takes delta): what each token's change
    of a training row is coded in, `identity` (blocks of its values as they are; the default)
    or `fitted`: a basis the sending stage fits to the changes it sent (their second moment's
    eigenvectors), sent after the first 4 frames and every 96 after (each vector in the 0-8 bits
    its eigenvalue asks), where a few coordinates hold most of the energy and take the bits,
    within the same error. Fewer bytes for the same error: 14-18 % of the activations' on the
    tiny fine-tune measured, the bases' own bytes included (3-4 % of them; a basis weighs less
    on wider models), at the memory of the bases and moments: 32 h^2 bytes on a middle stage's
    device (512 MiB at hidden 4096), which the planner counts, and the fits: each frame pays a
    96th of a basis's bytes and of both ends' work on it (at hidden 4096 up to 17 MiB and
    about 33 s of one CPU thread a basis, a bound for a card; each end's QR of it runs beside
    the frames, the rows coded in it 8 frames after the one that carries it at 4096, at once
    under 2048), priced by the planner, whose table says what (docs/planner.md, "Fitted
    bases"; docs/links-and-checkpoints.md, "Bases coded per vector")."""
    sync: SyncSpec = Field(default_factory=SyncSpec)
    """How several pipelines keep their weights equal: `synchronous` (gradients reduced every
    step) or `periodic` (local steps, weights averaged every `everySteps` steps, for slow
    links)."""

    @model_validator(mode="after")
    def _delta_only(self) -> PipelineSpec:
        if self.gradient_tokens < 1.0 and self.compression != "delta":
            raise field_error(
                "gradientTokens",
                f"a share below 1 needs compression: delta (got {self.compression}); "
                "set compression: delta, or leave gradientTokens at 1",
            )
        if self.gradient_fill != "none" and self.gradient_tokens >= 1.0:
            raise field_error(
                "gradientFill",
                f"{self.gradient_fill} sends more than gradientTokens' share of the tokens, "
                "and at 1 every token goes already; set gradientTokens below 1 (with "
                "compression: delta), or leave gradientFill out",
            )
        if self.gradient_bits not in _STORED_BITS and self.compression != "delta":
            raise field_error(
                "gradientBits",
                f"{self.gradient_bits} bits needs compression: delta (got {self.compression}); "
                "set compression: delta, or leave gradientBits out",
            )
        if self.activation_error != "int4" and self.compression != "delta":
            raise field_error(
                "activationError",
                f"{self.activation_error} needs compression: delta (got {self.compression}); "
                "set compression: delta, or leave activationError at int4",
            )
        if self.activation_basis != "identity" and self.compression not in ("delta", "auto"):
            raise field_error(
                "activationBasis",
                f"{self.activation_basis} needs compression: delta or auto (got "
                f"{self.compression}); set one of them, or leave activationBasis at identity",
            )
        return self
