"""What a decision reads and returns, and the context one pass accumulates its work in.

`Observed` is what a pass saw of the cluster, `Settings` the operator's settings it depends
on, `Needs` which costly inputs it asks the observer for, and `Decision` what it returns.
`Pass` holds one pass's actions and the job's status as decided so far; the concerns of a
pass (admission.py, stages.py, create.py, progress.py) are plain functions over it, and its
own methods are what they all share: update and write status, post Events, remove pods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from relaytrain_operator.domain.builders.labels import PIPELINE_LABEL, STAGE_LABEL, StageKey
from relaytrain_operator.domain.planner import Catalog
from relaytrain_operator.domain.planner.growth import JOIN_SECONDS
from relaytrain_operator.domain.planning import training_shape
from relaytrain_operator.domain.progress import Progress
from relaytrain_operator.domain.queueing import Admission, queue_name
from relaytrain_operator.domain.recovery import STUCK_REASONS
from relaytrain_operator.domain.status import (
    OUT_PHASES,
    READY,
    WORKER_REASONS,
    Verdict,
    condition,
    finalize,
    load_status,
    with_verdict,
)
from relaytrain_operator.loop.actions import Action, DeletePod, PatchStatus, PostEvent
from relaytrain_operator.spec import (
    FineTuneJob,
    FineTuneJobStatus,
    PlanStatus,
    SpecError,
    parse_job,
)

JsonDict = dict[str, Any]
MIB = 1024 * 1024
DEFAULT_MEMORY_BYTES = 4 * 1024 * MIB
WAITING_ANNOTATION = "relaytrain.io/waiting"
"""On a replacement pod created while no eligible node had a free GPU: why. It waits on
its own pool; while it is unscheduled the job's condition says so (Unschedulable)."""
# Reasons whose condition change is worth an Event (a user should notice these).
EVENT_REASONS = {
    "InvalidSpec": "Warning",
    "Unschedulable": "Warning",
    "ModelUnavailable": "Warning",
    "DatasetUnavailable": "Warning",
    "CredentialsUnavailable": "Warning",
    "BackoffLimitExceeded": "Warning",
    "Suspended": "Normal",
    "FleetGone": "Warning",
    "Succeeded": "Normal",
    "Queued": "Normal",
    "WaitingForQuota": "Normal",
    "Evicted": "Warning",
    "Inadmissible": "Warning",
    "KueueNotInstalled": "Warning",
    **dict.fromkeys(WORKER_REASONS, "Warning"),
    **dict.fromkeys(set(STUCK_REASONS.values()), "Warning"),
}
QUEUE_REASONS = ("Queued", "WaitingForQuota", "Inadmissible", "Evicted", "KueueNotInstalled")
"""Why a job submitted to Kueue has no pods (docs/operator.md, "Queueing with Kueue")."""


@dataclass(frozen=True)
class Settings:
    """The operator's settings that decisions depend on."""

    node_lost_seconds: float = 60.0
    """How long a node may be NotReady before its stages are replaced."""
    worker_image: str = "ghcr.io/relaytrain/worker:0.1.0"
    """Image of jobs without spec.image."""
    worker_device: str = "cuda"
    """Where stage pods compute (relaytrain_contract.DEVICE_ENV): `cuda`, `cpu` or `auto`."""
    default_link: tuple[float, float] | None = None
    """(Mbps, ms) assumed for GPU nodes without link annotations."""
    catalog: Catalog | None = None
    """The GPU catalog (None: the built-in one)."""
    secret_propagation_seconds: float = 90.0
    """How long a changed Secret may take to reach the pods that mount it (the kubelet's
    sync period and cache): the phases of a link certificate renewal are this far apart."""
    join_seconds: float = JOIN_SECONDS
    """What (re)starting a pipeline's stages costs before they add a step: a return's price
    (domain/membership.py) and how long a replacement waits before a re-split
    (domain/resplit.py)."""


@dataclass(frozen=True)
class ModelConfig:
    """The base model's config.json, or why it could not be read."""

    config: JsonDict | None = None
    """The config (None when it could not be read)."""
    error: str = ""
    """Why it could not be read."""


@dataclass(frozen=True)
class InputProblem:
    """Why a job cannot start as written, found before any pod exists."""

    reason: str
    """The condition's reason: CredentialsUnavailable or DatasetUnavailable."""
    message: str
    """What is wrong, naming the field."""


@dataclass(frozen=True)
class Observed:
    """What one pass saw of the cluster."""

    job: JsonDict | None
    """The job as stored now, status included (None: it is gone)."""
    now: datetime
    """The time of the pass."""
    pods: Mapping[StageKey, JsonDict] = field(default_factory=dict)
    """The job's stage pods by (pipeline, stage), terminating ones included."""
    nodes: Mapping[str, JsonDict] = field(default_factory=dict)
    """Nodes by name: at least those of the stage pods (a pod's node missing here is gone);
    every node when `cluster_pods` is observed."""
    cluster_pods: Sequence[JsonDict] | None = None
    """Active pods of the whole cluster (what holds GPUs); read when `needs().room`."""
    model: ModelConfig | None = None
    """The model's config.json; read when `needs().model`."""
    inputs: InputProblem | None = None
    """What the operator can tell is wrong with the job's inputs before any pod exists (its
    Secret, the store's answer to its keys, the data set); read with `model`."""
    progress: Progress | None = None
    """The workers' progress.json, folded (None: none yet, unreadable, or not read)."""
    workloads: Mapping[int, JsonDict] = field(default_factory=dict)
    """The job's Kueue Workloads by pipeline (the job's one Workload under 0: admission.py,
    `per_pipeline`); one missing here is not created yet."""
    workloads_per_pipeline: bool | None = None
    """Whether the Workloads the job has are one per pipeline (`queueing.by_pipeline`);
    None when it has none, or they were not read."""
    kueue_missing: bool = False
    """Whether the cluster answered that it serves no Workloads (Kueue is not installed),
    when they were read."""
    flavors: Mapping[str, JsonDict] = field(default_factory=dict)
    """The ResourceFlavors Kueue assigned, by name; read when stage pods are to be created."""
    priority: int | None = None
    """The value of the WorkloadPriorityClass the job's label names (None: no label, or no
    such class); read while the job has no Workload yet."""
    told_given_up: tuple[int, ...] | None = None
    """The pipelines the job's store says are given up (names.GIVEN_UP_FILE, what the
    operator wrote for the stages); None when not read, absent or unreadable."""
    link_secret: JsonDict | None = None
    """The job's link Secret as stored; read when `needs().link_secret` (None: not read, or
    there is none)."""


@dataclass(frozen=True)
class Needs:
    """Which costly inputs a pass needs (the rest of `Observed` is always read)."""

    pods: bool = False
    """Confirm the stage pods with the API server: a planned stage has none in the index."""
    room: bool = False
    """Every node and the cluster's active pods (a plan or a pod to create); passes that
    need them are serialised, so no two place onto one free GPU."""
    model: bool = False
    """The model's config.json (the first plan; a running job of several pipelines, whose
    departures and returns it prices). Read once a job and kept."""
    inputs: bool = False
    """What is wrong with the job's inputs that the operator can see (its Secret, the
    store's answer, the data set): before the first plan, every pass, never kept."""
    progress: bool = False
    """progress.json (a started job whose store is s3://)."""
    workload: bool = False
    """The job's Kueue Workloads (a job submitted to a LocalQueue), and when `room` too the
    flavours they were admitted with."""
    given_up: bool = False
    """What the store tells the stages of given-up pipelines (a started job on s3:// with a
    pipeline given up)."""
    link_secret: bool = False
    """The job's link Secret (a started job whose certificates are due for a change, or
    whose status does not say yet when they are)."""


@dataclass(frozen=True)
class Decision:
    """What one pass decided."""

    actions: tuple[Action, ...] = ()
    """In the order they must be applied."""
    status: FineTuneJobStatus | None = None
    """The job's status after the pass (None: the job is gone)."""
    restarts: int = 0
    """Stage failures counted in this pass (for the metrics)."""
    retry_after: float | None = None
    """Seconds after which the job wants another pass (a replacement's back-off)."""


def parse_spec(job: JsonDict) -> FineTuneJob | str:
    """The parsed job, or why the operator cannot run it (a spec the API server accepted
    but the planner and worker cannot use, e.g. a LoRA target that is no linear layer)."""
    try:
        parsed = parse_job(job)
        training_shape(parsed)
    except (SpecError, ValueError) as err:
        return str(err)
    return parsed


def stage_pods(pods: Sequence[JsonDict]) -> dict[StageKey, JsonDict]:
    """A job's pods by the (pipeline, stage) labels they carry (pods without a stage label
    are not stages; one without a pipeline label is of pipeline 0)."""
    result: dict[StageKey, JsonDict] = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        stage, pipeline = labels.get(STAGE_LABEL, ""), labels.get(PIPELINE_LABEL, "0")
        if stage.isdigit() and pipeline.isdigit():
            result[(int(pipeline), int(stage))] = pod
    return result


def started(status: FineTuneJobStatus) -> bool:
    """Whether the job's plan and `startTime` are recorded (its first plan is made)."""
    return status.plan is not None and status.start_time is not None


def stage_memory(plan: PlanStatus, key: StageKey) -> int:
    """What the planned stage `key` is planned to need of its GPU's memory."""
    return plan.splits()[key[0]][key[1]].predicted_memory_bytes or DEFAULT_MEMORY_BYTES


def planned_keys(plan: PlanStatus) -> list[StageKey]:
    """Every planned stage as (pipeline, stage), in pipeline then stage order."""
    return [(p, s.index) for p, split in enumerate(plan.splits()) for s in split]


def given_up(status: FineTuneJobStatus) -> set[int]:
    """Pipelines out of the job: given up (a stage used up its restarts while others
    trained on) or left with their nodes; the stages are told they are out."""
    return {p.index for p in status.pipelines or () if p.phase in OUT_PHASES}


class Pass:
    """The decisions of one pass, accumulated in order."""

    def __init__(self, job: JsonDict, observed: Observed, settings: Settings) -> None:
        self.job = job
        self.observed = observed
        self.settings = settings
        self.now = observed.now
        meta = job["metadata"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.generation: int | None = meta.get("generation")
        # What the cluster holds as of the last PatchStatus decided so far.
        self.written = load_status(job.get("status"))
        self.status = self.written
        self.actions: list[Action] = []
        self.restarts = 0
        self.retry_after: float | None = None
        self.queue = queue_name(job)
        self.admissions: dict[int, Admission] = {}
        """Kueue's admission of each of the job's Workloads (admission.py), by pipeline."""
        self.per_pipeline = False
        """Whether the job has one Workload per pipeline (admission.per_pipeline)."""

    def decision(self) -> Decision:
        """What the pass decided, so far."""
        return Decision(tuple(self.actions), self.status, self.restarts, self.retry_after)

    def wake_within(self, seconds: float) -> None:
        """Ask for the next pass within `seconds` (the soonest of every such ask)."""
        self.retry_after = seconds if self.retry_after is None else min(self.retry_after, seconds)

    def step(self) -> int:
        """The job's last finished step as last read (the store's progress.json read this
        pass, else status)."""
        fresh = self.observed.progress
        if fresh is not None and "step" in fresh.status:
            return int(fresh.status["step"])
        progress = self.status.progress
        return progress.step if progress is not None else 0

    def committed(self) -> int | None:
        """The job's newest committed step as last read (as `step`); None before the
        first commit."""
        fresh = self.observed.progress
        if fresh is not None and "step" in fresh.status:
            return fresh.status.get("lastCommittedStep")
        progress = self.status.progress
        return progress.last_committed_step if progress is not None else None

    def update(self, **fields: Any) -> None:
        self.status = self.status.model_copy(update=fields)

    def settle(self, verdict: Verdict) -> None:
        """Apply the verdict to status, write what changed, and post an Event if due."""
        old = condition(self.written, READY)
        self.status = with_verdict(self.status, verdict, self.now, self.generation)
        self.patch()
        kind = EVENT_REASONS.get(verdict.reason)
        # One Event per reason the job enters: words that change while the reason holds
        # (an Unschedulable job's count of free GPUs as other jobs come and go) update the
        # condition, not the Events.
        moved = old is None or old.reason != verdict.reason
        if kind and moved:
            self.event(kind, verdict.reason, verdict.message)

    def patch(self) -> None:
        self.status = finalize(self.status)
        if self.status != self.written:
            self.actions.append(PatchStatus(self.status))
            self.written = self.status

    def event(self, kind: str, reason: str, message: str, change: str | None = None) -> None:
        self.actions.append(PostEvent(kind, reason, message, change))

    def replace_every_stage(self, **fields: Any) -> None:
        """Record a plan that replaces every stage (`fields`: the plan, its stages' and
        pipelines' entries) under the next plan epoch — written first, so that an operator
        restarted in between still replaces the pods — then delete every stage pod. The
        next pass creates the new plan's pods, whose documents carry the epoch, after it
        names the epoch in the job's store (`PutPlan`): a stage of the replaced plan still
        running stops before it writes a checkpoint."""
        self.update(**fields, plan_epoch=self._next_plan())
        self.patch()
        self.remove_pods()

    def stop_every_stage(self) -> None:
        """Delete every stage pod of a job that stops training for now (suspended, or its
        Workload preempted). When any goes, the plan epoch moves on first: the stages
        created when the job resumes are of a later plan than any of these still running
        (on a node cut off), which then write no checkpoint (`replace_every_stage`)."""
        if any(not pod["metadata"].get("deletionTimestamp") for pod in self.observed.pods.values()):
            self.update(plan_epoch=self._next_plan())
            self.patch()
        self.remove_pods()

    def _next_plan(self) -> int:
        """The plan epoch after the job's (stages of a plan that replaced or restarted them
        all; docs/stage-contract.md, `job.planEpoch`)."""
        return (self.status.plan_epoch or 0) + 1

    def remove_pods(self, pipeline: int | None = None) -> None:
        """Delete the job's stage pods (of `pipeline` only, if given): those still waiting
        for a node first, which would otherwise take a GPU the others free (a replacement
        bound, started and killed at once, as a re-split once did)."""
        pods = sorted(
            self.observed.pods.items(),
            key=lambda kp: (bool((kp[1].get("spec") or {}).get("nodeName")), kp[0]),
        )
        for key, pod in pods:
            if pipeline is not None and key[0] != pipeline:
                continue
            meta = pod["metadata"]
            if not meta.get("deletionTimestamp"):
                self.actions.append(DeletePod(meta["name"], meta.get("uid")))
