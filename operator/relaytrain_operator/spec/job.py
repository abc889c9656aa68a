"""The FineTuneJob API as pydantic models: a manifest, its spec, and `parse_job`.

These models define the API once. The CRD (crds/finetunejobs.relaytrain.io.yaml) is
generated from them (spec.crd, `make crds`): field names, types, bounds, patterns, enums,
defaults and descriptions from the annotations and docstrings; the CEL rules the API server
adds, written here beside the validators that are their pydantic twins (spec.openapi). The
models enforce the same rules for code that never meets an API server (`relaytrain run
--local`, `relaytrain plan`) and give the operator typed access.

Field names are snake_case in Python and camelCase in manifests (aliases). Unknown fields
are errors, and types are strict (no "3" for 3), as the API server's structural schema is.
The enumerations that reach the stages (dtype, formats, methods, schedules, compression)
are the stage contract's (relaytrain_contract).
The sections of the spec live in relaytrain_operator.spec.sections (pipeline.py and
placement.py hold two of them), the status shape in relaytrain_operator.spec.status.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from relaytrain_contract.stage import lora_merge_of

from relaytrain_operator.spec import patterns
from relaytrain_operator.spec.errors import SpecError, field_error, format_errors
from relaytrain_operator.spec.openapi import Rule, cel, fixed_once_started
from relaytrain_operator.spec.patterns import JOB_NAME_MAX
from relaytrain_operator.spec.pipeline import PipelineSpec
from relaytrain_operator.spec.placement import PlacementSpec
from relaytrain_operator.spec.sections import (
    CheckpointSpec,
    DatasetSpec,
    FailurePolicy,
    LinkCertificatesSpec,
    MethodSpec,
    ModelSpec,
    OutputSpec,
    SpecModel,
    TrainingSpec,
)

__all__ = [
    "API_VERSION",
    "KIND",
    "FineTuneJob",
    "FineTuneJobSpec",
    "SpecError",
    "parse_job",
]

API_VERSION = "relaytrain.io/v1alpha1"
KIND = "FineTuneJob"


class FineTuneJobSpec(SpecModel):
    """The desired fine-tuning run."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!has(self.pipeline) || !has(self.pipeline.replicas) || "
                "type(self.pipeline.replicas) == string || !has(self.training.microBatches) || "
                "self.pipeline.replicas <= self.training.microBatches",
                "spec.pipeline.replicas must not exceed spec.training.microBatches: every "
                "pipeline trains at least one micro-batch of each step.",
                field=".pipeline.replicas",
            ),
            Rule(
                "!has(self.method) || !has(self.method.type) || self.method.type != 'qlora' || "
                "!has(self.pipeline) || !has(self.pipeline.sync) || "
                "!has(self.pipeline.sync.loraMerge) || self.pipeline.sync.loraMerge != 'exact'",
                "spec.pipeline.sync.loraMerge exact folds into the frozen weights, which "
                "qlora keeps in 4 bits: use average or auto with spec.method.type qlora.",
                field=".pipeline.sync.loraMerge",
            ),
            Rule(
                "!has(self.training.evalEverySteps) || self.training.evalEverySteps == 0 || "
                "has(self.dataset.validation)",
                "spec.training.evalEverySteps evaluates held-out data: set "
                "spec.dataset.validation too.",
                field=".training.evalEverySteps",
            ),
        )
    )

    model: Annotated[ModelSpec, Field(json_schema_extra=fixed_once_started())]
    """The base model."""
    dataset: Annotated[DatasetSpec, Field(json_schema_extra=fixed_once_started())]
    """The training data, JSON Lines with one example per line."""
    method: Annotated[MethodSpec, Field(json_schema_extra=fixed_once_started())] = Field(
        default_factory=MethodSpec
    )
    """What trains: low-rank adapters (lora, qlora) or every weight (full)."""
    training: Annotated[TrainingSpec, Field(json_schema_extra=fixed_once_started())]
    """How long and how fast to train. Set exactly one of steps and epochs."""
    pipeline: Annotated[PipelineSpec, Field(json_schema_extra=fixed_once_started())] = Field(
        default_factory=PipelineSpec
    )
    """How the model is split into stages and what crosses the links between them."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """Which nodes may run the stages."""
    checkpoint: CheckpointSpec
    """Where and how often the stages save what recovery needs."""
    output: OutputSpec | None = None
    """Where the result goes; empty means `<checkpoint.uri>/<namespace>/<job>/output/`."""
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    """When a failing stage fails the job."""
    link_certificates: LinkCertificatesSpec = Field(default_factory=LinkCertificatesSpec)
    """How long the links' certificates are valid and when they are renewed."""
    suspend: bool = False
    """True removes the stage pods and keeps the job (queueing systems such as Kueue hold jobs
    this way); false again resumes from the last checkpoint."""
    image: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    """Worker image for the stage pods; empty uses the operator's default. A stage created
    while others run (a stage replaced alone, a pipeline added) runs the image they run,
    whose link protocol it must speak: a change here, or of the operator's default, reaches
    a running job's stages when every one is replaced at once (a re-split, or spec.suspend
    set and unset)."""

    @model_validator(mode="after")
    def _a_share_per_pipeline(self) -> FineTuneJobSpec:
        replicas, micro = self.pipeline.replicas, self.training.micro_batches
        if replicas != "auto" and replicas > micro:
            raise field_error(
                "pipeline.replicas",
                f"must not exceed training.microBatches ({micro}): every pipeline trains at "
                f"least one micro-batch of each step, got {replicas}",
            )
        return self

    @model_validator(mode="after")
    def _a_merge_that_fits(self) -> FineTuneJobSpec:
        try:
            lora_merge_of(self.method.type, self.pipeline.sync.lora_merge)
        except ValueError as exc:
            raise field_error("pipeline.sync.loraMerge", f"{exc}, got exact") from None
        return self

    @model_validator(mode="after")
    def _eval_needs_validation(self) -> FineTuneJobSpec:
        every = self.training.eval_every_steps
        if every and self.dataset.validation is None:
            raise field_error(
                "training.evalEverySteps",
                f"evaluates held-out data, but spec.dataset.validation is not set, got {every}",
            )
        return self


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads; the API server owns the rest."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Annotated[str, Field(pattern=patterns.JOB_NAME, max_length=JOB_NAME_MAX)]
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None


class FineTuneJob(SpecModel):
    """FineTuneJob fine-tunes a language model across a pipeline of GPU stages, each holding
    a contiguous slice of the model's layers, on whatever GPU pools the cluster has. The
    operator plans the stages, runs one pod per stage, and replaces a failed stage alone from
    the last committed checkpoint."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                f"self.metadata.name.matches('{patterns.JOB_NAME}') && "
                f"size(self.metadata.name) <= {JOB_NAME_MAX}",
                f"metadata.name must be a DNS-1035 label of at most {JOB_NAME_MAX} characters "
                "(lowercase letters, digits and '-', starting with a letter): it names the "
                "job's Service and prefixes its stage pods' hostnames.",
            )
        )
    )

    api_version: Literal["relaytrain.io/v1alpha1"]
    """relaytrain.io/v1alpha1."""
    kind: Literal["FineTuneJob"]
    """FineTuneJob."""
    metadata: ObjectMeta
    """Name, namespace, uid and generation."""
    spec: FineTuneJobSpec
    """The desired fine-tuning run."""


def parse_job(
    manifest: dict[str, Any], *, default_checkpoint_uri: str | None = None
) -> FineTuneJob:
    """Validate a FineTuneJob manifest (as from YAML or the API server).

    `status` and metadata the operator does not need are ignored. Raises SpecError naming
    each bad field by path (`spec.method.rank`) and what would be valid.
    `default_checkpoint_uri` fills a missing spec.checkpoint (for `relaytrain run --local`,
    whose default store is a local directory; the CRD requires one).
    """
    if not isinstance(manifest, dict):
        raise SpecError([("", f"a FineTuneJob must be a mapping, got {type(manifest).__name__}")])
    body = {key: value for key, value in manifest.items() if key != "status"}
    spec = body.get("spec")
    if default_checkpoint_uri is not None and isinstance(spec, dict) and "checkpoint" not in spec:
        body["spec"] = {**spec, "checkpoint": {"uri": default_checkpoint_uri}}
    try:
        return FineTuneJob.model_validate(body)
    except ValidationError as exc:
        raise SpecError(format_errors(exc, FineTuneJob)) from None
