"""The stage contract (docs/stage-contract.md) as typed, validated dataclasses.

The operator (and `relaytrain run --local`) writes one JSON document per stage; this
module is the worker's only reader of it. Every field is required unless the contract
says otherwise, and unknown fields are errors: an operator and a worker of different
versions must fail loudly at start-up, not train with a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

API_VERSION = "relaytrain.io/v1alpha1"
KIND = "StageConfig"

DatasetFormat = Literal["text", "prompt-completion", "chat"]
MethodType = Literal["lora", "qlora", "full"]
LrSchedule = Literal["cosine", "linear", "constant"]
PipelineSchedule = Literal["1f1b"]
Compression = Literal["none", "bf16", "int8", "int4"]
Dtype = Literal["float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """The stage document is invalid; the message names the field path."""


@dataclass(frozen=True)
class JobRef:
    """Which FineTuneJob this stage belongs to."""

    namespace: str
    """Kubernetes namespace of the job (also a path element in the checkpoint store)."""
    name: str
    """Job name (a path element in the checkpoint store and part of the link identities)."""
    uid: str
    """The job object's UID ("" outside Kubernetes). Links need not compare it: each
    incarnation of a job has its own link CA, so they refuse another incarnation's stages."""

    def __post_init__(self) -> None:
        for key in ("namespace", "name"):
            value = getattr(self, key)
            if not value or "/" in value:
                raise ConfigError(f"job.{key}: must be a non-empty name without '/', got {value!r}")


@dataclass(frozen=True)
class StageRef:
    """Where this stage sits in the pipeline."""

    index: int
    """0-based position of this stage."""
    count: int
    """Number of stages in the pipeline."""
    layerStart: int  # noqa: N815 - the contract's spelling
    """First global decoder layer this stage holds (inclusive)."""
    layerEnd: int  # noqa: N815
    """Global decoder layer where the next stage starts (exclusive)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"stage.count: must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ConfigError(f"stage.index: must be in [0, {self.count}), got {self.index}")
        if self.layerStart < 0 or self.layerEnd <= self.layerStart:
            raise ConfigError(
                f"stage.layerStart/layerEnd: need 0 <= layerStart < layerEnd, "
                f"got [{self.layerStart}, {self.layerEnd})"
            )

    @property
    def is_first(self) -> bool:
        """Stage 0 reads the data and holds the embedding."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """The last stage holds the final norm and head, and computes the loss."""
        return self.index == self.count - 1


@dataclass(frozen=True)
class ModelSpec:
    """The base model."""

    uri: str
    """Local directory, file:// or s3:// prefix with config.json and safetensors shards."""
    dtype: Dtype
    """Dtype the base weights are held in."""


@dataclass(frozen=True)
class DatasetSpec:
    """The training data (JSONL), read and tokenized by stage 0."""

    uri: str
    """Local path, file:// or s3:// object of a JSONL file."""
    format: DatasetFormat
    """`text`, `prompt-completion` (prompt masked from the loss) or `chat`."""
    textField: str  # noqa: N815
    """Field holding the text for format `text`."""
    promptField: str  # noqa: N815
    """Field holding the prompt for format `prompt-completion`."""
    completionField: str  # noqa: N815
    """Field holding the completion for format `prompt-completion`."""
    messagesField: str  # noqa: N815
    """Field holding the list of {role, content} messages for format `chat`."""
    sequenceLength: int  # noqa: N815
    """Tokens per sequence (packed to or padded to this length)."""
    packing: bool
    """Concatenate examples into full sequences instead of padding each one."""

    def __post_init__(self) -> None:
        if self.sequenceLength < 2:
            raise ConfigError(f"dataset.sequenceLength: must be >= 2, got {self.sequenceLength}")


@dataclass(frozen=True)
class MethodSpec:
    """What is trained."""

    type: MethodType
    """`lora`, `qlora` (4-bit base through bitsandbytes) or `full`."""
    rank: int
    """LoRA rank (ignored by `full`)."""
    alpha: float
    """LoRA alpha (ignored by `full`)."""
    dropout: float
    """LoRA dropout (ignored by `full`)."""
    targetModules: tuple[str, ...]  # noqa: N815
    """Module names LoRA adapts, e.g. q_proj (ignored by `full`)."""

    def __post_init__(self) -> None:
        if self.type != "full":
            if self.rank < 1:
                raise ConfigError(f"method.rank: must be >= 1, got {self.rank}")
            if not self.targetModules:
                raise ConfigError("method.targetModules: must name at least one module")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"method.dropout: must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class TrainingSpec:
    """Optimisation settings, identical on every stage."""

    steps: int | None
    """Optimizer steps to run (null when `epochs` is given)."""
    microBatchSize: int  # noqa: N815
    """Sequences per micro-batch."""
    microBatches: int  # noqa: N815
    """Micro-batches per optimizer step (gradient accumulation)."""
    learningRate: float  # noqa: N815
    """Peak learning rate of AdamW."""
    schedule: LrSchedule
    """Decay after warm-up: `cosine`, `linear` or `constant`."""
    warmupSteps: int  # noqa: N815
    """Linear warm-up steps from 0 to learningRate."""
    weightDecay: float  # noqa: N815
    """AdamW weight decay."""
    maxGradNorm: float  # noqa: N815
    """Global gradient-norm clip across all stages; 0 turns clipping off."""
    seed: int
    """Seed of data order, adapter initialisation and dropout."""
    epochs: int | None = None
    """Passes over the dataset instead of `steps` (optional; exactly one of the two)."""

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ConfigError("training.steps: set exactly one of steps and epochs")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"training.epochs: must be >= 1, got {self.epochs}")
        for key in ("microBatchSize", "microBatches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"training.{key}: must be >= 1, got {getattr(self, key)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"training.steps: must be >= 1, got {self.steps}")
        if self.learningRate <= 0:
            raise ConfigError(f"training.learningRate: must be > 0, got {self.learningRate}")
        if self.warmupSteps < 0:
            raise ConfigError(f"training.warmupSteps: must be >= 0, got {self.warmupSteps}")
        if self.maxGradNorm < 0:
            raise ConfigError(f"training.maxGradNorm: must be >= 0, got {self.maxGradNorm}")


@dataclass(frozen=True)
class PipelineSpec:
    """How stages exchange boundary tensors."""

    schedule: PipelineSchedule
    """Only `1f1b` for now."""
    compression: Compression
    """Activation/gradient compression on the links."""


@dataclass(frozen=True)
class LinksSpec:
    """Where this stage listens and whom it connects to."""

    listen: str | None
    """host:port to accept the previous stage on; null on stage 0."""
    next: str | None
    """host:port of the next stage; null on the last stage."""
    identity: str
    """This stage's link identity: the URI its certificate must carry."""
    prevIdentity: str | None  # noqa: N815
    """The identity the previous stage must prove (a listener accepts only it); null on stage 0."""
    nextIdentity: str | None  # noqa: N815
    """The identity the next stage must prove (we send only to it); null on the last stage."""
    certEnv: str  # noqa: N815
    """Environment variable holding this stage's link certificate (PEM)."""
    keyEnv: str  # noqa: N815
    """Environment variable holding that certificate's private key (PEM)."""
    caEnv: str  # noqa: N815
    """Environment variable holding the job's link CA certificate (PEM)."""


@dataclass(frozen=True)
class CheckpointSpec:
    """Where checkpoints and progress.json go."""

    uri: str
    """s3://bucket/prefix or a local directory."""
    endpoint: str | None
    """S3 endpoint URL; null for a local directory."""
    accessKeyEnv: str  # noqa: N815
    """Environment variable with the S3 access key."""
    secretKeyEnv: str  # noqa: N815
    """Environment variable with the S3 secret key."""
    everySteps: int  # noqa: N815
    """Commit a checkpoint every N optimizer steps (and always after the last)."""
    keep: int
    """Committed checkpoints to keep."""

    def __post_init__(self) -> None:
        if self.everySteps < 1:
            raise ConfigError(f"checkpoint.everySteps: must be >= 1, got {self.everySteps}")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep: must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class OutputSpec:
    """Where the finished adapter (or full weights) goes."""

    uri: str
    """s3://bucket/prefix or a local directory."""


@dataclass(frozen=True)
class ObservabilitySpec:
    """Per-stage HTTP endpoints."""

    port: int
    """Port of /metrics and /healthz; 0 picks a free one (local runs)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"observability.port: must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class StageConfig:
    """Everything one stage process needs; see docs/stage-contract.md."""

    apiVersion: str  # noqa: N815
    """Must be relaytrain.io/v1alpha1."""
    kind: str
    """Must be StageConfig."""
    job: JobRef
    stage: StageRef
    model: ModelSpec
    dataset: DatasetSpec
    method: MethodSpec
    training: TrainingSpec
    pipeline: PipelineSpec
    links: LinksSpec
    checkpoint: CheckpointSpec
    output: OutputSpec
    observability: ObservabilitySpec

    def __post_init__(self) -> None:
        if self.apiVersion != API_VERSION:
            raise ConfigError(f"apiVersion: expected {API_VERSION!r}, got {self.apiVersion!r}")
        if self.kind != KIND:
            raise ConfigError(f"kind: expected {KIND!r}, got {self.kind!r}")
        if self.stage.is_first != (self.links.listen is None):
            raise ConfigError("links.listen: must be null on stage 0 and set on every other stage")
        if self.stage.is_last != (self.links.next is None):
            raise ConfigError("links.next: must be null on the last stage and set on the others")
        if (self.links.prevIdentity is None) != (self.links.listen is None):
            raise ConfigError("links.prevIdentity: must be set exactly when links.listen is")
        if (self.links.nextIdentity is None) != (self.links.next is None):
            raise ConfigError("links.nextIdentity: must be set exactly when links.next is")

    @classmethod
    def from_json(cls, document: str | bytes | dict[str, Any]) -> StageConfig:
        """Parse and validate a stage document (JSON text or an already-parsed dict)."""
        if isinstance(document, str | bytes):
            try:
                document = json.loads(document)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"stage config is not valid JSON: {exc}") from exc
        return _build(cls, document, "")

    def to_dict(self) -> dict[str, Any]:
        """The contract's JSON form (tuples become lists; an unset optional epochs is left out)."""
        doc: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self)))
        if doc["training"]["epochs"] is None:
            del doc["training"]["epochs"]
        return doc


T = TypeVar("T")


def _build(cls: type[T], data: Any, path: str) -> T:
    """Build dataclass `cls` from `data`, naming the field path in every error."""
    where = path or "stage config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{path + '.' if path else ''}{unknown[0]}: unknown field "
            f"(known: {', '.join(sorted(fields))})"
        )
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in data:
            has_default = spec.default is not dataclasses.MISSING or (
                spec.default_factory is not dataclasses.MISSING
            )
            if has_default:
                continue
            raise ConfigError(f"{sub}: required field is missing")
        values[name] = _convert(hints[name], data[name], sub)
    try:
        return cls(**values)
    except ConfigError as exc:
        if path and not str(exc).startswith(path):
            raise ConfigError(f"{path}.{exc}") from None
        raise


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{path}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must not be null")
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {hint!r}")  # pragma: no cover
