"""The sections of a FineTuneJob's spec as pydantic models: model, dataset, method,
training, pipeline, checkpoint, output, failurePolicy (placement.py has placement; job.py
assembles them into FineTuneJobSpec).

As in job.py, the docstrings are the CRD's descriptions, the annotations its types, bounds,
patterns and defaults, and a CEL rule sits beside the validator that is its pydantic twin.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator
from relaytrain_contract import (
    Compression,
    DatasetFormat,
    Dtype,
    LrSchedule,
    MethodType,
    PipelineSchedule,
    Truncation,
)
from relaytrain_contract.camel import CAMEL_CASE
from relaytrain_contract.stage import ActivationError, EndOfData, LoraMerge, OuterCode, SyncMode

from relaytrain_operator.spec import patterns
from relaytrain_operator.spec.errors import field_error
from relaytrain_operator.spec.openapi import (
    Rule,
    cel,
    fixed_once_started,
    int_or_string,
    list_type,
)

__all__ = [
    "MAX_REPLICAS",
    "MAX_STAGES",
    "CheckpointSpec",
    "CredentialsSecret",
    "DatasetSpec",
    "FailurePolicy",
    "LinkCertificatesSpec",
    "MethodSpec",
    "ModelSpec",
    "OutputSpec",
    "PipelineSpec",
    "SpecModel",
    "SyncSpec",
    "TrainingSpec",
    "ValidationSpec",
    "is_s3",
]

MAX_STAGES = 64
MAX_REPLICAS = 64
MAX_FORWARDS_AHEAD = 16

ModelUri = Annotated[str, Field(pattern=patterns.MODEL_URI, max_length=1024)]
StoreUri = Annotated[str, Field(pattern=patterns.STORE_URI, max_length=1024)]
Name = Annotated[str, Field(min_length=1, max_length=253)]


def is_s3(uri: str) -> bool:
    """True for an `s3://` URI (as opposed to a local path or `file://`)."""
    return uri.startswith("s3://")


class SpecModel(BaseModel):
    """A part of the spec: camelCase in manifests, unknown fields refused, strict types."""

    model_config = ConfigDict(
        **CAMEL_CASE, extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )


class ModelSpec(SpecModel):
    """The base model to fine-tune."""

    uri: ModelUri
    """Where the model is: `s3://bucket/prefix` holding config.json, the safetensors shards
    and the tokenizer (read with spec.checkpoint's endpoint and credentials); `hf://org/name`
    for a Hugging Face hub id; or a local directory (local runs)."""
    dtype: Dtype = "bfloat16"
    """Precision of the base weights and of compute. QLoRA keeps the base weights in 4-bit NF4
    and computes in this type."""


class ValidationSpec(SpecModel):
    """Held-out data whose loss the pipeline evaluates (training.evalEverySteps says when):
    its own JSONL file (uri) or a share of the training file (fraction), exactly one."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "has(self.uri) != has(self.fraction)",
                "set exactly one of spec.dataset.validation.uri and "
                "spec.dataset.validation.fraction.",
                field=".uri",
            )
        )
    )

    uri: StoreUri | None = None
    """Where the held-out JSONL file is (`s3://bucket/key` or a local path), in the
    dataset's format and fields."""
    fraction: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    """Share of the training file's records held out instead, in (0, 1): chosen by
    training.seed, the same on every run, and never trained on."""

    @model_validator(mode="after")
    def _one(self) -> ValidationSpec:
        if (self.uri is None) == (self.fraction is None):
            raise field_error("uri", "set exactly one of uri and fraction")
        return self


class DatasetSpec(SpecModel):
    """The training data: JSON Lines, one example per line."""

    uri: StoreUri
    """Where the JSONL file is: `s3://bucket/key` or a local path."""
    format: DatasetFormat = "text"
    """`text`: one text field per line; `prompt-completion`: the loss counts the completion
    only; `chat`: a list of {role, content} messages rendered with the tokenizer's chat
    template."""
    text_field: Name = "text"
    """Field holding the text (format `text`)."""
    prompt_field: Name = "prompt"
    """Field holding the prompt (format `prompt-completion`)."""
    completion_field: Name = "completion"
    """Field holding the completion (format `prompt-completion`)."""
    messages_field: Name = "messages"
    """Field holding the list of {role, content} messages (format `chat`)."""
    sequence_length: Annotated[int, Field(ge=8, le=131072)] = 512
    """Tokens per sequence; longer examples are truncated, shorter ones padded or packed."""
    packing: bool = False
    """Pack several whole examples into one sequence instead of padding each (positions
    restart and attention stops at every example)."""
    truncation: Truncation = "truncate"
    """An example longer than `sequenceLength`: `truncate` it or `drop` it (both counted in
    the job's progress)."""
    validation: ValidationSpec | None = None
    """Held-out data whose loss the pipeline evaluates (training.evalEverySteps says when):
    its own JSONL file (uri) or a share of the training file (fraction), exactly one; empty:
    no evaluation."""


class MethodSpec(SpecModel):
    """What is trained: low-rank adapters (LoRA, QLoRA) or every parameter (full)."""

    type: MethodType = "lora"
    """`lora`: adapters on frozen weights in model.dtype; `qlora`: adapters on 4-bit (NF4)
    frozen weights; `full`: every weight of each stage's slice trains (rank, alpha, dropout
    and targetModules are then ignored)."""
    rank: Annotated[int, Field(ge=1, le=1024)] = 8
    """LoRA rank r (lora and qlora)."""
    alpha: Annotated[int, Field(ge=1, le=4096)] = 16
    """LoRA scaling alpha; the update is scaled by alpha / rank (lora and qlora)."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the LoRA input, in [0, 1) (lora and qlora)."""
    target_modules: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=128)]],
        Field(min_length=1, max_length=64, json_schema_extra=list_type("set")),
    ] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear modules that get adapters, each once (lora and qlora)."""

    @model_validator(mode="after")
    def _unique_targets(self) -> MethodSpec:
        if len(set(self.target_modules)) != len(self.target_modules):
            raise field_error("targetModules", "must not repeat a module name")
        return self


class TrainingSpec(SpecModel):
    """How long and how fast to train. Set exactly one of steps and epochs."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "has(self.steps) != has(self.epochs)",
                "set exactly one of spec.training.steps and spec.training.epochs.",
                field=".steps",
            ),
            Rule(
                "!has(self.steps) || self.warmupSteps <= self.steps",
                "spec.training.warmupSteps must not exceed spec.training.steps.",
                field=".warmupSteps",
            ),
            Rule(
                "!has(self.epochs) || self.endOfData == 'cycle'",
                "spec.training.endOfData stop ends the run after one pass, which epochs "
                "already decide; use steps with stop, or epochs with cycle.",
                field=".endOfData",
            ),
        )
    )

    steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Optimizer steps to run (exactly one of steps and epochs)."""
    epochs: Annotated[int, Field(ge=1, le=1000)] | None = None
    """Passes over the dataset (exactly one of steps and epochs); the worker derives the
    steps from the dataset's size."""
    micro_batch_size: Annotated[int, Field(ge=1, le=4096)] = 1
    """Sequences per micro-batch."""
    micro_batches: Annotated[int, Field(ge=1, le=4096)] = 8
    """Micro-batches per optimizer step (gradient accumulation; 1F1B keeps the pipeline busy
    when this is at least the number of stages)."""
    learning_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 2e-4
    """Peak learning rate."""
    schedule: LrSchedule = "cosine"
    """Learning-rate decay after warm-up."""
    warmup_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """Steps of linear warm-up from 0 to learningRate; at most steps."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 42
    """Seed for initialisation, dropout and data order."""
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """AdamW weight decay."""
    max_grad_norm: Annotated[float, Field(ge=0.0)] = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    eval_every_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """With dataset.validation: evaluate the held-out loss before the first step and every
    this many steps; 0 evaluates only after the last step (which every run with validation
    data does)."""
    end_of_data: EndOfData = "cycle"
    """What steps do once they have used every example: cycle (another pass over the data,
    in a new order) or stop (each example is trained on once: the run ends after one pass,
    before `steps` when that is sooner, and totalSteps says so). With epochs, only cycle."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingSpec:
        if (self.steps is None) == (self.epochs is None):
            raise field_error("steps", "set exactly one of steps and epochs")
        if self.end_of_data == "stop" and self.epochs is not None:
            raise field_error(
                "endOfData",
                "stop ends the run after one pass, which epochs already decide; use steps "
                "with stop, or epochs with cycle",
            )
        if self.steps is not None and self.warmup_steps > self.steps:
            raise field_error(
                "warmupSteps", f"must not exceed steps ({self.steps}), got {self.warmup_steps}"
            )
        return self


def _stages(value: object) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_STAGES:
        return value
    raise ValueError(f'must be "auto" or an integer from 1 to {MAX_STAGES}, got {value!r}')


def _replicas(value: object) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_REPLICAS:
        return value
    raise ValueError(f'must be "auto" or an integer from 1 to {MAX_REPLICAS}, got {value!r}')


def _auto_or_count(field: str, most: int) -> Rule:
    """The CEL twin of _stages and _replicas."""
    return Rule(
        f"type(self) == string ? self == 'auto' : (self >= 1 && self <= {most})",
        f'spec.pipeline.{field} must be "auto" or an integer from 1 to {most}.',
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
        if (self.mode == "periodic") != (self.every_steps is not None):
            raise field_error("everySteps", "must be set exactly when mode is periodic")
        if self.outer_code != "float64" and self.mode != "periodic":
            raise field_error(
                "outerCode", f"is {self.outer_code}, but only periodic sync has outer steps"
            )
        return self


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
                "!has(self.activationError) || self.activationError == 'int4'"
                " || (has(self.compression) && self.compression == 'delta')",
                "spec.pipeline.activationError int3 needs compression: delta; set "
                "compression: delta, or leave activationError at int4.",
                field=".activationError",
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
    before, each block of 64 values in 0 to 4 bits, within int4's error; gradients at 3
    bits: for slow links and several epochs), or `auto`: the planner takes the most faithful
    of these whose predicted tokens/s is within 5 % of the fastest (status.plan.compression
    says which)."""
    forwards_ahead: Annotated[int, Field(ge=0, le=MAX_FORWARDS_AHEAD)] = 0
    """Forwards each stage but the last runs ahead of 1F1B before its first backward (0 to
    16): more activations cross a slow link while the previous micro-batches compute, at the
    memory of that many more micro-batches in flight (the planner counts it). The gradients
    are the same, in the same order. 1-2 lift a 50-200 Mbit/s link's use (docs/links-and-
    checkpoints.md, "The link bound")."""
    gradient_tokens: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """With `compression: delta`: the share of tokens whose gradients cross each boundary
    (above 0, at most 1; 1, the default: every token). Each micro-batch's tokens are drawn
    at random in proportion to their gradients' norms and divided by their probability, so
    the gradients stay unbiased; the others are zero and cost 1 bit. For fine-tunes of a
    pretrained base, where most tokens' gradients are small: at 0.25 the gradients took 19x
    fewer bytes than bf16 and the held-out loss ended within 1 % of uncompressed training; a
    LoRA that learns from a random model lost 17-43 % (docs/links-and-checkpoints.md)."""
    activation_error: ActivationError = "int4"
    """With `compression: delta`: the expected error each training row's activation code is
    held to, what an `int4` code leaves (about 10 % of the row's norm; the default) or an
    `int3` code (about 19 %). The codes then take about two thirds of the bits, and the next
    stage trains on noisier activations: for fine-tunes of a pretrained base, like
    gradientTokens below 1 (docs/links-and-checkpoints.md, "The delta compression")."""
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
        if self.activation_error != "int4" and self.compression != "delta":
            raise field_error(
                "activationError",
                f"{self.activation_error} needs compression: delta (got {self.compression}); "
                "set compression: delta, or leave activationError at int4",
            )
        return self


class CredentialsSecret(SpecModel):
    """A Secret in the job's namespace holding the S3 access key pair."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    """Name of the Secret."""
    access_key_key: Annotated[str, Field(min_length=1, max_length=253)] = "AWS_ACCESS_KEY_ID"
    """Key in the Secret whose value is the access key id."""
    secret_key_key: Annotated[str, Field(min_length=1, max_length=253)] = "AWS_SECRET_ACCESS_KEY"
    """Key in the Secret whose value is the secret access key."""


class CheckpointSpec(SpecModel):
    """Where and how often the stages save what recovery needs."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.uri.startsWith('s3://') || !has(self.endpoint)",
                "spec.checkpoint.endpoint applies only to an s3:// uri.",
                field=".endpoint",
            ),
            Rule(
                "self.uri.startsWith('s3://') || !has(self.credentialsSecret)",
                "spec.checkpoint.credentialsSecret applies only to an s3:// uri.",
                field=".credentialsSecret",
            ),
        )
    )

    uri: Annotated[
        StoreUri, Field(json_schema_extra=fixed_once_started("its checkpoints live there"))
    ]
    """Checkpoint store: `s3://bucket/prefix` or a local directory; steps are written under
    `<uri>/<namespace>/<job>/`. Its endpoint and credentials also serve s3:// model,
    dataset and output URIs."""
    endpoint: Annotated[str, Field(pattern=patterns.ENDPOINT, max_length=1024)] | None = None
    """S3 endpoint URL, e.g. `http://minio.minio:9000`; empty means AWS S3 (s3:// only)."""
    credentials_secret: CredentialsSecret | None = None
    """Secret in the job's namespace with the S3 access key pair (s3:// only)."""
    every_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    """Commit a checkpoint every this many optimizer steps."""
    keep: Annotated[int, Field(ge=1, le=100)] = 2
    """Committed checkpoints to keep; older ones are pruned after each commit."""

    @model_validator(mode="after")
    def _s3_only(self) -> CheckpointSpec:
        if not is_s3(self.uri):
            if self.endpoint is not None:
                raise field_error("endpoint", "applies only to an s3:// uri")
            if self.credentials_secret is not None:
                raise field_error("credentialsSecret", "applies only to an s3:// uri")
        return self


class OutputSpec(SpecModel):
    """Where the finished adapter (or full weights) goes."""

    uri: StoreUri
    """`s3://bucket/prefix` or a local directory; receives the adapter in PEFT format (lora,
    qlora) or safetensors of the trained weights (full)."""


class LinkCertificatesSpec(SpecModel):
    """The certificates the stages prove themselves with on their links (mutual TLS, one
    CA per job), renewed while the job runs."""

    lifetime_seconds: Annotated[int, Field(ge=30, le=31_536_000)] = 2_592_000
    """How long each certificate is valid (30 days by default); a renewal mints the next
    ones for as long. It must exceed three Secret propagation delays (the operator's
    `--secret-propagation-seconds`, 90 by default): a renewal's phases take that long."""
    renew_at_percent: Annotated[int, Field(ge=10, le=90)] = 67
    """The share of that lifetime after which the operator renews them (and, at the
    latest, three Secret propagation delays before they expire)."""


class FailurePolicy(SpecModel):
    """When a failing stage fails the job."""

    max_stage_restarts: Annotated[int, Field(ge=0, le=1000)] = 3
    """Replacements allowed per stage; one more failure fails the job."""
    backoff_seconds: Annotated[int, Field(ge=0, le=3600)] = 10
    """Seconds to wait before replacing a failed stage."""
    return_after_seconds: Annotated[int, Field(ge=0, le=86_400)] = 300
    """How long a pipeline given up (a stage used up maxStageRestarts while the others
    train on) waits before it is tried again, where its stages fit on free GPUs; the wait
    doubles with each return (up to 64 times). 0: a pipeline given up stays given up."""
