"""The FineTuneJob status: what the operator writes and `kubectl get ftj`, Flux and Argo read.

The CRD's status schema is generated from these models (spec.crd), so every field is
declared there (the API server prunes anything undeclared). The operator builds a
FineTuneJobStatus and patches `status_patch(...)`; it never writes free-form dicts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from relaytrain_contract.camel import CAMEL_CASE

from relaytrain_operator.spec.openapi import Int64, Timestamp, list_type

__all__ = [
    "PHASES",
    "Condition",
    "FineTuneJobStatus",
    "LinkCertificatesStatus",
    "OutputStatus",
    "Phase",
    "PipelineStatus",
    "PlanBottleneck",
    "PlanPipeline",
    "PlanStatus",
    "PlannedStage",
    "ProgressStatus",
    "StageStatus",
    "status_patch",
]

Phase = Literal["Pending", "Planning", "Running", "Recovering", "Succeeded", "Failed", "Suspended"]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]


class _Status(BaseModel):
    model_config = ConfigDict(**CAMEL_CASE, extra="forbid", use_attribute_docstrings=True)


class Condition(_Status):
    """A Kubernetes-style condition (the shape of metav1.Condition)."""

    type: str
    """`Ready` (every stage pod ready and training progressing, or Succeeded), `Progressing`
    (the operator is moving the job forward: planning, starting, recovering), kstatus's
    `Reconciling` and `Stalled`, or `Degraded` (several pipelines: one is out)."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str
    """One CamelCase word: e.g. Planned, Unschedulable, StageRestarting, Suspended, Succeeded,
    BackoffLimitExceeded, InvalidSpec, InvalidInput (a stage's own word, quoted in the
    message)."""
    message: str = ""
    """What happened, for people."""
    last_transition_time: Timestamp
    """When status last changed (RFC 3339)."""
    observed_generation: Int64 | None = None
    """The metadata.generation this condition was computed for."""


class PlannedStage(_Status):
    """One stage of the plan."""

    index: int
    """Stage number, 0 first."""
    pool: str
    """Pool (value of the placement gpuLabel) that runs this stage."""
    layer_start: int
    """First decoder layer (inclusive)."""
    layer_end: int
    """Last decoder layer (exclusive)."""
    predicted_step_seconds: float | None = None
    """Predicted time of this stage per optimizer step (compute plus its outgoing link)."""
    predicted_memory_bytes: Int64 | None = None
    """Predicted peak GPU memory of this stage."""
    available_memory_bytes: Int64 | None = None
    """GPU memory the pool's GPUs have."""


class PlanBottleneck(_Status):
    """What limits the step time."""

    stage: int
    """The stage that is slowest."""
    resource: Literal["compute", "memory", "link"]
    """What limits it."""


class PlanPipeline(_Status):
    """One of several pipelines of the plan (its own GPUs and layer split)."""

    index: int
    """Pipeline number, 0 first."""
    micro_batches: int
    """This pipeline's share of each step's micro-batches."""
    stages: Annotated[list[PlannedStage], Field(json_schema_extra=list_type("map", "index"))] = (
        Field(default_factory=list)
    )
    """Its stages in pipeline order."""
    predicted_step_seconds: float | None = None
    """Predicted time of its share of a step (1F1B, bubble included)."""
    predicted_tokens_per_second: float | None = None
    """Predicted throughput of this pipeline alone."""
    bubble_fraction: float | None = None
    """Predicted share of time its stages wait in the fill and drain."""
    bottleneck: PlanBottleneck | None = None
    """The stage and resource that limit this pipeline."""


class FormerPlan(_Status):
    """The plan of a job of one pipeline before a re-split onto fewer or other GPUs."""

    split: str
    """Its stages' pools and decoder layers, e.g. `h100[0:16) → a100[16:32)`."""
    stages: int
    """How many stages it had (a re-split back has at most as many: the link certificates
    were minted for them)."""
    predicted_tokens_per_second: float | None = None
    """What the planner predicted for it."""


class PlanStatus(_Status):
    """The planner's result for this job."""

    stages: Annotated[list[PlannedStage], Field(json_schema_extra=list_type("map", "index"))] = (
        Field(default_factory=list)
    )
    """Stages in pipeline order (a job with one pipeline; see `pipelines` otherwise)."""
    pipelines: (
        Annotated[list[PlanPipeline], Field(json_schema_extra=list_type("map", "index"))] | None
    ) = None
    """The pipelines of a job that trains several, each with its stages and share (unset
    while the job has one: its stages are `stages`)."""
    predicted_sync_seconds: float | None = None
    """Predicted time per step of keeping the pipelines' weights equal (several only)."""
    predicted_step_seconds: float | None = None
    """Predicted time per optimizer step."""
    predicted_tokens_per_second: float | None = None
    """Predicted training throughput."""
    bubble_fraction: float | None = None
    """Predicted share of time stages wait in the pipeline's fill and drain."""
    bottleneck: PlanBottleneck | None = None
    """The stage and resource that limit throughput."""
    compression: str | None = None
    """The boundary code the stages use, the planner's choice under `compression: auto`."""
    forwards_ahead: int | None = None
    """The forwards each stage runs ahead of 1F1B, the planner's choice under
    `forwardsAhead: auto`."""
    resplit_from: FormerPlan | None = None
    """Set while a job of one pipeline trains on a re-split (a replacement found no GPU
    where its stage was): the plan it had before. While set, the operator re-plans the job
    as GPUs free up and re-splits it back where that pays (docs/operator.md, "A replacement
    that cannot fit"); cleared once it trains at least as fast as that plan predicted."""

    def splits(self) -> list[list[PlannedStage]]:
        """Every pipeline's stages, in pipeline order (`[stages]` for one pipeline)."""
        return [p.stages for p in self.pipelines] if self.pipelines else [self.stages]

    def several(self) -> bool:
        """Whether the job trains several pipelines."""
        return bool(self.pipelines)


class StageStatus(_Status):
    """One stage's pod as the operator last saw it."""

    index: int
    """Stage number (within its pipeline)."""
    pipeline: int | None = None
    """Pipeline number, when the job trains several."""
    pod: str | None = None
    """Name of the stage's current pod."""
    node: str | None = None
    """Node the pod runs on."""
    pool: str | None = None
    """Pool of that node."""
    phase: str | None = None
    """The pod's phase (Pending, Running, Succeeded, Failed) or Replacing."""
    ready: bool = False
    """Whether the pod is ready."""
    restarts: int = 0
    """How many times this stage's pod was replaced."""
    restored_from_step: int | None = None
    """Checkpoint step the current pod restored from."""
    last_failure: str | None = None
    """Why the previous pod of this stage ended."""
    last_failure_time: Timestamp | None = None
    """When that failure was counted (RFC 3339): the successor's back-off runs from it."""


class PipelineStatus(_Status):
    """One pipeline of a job that trains several."""

    index: int
    """Pipeline number."""
    phase: Literal["Pending", "Running", "Recovering", "Succeeded", "Failed", "Left"]
    """Running: every stage pod runs; Recovering: a stage is being replaced (the other
    pipelines train on); Failed: a stage used up spec.failurePolicy.maxStageRestarts, so the
    pipeline was given up and the others train on without it (it is tried again after
    spec.failurePolicy.returnAfterSeconds); Left: a node of its stages announced its end (a
    cordon, a drain, a spot-termination or scale-down taint), so its pods were removed
    without counting a failure (it comes back where its stages fit on free GPUs);
    Succeeded: its stages finished; Pending: starting."""
    ready_stages: str
    """`ready/total` stage pods of this pipeline."""
    restarts: int = 0
    """Stage pod replacements in this pipeline."""
    micro_batches: int
    """Its planned share of each step's micro-batches."""
    added_at_step: int | None = None
    """The job's last finished step when the operator added this pipeline, one the plan did
    not have, on GPUs that joined (it joins at the next step boundary); unset for the
    plan's own."""
    left_at_step: int | None = None
    """The job's last finished step when the pipeline last left (given up or removed)."""
    left_time: Timestamp | None = None
    """When it last left (RFC 3339): a return is timed from it."""
    left_reason: str | None = None
    """Why it last left."""
    returns: int = 0
    """How many times it came back after leaving."""
    returned_at_step: int | None = None
    """The job's last finished step when it last came back (it rejoins at the next step
    boundary)."""
    held_out: str | None = None
    """Why it stays out although its stages fit on free GPUs: its return would not raise
    the job's predicted tokens/s by 5 % (the predictions before and after)."""
    retired: bool = False
    """Out for good, its Workload given back (Kueue, one Workload per pipeline): its stage's
    replacement waited for a GPU as long as a re-split costs, so a pipeline shaped for the
    GPUs free is asked of Kueue in its place (a new index, its own Workload)."""


class ProgressStatus(_Status):
    """Training progress, from the workers' progress record."""

    step: int = 0
    """Last finished optimizer step."""
    total_steps: int | None = None
    """Steps the job will run."""
    step_of_total: str | None = None
    """`step/totalSteps`, for the printer column."""
    loss: float | None = None
    """Training loss at the last step."""
    tokens_per_second: float | None = None
    """Measured throughput."""
    last_committed_step: int | None = None
    """Newest committed checkpoint step."""
    eta: Timestamp | None = None
    """Estimated finish time (RFC 3339)."""
    updated_at: Timestamp | None = None
    """When the workers last reported (RFC 3339)."""
    examples: int | None = None
    """Training examples the data set gave, after truncation or dropping."""
    examples_truncated: int | None = None
    """Examples cut to dataset.sequenceLength (dataset.truncation: truncate)."""
    examples_dropped: int | None = None
    """Examples left out for being longer than dataset.sequenceLength (truncation: drop)."""
    epoch: float | None = None
    """Passes over the training rows made so far (1.5: halfway through the second)."""
    examples_seen: int | None = None
    """Examples trained on so far, each counted again in every pass."""
    tokens_seen: int | None = None
    """Non-padding input tokens trained on so far."""
    tokens_trained: int | None = None
    """Of those, the tokens that had a loss (the completions, the assistant turns)."""
    eval_loss: float | None = None
    """Token-mean loss on the held-out data (dataset.validation) at evalStep."""
    eval_step: int | None = None
    """Optimizer steps finished when evalLoss was evaluated (0: the base model)."""


class LinkCertificatesStatus(_Status):
    """The links' certificates, as the job's link Secret holds them."""

    generation: int
    """Renewals so far (0: the certificates minted at the start)."""
    phase: Literal["Current", "Trusting", "Switching"]
    """Where a renewal stands: none under way, the next CA trusted, the next certificates in
    use (docs/operator.md)."""
    not_after: Timestamp
    """When the certificates the stages use expire (RFC 3339)."""
    next_step_at: Timestamp
    """When the operator next changes them: the next renewal, or its next phase."""


class OutputStatus(_Status):
    """Where the result is."""

    uri: str
    """The adapter (PEFT format) or full weights."""


class GrowthStatus(_Status):
    """Why a running job of `replicas: auto` adds no pipeline on the GPUs free for it."""

    free_gpus: str
    """The free GPUs it priced, by pool (`a100 x2, h100 x1`)."""
    reason: str
    """The planner's verdict: the rise of predicted tokens/s against the 5 % margin, or the
    time saved over the steps left against what a join costs."""


class FineTuneJobStatus(_Status):
    """The observed state, written by the operator."""

    phase: Phase = "Pending"
    """Pending, Planning, Running, Recovering, Succeeded, Failed or Suspended."""
    observed_generation: Int64 | None = None
    """The metadata.generation the operator last acted on."""
    conditions: Annotated[list[Condition], Field(json_schema_extra=list_type("map", "type"))] = (
        Field(default_factory=list)
    )
    """Ready, Progressing, kstatus's Reconciling and Stalled, and (several pipelines)
    Degraded, with reasons such as Unschedulable or StageRestarting."""
    start_time: Timestamp | None = None
    """When the first stage pod was created (RFC 3339); from then on model, dataset, method,
    pipeline, training and checkpoint.uri may no longer change."""
    completion_time: Timestamp | None = None
    """When the job Succeeded or Failed (RFC 3339)."""
    plan: PlanStatus | None = None
    """The stage plan the operator runs."""
    plan_epoch: int | None = None
    """How many times every stage of the job was replaced by a new plan's (a re-split or one
    back, a job of one pipeline grown to several) or stopped (the job suspended, or
    preempted by Kueue); unset: never. The stages' documents
    carry it (`job.planEpoch`) and the job's store names it (`plan.json`), so that a stage of
    an older plan still running — on a node cut off, or outliving its pod — stops before it
    writes a checkpoint."""
    stages: Annotated[list[StageStatus], Field(json_schema_extra=list_type("atomic"))] = Field(
        default_factory=list
    )
    """Each stage's pod as the operator last saw it."""
    ready_stages: str | None = None
    """`ready/total` stage pods, for the printer column."""
    pipelines: (
        Annotated[list[PipelineStatus], Field(json_schema_extra=list_type("map", "index"))] | None
    ) = None
    """Per pipeline, when the job trains several (unset while it has one)."""
    ready_pipelines: str | None = None
    """`running/total` pipelines, for the printer column (several pipelines only)."""
    restarts: int = 0
    """Stage pod replacements, all stages together."""
    progress: ProgressStatus | None = None
    """Training progress, from the workers' progress record."""
    output: OutputStatus | None = None
    """Where the result is, once the job Succeeded."""
    link_certificates: LinkCertificatesStatus | None = None
    """The links' certificates: when they expire and when they are renewed."""
    growth: GrowthStatus | None = None
    """GPUs free for a job of `spec.pipeline.replicas: auto` that it does not use, and why
    (unset while there are none, or once it grew on them)."""


def status_patch(status: FineTuneJobStatus) -> dict[str, object]:
    """The status as a JSON-ready dict in manifest terms (camelCase, unset fields dropped)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
