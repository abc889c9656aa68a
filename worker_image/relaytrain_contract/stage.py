"""The stage document (docs/stage-contract.md): what every stage process is started with.

The operator (and `relaytrain run --local`) builds one StageConfig per stage and hands it
over as JSON (`StageConfig.to_dict`); the worker parses it (`StageConfig.from_json`). Keys
are camelCase, attributes snake_case (relaytrain_contract.camel, as in the FineTuneJob spec
models: `cfg.stage.layer_start` is `stage.layerStart`). Every field is required unless said
otherwise, types are strict (no "3" for 3), and unknown fields are errors: an operator and a
worker of different versions fail loudly at start-up instead of training with a silently
ignored setting.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relaytrain_contract.camel import CAMEL_CASE
from relaytrain_contract.errors import field_error, parse_json
from relaytrain_contract.names import API_VERSION, STAGE_CONFIG_KIND

DatasetFormat = Literal["text", "prompt-completion", "chat"]
Truncation = Literal["truncate", "drop"]
MethodType = Literal["lora", "qlora", "full"]
LrSchedule = Literal["cosine", "linear", "constant"]
EndOfData = Literal["cycle", "stop"]
PipelineSchedule = Literal["1f1b"]
Compression = Literal["none", "bf16", "int8", "int4", "delta"]
ActivationError = Literal["int4", "int3"]
"""What the ``delta`` compression holds each row's activation code to: an int4 or an int3
code's expected error."""
GradientBits = Literal[1, 2, 3, 4]
"""The bits a value of the ``delta`` compression's gradient codes (a bf16 scale a block of 64
besides)."""
GRADIENT_BITS: GradientBits = 2
"""``pipeline.gradientBits`` where a job leaves it out (3 until 2026-12-07: 2 bits, each frame
in a rotation of its own, ended as near uncompressed training on SmolLM2-135M and the tiny
benchmarks at 14-17 % fewer bytes both ways; docs/links-and-checkpoints.md, "Gradients at two
bits by default")."""
GradientFill = Literal["none", "activations"]
"""Whether the ``delta`` compression's gradients take more of their tokens than
``gradientTokens`` while they fit in the bytes their activations took the other way
(``activations``) or keep that share (``none``)."""
ActivationBasis = Literal["identity", "fitted"]
"""What the ``delta`` compression codes each token's change of a row in: the identity (blocks
of coordinates as they are) or a basis fitted to the changes sent (transform coding)."""
SyncMode = Literal["synchronous", "periodic"]
OuterCode = Literal["float64", "int4", "int2", "int1"]
LoraMerge = Literal["auto", "exact", "average"]


def lora_merge_of(
    method: str, merge: str, code: str = "float64", pipelines: int = 2
) -> Literal["exact", "average"]:
    """What `sync.loraMerge` means for a job of `method` whose outer steps send `code`
    among `pipelines` pipelines. `auto` merges `lora` exactly wherever that costs no more
    bytes than averaging: with an outer code (every pipeline gets every pipeline's code
    either way) or between two pipelines; float64 weights among three or more would have to
    be gathered instead of summed. `qlora` and `full` average (`full` has no factors: the
    average is exact). ValueError for `exact` with `qlora`: its 4-bit weights cannot take
    the fold."""
    if merge == "exact" and method == "qlora":
        raise ValueError(
            "exact merges fold into the frozen weights, which qlora keeps in 4 bits; "
            "use average (or auto) with qlora"
        )
    if method != "lora" or merge == "average":
        return "average"
    if merge == "exact" or code != "float64" or pipelines <= 2:
        return "exact"
    return "average"


Dtype = Literal["float32", "bfloat16", "float16"]

Count = Annotated[int, Field(ge=1)]
Name = Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]


class _Part(BaseModel):
    model_config = ConfigDict(
        **CAMEL_CASE, extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )


class JobRef(_Part):
    """Which FineTuneJob this stage belongs to."""

    namespace: Name
    """Kubernetes namespace of the job (also a path element in the checkpoint store)."""
    name: Name
    """Job name (a path element in the checkpoint store and part of the link identities)."""
    uid: str
    """The job object's UID ("" outside Kubernetes). Links need not compare it: each
    incarnation of a job has its own link CA, so they refuse another incarnation's stages."""
    plan_epoch: Annotated[int, Field(ge=0)] = 0
    """Which of the job's plans this stage belongs to: 0 for the first, one more each time
    the operator replaced every stage with a new plan's (a re-split, a job of one pipeline
    grown to several) or stopped them all (suspended, preempted). A stage whose job's
    store names a later plan of the job (names.PLAN_FILE) stops before it writes a
    checkpoint."""


class StageRef(_Part):
    """Where this stage sits in the pipeline."""

    index: Annotated[int, Field(ge=0)]
    """0-based position of this stage."""
    count: Count
    """Number of stages in the pipeline."""
    layer_start: Annotated[int, Field(ge=0)]
    """First global decoder layer this stage holds (inclusive)."""
    layer_end: int
    """Global decoder layer where the next stage starts (exclusive)."""

    @model_validator(mode="after")
    def _in_range(self) -> StageRef:
        if self.index >= self.count:
            raise field_error("index", f"must be below count ({self.count}), got {self.index}")
        if self.layer_end <= self.layer_start:
            raise field_error(
                "layerEnd", f"must be above layerStart ({self.layer_start}), got {self.layer_end}"
            )
        return self

    @property
    def is_first(self) -> bool:
        """Stage 0 reads the data and holds the embedding."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """The last stage holds the final norm and head, and computes the loss."""
        return self.index == self.count - 1


class ModelSpec(_Part):
    """The base model."""

    uri: str
    """Local directory, file:// or s3:// prefix with config.json and safetensors shards."""
    dtype: Dtype
    """Dtype the base weights are held in."""


class ValidationSpec(_Part):
    """The held-out data: its own JSONL file or a share of the training file (exactly one)."""

    uri: str | None = None
    """Local path, file:// or s3:// object of a JSONL file in the dataset's format."""
    fraction: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    """Share of the training file's records held out, chosen by `training.seed`; a held-out
    record is never trained on."""

    @model_validator(mode="after")
    def _one(self) -> ValidationSpec:
        if (self.uri is None) == (self.fraction is None):
            raise field_error("uri", "set exactly one of uri and fraction")
        return self


class DatasetSpec(_Part):
    """The training data (JSONL), read and tokenized by stage 0."""

    uri: str
    """Local path, file:// or s3:// object of a JSONL file."""
    format: DatasetFormat
    """`text`, `prompt-completion` (prompt masked from the loss) or `chat`."""
    text_field: str
    """Field holding the text for format `text`."""
    prompt_field: str
    """Field holding the prompt for format `prompt-completion`."""
    completion_field: str
    """Field holding the completion for format `prompt-completion`."""
    messages_field: str
    """Field holding the list of {role, content} messages for format `chat`."""
    sequence_length: Annotated[int, Field(ge=2)]
    """Tokens per sequence (packed to or padded to this length)."""
    packing: bool
    """Place several whole examples in one sequence instead of padding each one."""
    truncation: Truncation = "truncate"
    """An example longer than `sequenceLength`: `truncate` it to that length or `drop` it
    (optional, default `truncate`; both are counted in progress.json)."""
    validation: ValidationSpec | None = None
    """Held-out data whose loss the pipeline evaluates (optional; absent: none)."""


class MethodSpec(_Part):
    """What is trained."""

    type: MethodType
    """`lora`, `qlora` (4-bit base through bitsandbytes) or `full`."""
    rank: int
    """LoRA rank (ignored by `full`)."""
    alpha: float
    """LoRA alpha (ignored by `full`)."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)]
    """LoRA dropout, in [0, 1) (ignored by `full`)."""
    target_modules: tuple[str, ...]
    """Module names LoRA adapts, e.g. q_proj (ignored by `full`)."""

    @model_validator(mode="after")
    def _adapters(self) -> MethodSpec:
        if self.type != "full":
            if self.rank < 1:
                raise field_error("rank", f"must be >= 1, got {self.rank}")
            if not self.target_modules:
                raise field_error("targetModules", "must name at least one module")
        return self


class TrainingSpec(_Part):
    """Optimisation settings, identical on every stage."""

    steps: Count | None
    """Optimizer steps to run (null when `epochs` is given)."""
    micro_batch_size: Count
    """Sequences per micro-batch."""
    micro_batches: Count
    """Micro-batches per optimizer step (gradient accumulation)."""
    learning_rate: Annotated[float, Field(gt=0.0)]
    """Peak learning rate of AdamW."""
    schedule: LrSchedule
    """Decay after warm-up: `cosine`, `linear` or `constant`."""
    warmup_steps: Annotated[int, Field(ge=0)]
    """Linear warm-up steps from 0 to learningRate."""
    weight_decay: float
    """AdamW weight decay."""
    max_grad_norm: Annotated[float, Field(ge=0.0)]
    """Global gradient-norm clip across all stages; 0 turns clipping off."""
    seed: int
    """Seed of data order, adapter initialisation and dropout."""
    epochs: Count | None = None
    """Passes over the dataset instead of `steps` (optional; exactly one of the two)."""
    eval_every_steps: Annotated[int, Field(ge=0)] = 0
    """Evaluate the held-out loss before step 1 and every N steps (optional; 0: only after
    the last step). Without `dataset.validation` nothing is evaluated."""
    end_of_data: EndOfData = "cycle"
    """When `steps` outrun one pass over the data: `cycle` (another pass, in a new order)
    or `stop` (train on each example once: the run ends after one pass; optional)."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingSpec:
        if (self.steps is None) == (self.epochs is None):
            raise field_error("steps", "set exactly one of steps and epochs")
        return self


class PipelineSpec(_Part):
    """How stages exchange boundary tensors."""

    schedule: PipelineSchedule
    """Only `1f1b` for now."""
    compression: Compression
    """Activation/gradient compression on the links."""
    forwards_ahead: int = 0
    """Forwards every stage but the last runs ahead of 1F1B before its first backward (more
    activations on the link and in memory; the same gradients in the same order)."""
    gradient_tokens: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """The share of tokens whose gradients cross each boundary, drawn in proportion to their
    norms and scaled to stay unbiased (relaytrain_worker.pipeline.sampling); 1: every token."""
    gradient_bits: GradientBits = GRADIENT_BITS
    """With ``delta``: the bits a value of the gradients' code, 1 to 4
    (relaytrain_worker.pipeline.boundary.codec_for)."""
    gradient_fill: GradientFill = "none"
    """With ``delta`` and ``gradient_tokens`` below 1: ``activations`` sends more tokens, up to
    all, while a micro-batch's gradients fit in the bytes its activations took on the link
    (relaytrain_worker.pipeline.sampling.share_within)."""
    activation_error: ActivationError = "int4"
    """With ``delta``: the expected error each row's activation code stays within, that of
    an int4 or an int3 code (relaytrain_worker.pipeline.boundary.codec_for)."""
    activation_basis: ActivationBasis = "identity"
    """With ``delta``: what each token's change is coded in, the identity or a basis fitted
    to the changes this end sent (relaytrain_worker.pipeline.transform)."""


class LinksSpec(_Part):
    """Where this stage listens, whom it connects to, and who each side must prove to be."""

    listen: str | None
    """host:port to accept the previous stage on; null on stage 0."""
    next: str | None
    """host:port of the next stage; null on the last stage."""
    identity: str
    """This stage's link identity (`names.link_identity`): the URI its certificate carries."""
    prev_identity: str | None
    """The identity the previous stage must prove (a listener accepts only it); null on stage 0."""
    next_identity: str | None
    """The identity the next stage must prove (we send only to it); null on the last stage."""
    credentials_dir: str
    """Folder holding this stage's link certificate (`tls.crt`), its key (`tls.key`) and the
    CA certificates it trusts (`ca.crt`): in a pod, the job's link Secret mounted at
    `names.LINK_CREDENTIALS_DIR`. The stage reads it again before each new link, so the
    certificates the operator renews are used without a restart."""
    renewal_grace_seconds: Annotated[float, Field(ge=0)] = 0.0
    """How long a link refused on its certificate chain is tried again, reading the folder
    again each time: a renewal of the job's certificates reaches the two ends of a link
    within this (twice the operator's Secret propagation delay). 0, where nothing renews
    them (`relaytrain run --local`): such a refusal ends the stage at once."""

    @model_validator(mode="after")
    def _pairs(self) -> LinksSpec:
        links = self.model_dump()  # the document's names
        for address, identity in (("listen", "prevIdentity"), ("next", "nextIdentity")):
            if links[address] is None and links[identity] is not None:
                raise field_error(address, f"is null but {identity} is set")
            if links[address] is not None and links[identity] is None:
                raise field_error(identity, f"is null but {address} is set")
        return self


class ReplicaPeer(_Part):
    """A stage of another pipeline that holds some of this stage's layers (the two exchange
    gradients of the layers they share every step)."""

    pipeline: Annotated[int, Field(ge=0)]
    """The peer's pipeline index."""
    stage: Annotated[int, Field(ge=0)]
    """The peer's stage index within its pipeline."""
    layer_start: Annotated[int, Field(ge=0)]
    """First global decoder layer the peer holds (inclusive)."""
    layer_end: int
    """Global decoder layer where the peer's next stage starts (exclusive)."""
    address: str | None
    """host:port of the peer's replica listener, which this stage dials: set exactly when
    the peer's pipeline index is above this stage's (a peer of a lower pipeline dials this
    stage instead, and its address is null)."""
    identity: str
    """The identity the peer must prove (`names.link_identity` of its pipeline and stage)."""

    @model_validator(mode="after")
    def _layers(self) -> ReplicaPeer:
        if self.layer_end <= self.layer_start:
            raise field_error(
                "layerEnd", f"must be above layerStart ({self.layer_start}), got {self.layer_end}"
            )
        if (self.stage == 0) != (self.layer_start == 0):
            raise field_error(
                "layerStart",
                f"must be 0 exactly on a pipeline's stage 0 (stage {self.stage} starts at "
                f"{self.layer_start})",
            )
        return self


def check_sync(mode: SyncMode, every_steps: int | None, outer_code: OuterCode) -> None:
    """The sync settings' cross-field rules, for the job's `spec.pipeline.sync` (the
    operator's spec model, whose CEL rules are their twins) and a stage's document alike:
    `everySteps` set exactly with `periodic`, and an outer code only where there are outer
    steps. Raises a `field_error` naming the field."""
    if (mode == "periodic") != (every_steps is not None):
        raise field_error("everySteps", "must be set exactly when mode is periodic")
    if outer_code != "float64" and mode != "periodic":
        raise field_error("outerCode", f"is {outer_code}, but only periodic sync has outer steps")


class SyncSpec(_Part):
    """How the pipelines keep their weights equal (docs/worker.md, "Periodic
    synchronisation"); the job's `spec.pipeline.sync`."""

    mode: SyncMode = "synchronous"
    """`synchronous`: gradients reduced every step; `periodic`: every pipeline takes local
    steps on its share and the weights are averaged every `everySteps` steps."""
    every_steps: Annotated[int, Field(ge=2)] | None = None
    """Steps between outer steps; set exactly with `periodic`."""
    outer_code: OuterCode = "float64"
    """What an outer step sends: `float64` weights (the exact token-weighted mean) or an
    error-fed low-bit code of each pipeline's update (`int4`, `int2`, `int1`; periodic only;
    docs/worker.md, "Periodic synchronisation")."""
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


class ReplicasSpec(_Part):
    """Several pipelines trained as one job on one global batch (docs/worker.md, "Several
    pipelines"). Absent from the document: this stage's pipeline trains alone."""

    pipeline: Annotated[int, Field(ge=0)]
    """This stage's pipeline index (0-based). The lowest pipeline training a step writes
    checkpoints and progress.json for all (every pipeline holds the same weights): pipeline 0
    unless it is out."""
    shares: tuple[Count, ...]
    """Micro-batches per step of each pipeline, in pipeline order: each pipeline's weight
    when a step's `training.microBatches` are shared among the pipelines training it
    (`relaytrain_worker.replicas.arithmetic.live_shares`). While every pipeline trains and
    they add up to `training.microBatches`, pipeline p trains the p-th contiguous run of a
    step's micro-batches (micro-batches sum(shares[:p]) .. sum(shares[:p+1]) - 1). They add
    up to more when pipelines out of the job keep theirs (a job grown past them)."""
    listen: str | None
    """host:port to accept the peers of lower pipelines on; null on pipeline 0 (it dials
    every peer)."""
    peers: tuple[ReplicaPeer, ...]
    """Every stage of every other pipeline that holds any of this stage's layers (or, on a
    first or last stage, the embedding or the head), in (pipeline, stage) order."""
    sync: SyncSpec = SyncSpec()
    """Synchronous (the default; left out of the document) or periodic averaging."""

    @model_validator(mode="after")
    def _consistent(self) -> ReplicasSpec:
        count = len(self.shares)
        if count < 2:
            raise field_error(
                "shares", f"must list at least two pipelines (one pipeline has no replicas "
                f"section), got {list(self.shares)}"
            )  # fmt: skip
        if self.pipeline >= count:
            raise field_error(
                "pipeline", f"must be below the number of shares ({count}), got {self.pipeline}"
            )
        if (self.pipeline == 0) != (self.listen is None):
            raise field_error("listen", "must be null on pipeline 0 and set on the others")
        keys = [(p.pipeline, p.stage) for p in self.peers]
        if keys != sorted(set(keys)):
            raise field_error("peers", "must be listed once each, in (pipeline, stage) order")
        for peer in self.peers:
            if peer.pipeline == self.pipeline or peer.pipeline >= count:
                raise field_error(
                    "peers",
                    f"a peer's pipeline must be another of the {count} pipelines, got "
                    f"{peer.pipeline} (this stage's is {self.pipeline})",
                )
            if (peer.pipeline > self.pipeline) != (peer.address is not None):
                raise field_error(
                    "peers",
                    f"the address of p{peer.pipeline}/s{peer.stage} must be set exactly when its "
                    f"pipeline is above this stage's ({self.pipeline}): this stage dials those",
                )
        return self

    def peers_of(self, pipeline: int) -> list[ReplicaPeer]:
        """The peers of `pipeline`, in stage order."""
        return [p for p in self.peers if p.pipeline == pipeline]


class CheckpointSpec(_Part):
    """The job's object store: checkpoints, progress.json, and s3:// model, data and output."""

    uri: str
    """s3://bucket/prefix or a local directory."""
    endpoint: str | None
    """S3 endpoint URL (`http://minio:9000`); null means AWS S3 for an s3:// uri (and
    nothing for a local directory)."""
    access_key_env: str | None
    """Environment variable with the S3 access key; null: AWS's standard credential chain
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, then the pod's IAM role)."""
    secret_key_env: str | None
    """Environment variable with the S3 secret key; null exactly when accessKeyEnv is."""
    every_steps: Count
    """Commit a checkpoint every N optimizer steps (and always after the last)."""
    keep: Count
    """Committed checkpoints to keep."""

    @model_validator(mode="after")
    def _key_pair(self) -> CheckpointSpec:
        if self.access_key_env is None and self.secret_key_env is not None:
            raise field_error("accessKeyEnv", "is null but secretKeyEnv is set")
        if self.secret_key_env is None and self.access_key_env is not None:
            raise field_error("secretKeyEnv", "is null but accessKeyEnv is set")
        return self


class OutputSpec(_Part):
    """Where the finished adapter (or full weights) goes."""

    uri: str
    """s3://bucket/prefix or a local directory."""


class ObservabilitySpec(_Part):
    """Per-stage HTTP endpoints."""

    port: Annotated[int, Field(ge=0, le=65535)]
    """Port of /metrics and /healthz; 0 picks a free one (local runs)."""


class StageConfig(_Part):
    """Everything one stage process needs; see docs/stage-contract.md."""

    api_version: str
    """Must be relaytrain.io/v1alpha1 (names.API_VERSION)."""
    kind: str
    """Must be StageConfig (names.STAGE_CONFIG_KIND)."""
    job: JobRef
    """The job this stage belongs to."""
    stage: StageRef
    """This stage's place and layers."""
    model: ModelSpec
    """The base model."""
    dataset: DatasetSpec
    """The training data."""
    method: MethodSpec
    """LoRA, QLoRA or full."""
    training: TrainingSpec
    """Optimisation settings."""
    pipeline: PipelineSpec
    """Schedule and link compression."""
    links: LinksSpec
    """Addresses and identities of the links."""
    checkpoint: CheckpointSpec
    """The job's object store and checkpoint cadence."""
    output: OutputSpec
    """Where the result goes."""
    observability: ObservabilitySpec
    """/metrics and /healthz."""
    replicas: ReplicasSpec | None = None
    """The other pipelines of the job (optional; absent: this pipeline trains alone)."""

    @model_validator(mode="after")
    def _ends(self) -> StageConfig:
        ends = (
            ("apiVersion", self.api_version, API_VERSION),
            ("kind", self.kind, STAGE_CONFIG_KIND),
        )
        for key, got, want in ends:
            if got != want:
                raise field_error(key, f"expected {want!r}, got {got!r}")
        if self.stage.is_first != (self.links.listen is None):
            raise field_error("links.listen", "must be null on stage 0 and set on the others")
        if self.stage.is_last != (self.links.next is None):
            raise field_error("links.next", "must be null on the last stage and set on the others")
        if self.replicas is not None:
            self._check_replicas(self.replicas)
        return self

    def _check_replicas(self, replicas: ReplicasSpec) -> None:
        """The shares fill the step (more, with pipelines out keeping theirs); every other
        pipeline's peers cover this stage's layers with contiguous stages."""
        try:
            lora_merge_of(self.method.type, replicas.sync.lora_merge)
        except ValueError as exc:
            raise field_error("replicas.sync.loraMerge", f"{exc}, got exact") from None
        total = sum(replicas.shares)
        if total < self.training.micro_batches:
            raise field_error(
                "replicas.shares",
                f"must add up to at least training.microBatches "
                f"({self.training.micro_batches}), got {list(replicas.shares)} (sum {total})",
            )
        start, end = self.stage.layer_start, self.stage.layer_end
        for q in range(len(replicas.shares)):
            if q == replicas.pipeline:
                continue
            peers = replicas.peers_of(q)
            where = f"pipeline {q}'s stages"
            if not peers:
                raise field_error(
                    "replicas.peers", f"lists none of {where}; some hold layers {start}-{end - 1}"
                )
            for a, b in itertools.pairwise(peers):
                if b.stage != a.stage + 1 or b.layer_start != a.layer_end:
                    raise field_error(
                        "replicas.peers",
                        f"{where} must be consecutive and contiguous: stage {a.stage} ends at "
                        f"layer {a.layer_end}, stage {b.stage} starts at {b.layer_start}",
                    )
            first, last = peers[0], peers[-1]
            if not (first.layer_start <= start < first.layer_end) or not (
                last.layer_start < end <= last.layer_end
            ):
                raise field_error(
                    "replicas.peers",
                    f"{where} listed hold layers {first.layer_start}-{last.layer_end - 1}; they "
                    f"must be exactly those holding this stage's layers {start}-{end - 1}",
                )

    @classmethod
    def from_json(cls, document: str | bytes | dict[str, Any]) -> StageConfig:
        """Parse and validate a stage document (JSON text, or a dict as parsed from it).

        Raises ConfigError naming the field path of every problem.
        """
        return parse_json(cls, document, "stage config")

    def to_dict(self) -> dict[str, Any]:
        """The document as JSON-ready data; an unset `training.epochs`, the default
        `evalEverySteps` and `endOfData`, the first plan's `job.planEpoch` and an absent
        `replicas` are left out, so a steps-based, one-pipeline document carries no field an
        older worker might not know."""
        document = self.model_dump(mode="json")
        if document["job"]["planEpoch"] == 0:
            del document["job"]["planEpoch"]
        if document["training"]["epochs"] is None:
            del document["training"]["epochs"]
        if document["training"]["evalEverySteps"] == 0:
            del document["training"]["evalEverySteps"]
        if document["training"]["endOfData"] == "cycle":
            del document["training"]["endOfData"]
        if document["dataset"]["validation"] is None:
            del document["dataset"]["validation"]
        if document["replicas"] is None:
            del document["replicas"]
        elif document["replicas"]["sync"]["mode"] == "synchronous":
            del document["replicas"]["sync"]
        return document
