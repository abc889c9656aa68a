"""The sections of a FineTuneJob's spec as pydantic models: model, dataset, method,
training, checkpoint, output, failurePolicy (placement.py has placement, pipeline.py the
pipeline; job.py assembles them into FineTuneJobSpec).

As in job.py, the docstrings are the CRD's descriptions, the annotations its types, bounds,
patterns and defaults, and a CEL rule sits beside the validator that is its pydantic twin.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator
from relaytrain_contract import (
    DatasetFormat,
    Dtype,
    LrSchedule,
    MethodType,
    Truncation,
)
from relaytrain_contract.camel import CAMEL_CASE
from relaytrain_contract.stage import (
    EndOfData,
)

from relaytrain_operator.spec import patterns
from relaytrain_operator.spec.errors import field_error
from relaytrain_operator.spec.openapi import (
    Rule,
    cel,
    fixed_once_started,
    list_type,
)

__all__ = [
    "CheckpointSpec",
    "CredentialsSecret",
    "DatasetSpec",
    "FailurePolicy",
    "LinkCertificatesSpec",
    "MethodSpec",
    "ModelSpec",
    "OutputSpec",
    "SpecModel",
    "TrainingSpec",
    "ValidationSpec",
    "is_s3",
]

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
