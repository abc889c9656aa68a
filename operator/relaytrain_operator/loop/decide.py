"""One reconciliation of one FineTuneJob as a pure decision: observed state → actions.

`decide(observed, settings)` reads only what it is given — the job as stored (spec and
status), its stage pods, the nodes, and when needed the cluster's GPU pods, the model's
config.json and the workers' progress — and returns the actions that bring the cluster to
what the job asks for, in order, and the job's new status (a typed `FineTuneJobStatus`).
`needs(job, pods)` says which of the costly inputs a pass needs, so the observer reads
them only then. Nothing here talks to the API server or the store; `apply.Executor`
applies the actions and `runner` ties observing, deciding and applying together.

Because every input comes from the cluster, an operator restarted at any point decides
the same again: pod names are fixed per stage (a second create is refused), the plan and
`startTime` are written before the first pod, and a failure is counted in status before
its pod is deleted (see recovery.py), so nothing is counted twice or lost.

The branches, in order: a job gone or being deleted (nothing: the garbage collector takes
its children); a spec the operator cannot run (InvalidSpec); a finished job (its pods go);
a suspended one (pods go, plan and counts stay); the first plan (Planned, ModelUnavailable,
Unschedulable); then per stage keep, create, replace or wait (recovery.decide), with a
replacement placed by `placement.place_replacements` after `failurePolicy.backoffSeconds`
and the job Failed once a stage has used up `maxStageRestarts`; finally progress and
completion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from relaytrain_operator.domain.builders.labels import (
    PIPELINE_LABEL,
    POOL_ANNOTATION,
    STAGE_LABEL,
    StageKey,
    stage_pod_name,
)
from relaytrain_operator.domain.builders.pod import CredentialsRef, StagePodInputs, build_stage_pod
from relaytrain_operator.domain.builders.service import build_service
from relaytrain_operator.domain.placement import Choice, place_replacements, pool_selector
from relaytrain_operator.domain.planner import Catalog
from relaytrain_operator.domain.planning import (
    LoraTargetError,
    PlanError,
    make_plan,
    training_shape,
)
from relaytrain_operator.domain.progress import Progress
from relaytrain_operator.domain.queueing import (
    ADMISSION_MANAGER,
    FINISHED_MANAGER,
    PRIORITY_LABEL,
    Admission,
    QueueError,
    StageDemand,
    build_workload,
    finished,
    flavor_placement,
    priority_class_of,
    queue_name,
    read_admission,
    release_quota,
)
from relaytrain_operator.domain.recovery import (
    INCARNATION_ANNOTATION,
    REPLACING,
    StageDecision,
    StageRecord,
    after_failure,
    backoff_left,
)
from relaytrain_operator.domain.recovery import decide as decide_stage
from relaytrain_operator.domain.stage_config import (
    build_pipeline_configs,
    job_pod_endpoints,
    output_uri,
)
from relaytrain_operator.domain.status import (
    READY,
    Verdict,
    condition,
    finalize,
    fleet_verdict,
    idle_stage,
    is_terminal,
    load_status,
    observed_stage,
    parse_time,
    pipeline_statuses,
    rfc3339,
    stage_name,
    with_verdict,
)
from relaytrain_operator.loop.actions import (
    Action,
    ApplyWorkloadStatus,
    Create,
    CreateLinkSecret,
    DeletePod,
    PatchStatus,
    PatchWorkload,
    PostEvent,
    PutGivenUp,
)
from relaytrain_operator.spec import (
    FineTuneJob,
    FineTuneJobStatus,
    OutputStatus,
    PlanStatus,
    ProgressStatus,
    SpecError,
    StageStatus,
    is_s3,
    parse_job,
)

__all__ = [
    "WAITING_ANNOTATION",
    "Decision",
    "ModelConfig",
    "Needs",
    "Observed",
    "Settings",
    "decide",
    "needs",
    "parse_spec",
    "stage_pods",
]

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
    "BackoffLimitExceeded": "Warning",
    "Suspended": "Normal",
    "Succeeded": "Normal",
    "Queued": "Normal",
    "WaitingForQuota": "Normal",
    "Evicted": "Warning",
    "Inadmissible": "Warning",
}
QUEUE_REASONS = ("Queued", "WaitingForQuota", "Inadmissible", "Evicted")
"""Why a job submitted to Kueue has no pods (docs/operator.md, "Queueing with Kueue")."""


@dataclass(frozen=True)
class Settings:
    """The operator's settings that decisions depend on."""

    node_lost_seconds: float = 60.0
    """How long a node may be NotReady before its stages are replaced."""
    worker_image: str = "ghcr.io/relaytrain/worker:0.1.0"
    """Image of jobs without spec.image."""
    default_link: tuple[float, float] | None = None
    """(Mbps, ms) assumed for GPU nodes without link annotations."""
    catalog: Catalog | None = None
    """The GPU catalog (None: the built-in one)."""


@dataclass(frozen=True)
class ModelConfig:
    """The base model's config.json, or why it could not be read."""

    config: JsonDict | None = None
    """The config (None when it could not be read)."""
    error: str = ""
    """Why it could not be read."""


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
    progress: Progress | None = None
    """The workers' progress.json, folded (None: none yet, unreadable, or not read)."""
    workload: JsonDict | None = None
    """The job's Kueue Workload (a job with a queue label: None means there is none yet)."""
    flavors: Mapping[str, JsonDict] = field(default_factory=dict)
    """The ResourceFlavors Kueue assigned, by name; read when stage pods are to be created."""
    priority: int | None = None
    """The value of the WorkloadPriorityClass the job's label names (None: no label, or no
    such class); read while the job has no Workload yet."""
    told_given_up: tuple[int, ...] | None = None
    """The pipelines the job's store says are given up (names.GIVEN_UP_FILE, what the
    operator wrote for the stages); None when not read, absent or unreadable."""


@dataclass(frozen=True)
class Needs:
    """Which costly inputs a pass needs (the rest of `Observed` is always read)."""

    pods: bool = False
    """Confirm the stage pods with the API server: a planned stage has none in the index."""
    room: bool = False
    """Every node and the cluster's active pods (a plan or a pod to create); passes that
    need them are serialised, so no two place onto one free GPU."""
    model: bool = False
    """The model's config.json (the first plan)."""
    progress: bool = False
    """progress.json (a started job whose store is s3://)."""
    workload: bool = False
    """The job's Kueue Workload (a job submitted to a LocalQueue), and when `room` too the
    flavours it was admitted with."""
    given_up: bool = False
    """What the store tells the stages of given-up pipelines (a started job on s3:// with a
    pipeline given up)."""


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


def _started(status: FineTuneJobStatus) -> bool:
    return status.plan is not None and status.start_time is not None


def planned_keys(plan: PlanStatus) -> list[StageKey]:
    """Every planned stage as (pipeline, stage), in pipeline then stage order."""
    return [(p, s.index) for p, split in enumerate(plan.splits()) for s in split]


def given_up(status: FineTuneJobStatus) -> set[int]:
    """Pipelines given up for good (a stage used up its restarts while others trained on)."""
    return {p.index for p in status.pipelines or () if p.phase == "Failed"}


def needs(job: JsonDict, pods: Mapping[StageKey, JsonDict]) -> Needs:
    """Which costly inputs `decide` needs for `job`, given its stage pods as indexed."""
    spec = parse_spec(job)
    status = load_status(job.get("status"))
    if isinstance(spec, str) or is_terminal(status):
        return Needs()
    queued = queue_name(job) is not None
    if spec.spec.suspend:
        return Needs(workload=queued)
    if not _started(status):
        return Needs(room=True, model=True, workload=queued)
    assert status.plan is not None
    out = given_up(status)
    missing = any(key not in pods for key in planned_keys(status.plan) if key[0] not in out)
    return Needs(
        pods=missing,
        room=missing,
        progress=is_s3(spec.spec.checkpoint.uri),
        workload=queued,
        given_up=bool(out) and is_s3(spec.spec.checkpoint.uri),
    )


def decide(observed: Observed, settings: Settings) -> Decision:
    """The actions and new status for the job in `observed`."""
    job = observed.job
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        # Gone, or going: the garbage collector deletes its children (owner references).
        return Decision()
    return _Pass(job, observed, settings).run()


def _merged(own: list[JsonDict], more: Sequence[JsonDict]) -> list[JsonDict]:
    return own + [t for t in more if t not in own]


def planned_message(plan: PlanStatus) -> str:
    """The Planned Event's words: each pipeline's stages, pools and layers."""

    def chain(stages: Sequence[Any]) -> str:
        return " → ".join(f"{s.pool}[{s.layer_start}:{s.layer_end})" for s in stages)

    if not plan.pipelines:
        return f"Planned {len(plan.stages)} stages: {chain(plan.stages)}."
    gpus = sum(len(p.stages) for p in plan.pipelines)
    each = "; ".join(
        f"pipeline {p.index} ({p.micro_batches} micro-batches/step): {chain(p.stages)}"
        for p in plan.pipelines
    )
    return f"Planned {len(plan.pipelines)} pipelines on {gpus} GPUs: {each}."


class _Pass:
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
        self.admission: Admission | None = None

    def run(self) -> Decision:
        self.reconcile()
        return Decision(tuple(self.actions), self.status, self.restarts, self.retry_after)

    def reconcile(self) -> None:
        spec = parse_spec(self.job)
        if isinstance(spec, str):
            self.settle(Verdict("Failed", False, False, "InvalidSpec", spec))
            return
        if is_terminal(self.written):
            self.remove_pods()
            return
        if spec.spec.suspend:
            self.remove_pods()
            self.update(stages=[idle_stage(s) for s in self.status.stages])
            if self.queue is not None:
                self.hold_workload(active=False)
            self.settle(
                Verdict(
                    "Suspended",
                    False,
                    False,
                    "Suspended",
                    "spec.suspend is true: the stage pods are removed; setting it to false "
                    "resumes from the last committed checkpoint.",
                )
            )
            return
        if not _started(self.status) and not self.plan(spec):
            return
        if self.queue is not None and not self.admitted(spec):
            return
        self.run_stages(spec)

    # --- the first plan ---------------------------------------------------------------

    def plan(self, spec: FineTuneJob) -> bool:
        """Plan the job and record the plan; False (with a condition) when it cannot."""
        model, pods = self.observed.model, self.observed.cluster_pods
        assert model is not None and pods is not None, "needs() asks for both before a plan"
        if self.queue is not None:
            # Kueue's quota decides when the job runs; the plan is made for the whole
            # fleet, not for the GPUs that happen to be free now.
            pods = []
        if model.config is None:
            self.settle(Verdict("Pending", False, False, "ModelUnavailable", model.error))
            return False
        try:
            planned = make_plan(
                spec,
                model.config,
                list(self.observed.nodes.values()),
                pods,
                catalog=self.settings.catalog,
                default_link=self.settings.default_link,
            )
        except LoraTargetError as err:
            # Not a fleet too small: the spec asks for what this model has not.
            self.update(plan=None)
            self.settle(Verdict("Failed", False, False, "InvalidSpec", str(err)))
            return False
        except PlanError as err:
            self.update(plan=None)
            self.settle(Verdict("Pending", False, False, "Unschedulable", str(err)))
            return False
        plan = PlanStatus.model_validate(planned)
        several = plan.several()
        self.update(
            plan=plan,
            start_time=rfc3339(self.now),
            stages=[
                StageStatus(index=s.index, pipeline=p if several else None, pool=s.pool)
                for p, split in enumerate(plan.splits())
                for s in split
            ],
        )
        # The plan is recorded before any pod exists: a restart after this point builds
        # the same pods from it.
        self.settle(Verdict("Planning", False, True, "Planned", "Creating the stage pods."))
        self.event("Normal", "Planned", planned_message(plan))
        return True

    # --- Kueue (queueing.py) -----------------------------------------------------------

    def admitted(self, spec: FineTuneJob) -> bool:
        """A job submitted to a LocalQueue: its Workload created, kept active, and True once
        Kueue admits it; otherwise its pods go (an evicted workload's quota is handed back
        once none is left) and the job is Suspended with Kueue's words."""
        admission = read_admission(self.observed.workload)
        self.admission = admission
        if admission.state == "missing":
            priority_class = priority_class_of(self.job)
            if priority_class is not None and self.observed.priority is None:
                self.settle(
                    Verdict(
                        "Failed",
                        False,
                        False,
                        "InvalidSpec",
                        f"metadata.labels[{PRIORITY_LABEL}]: WorkloadPriorityClass "
                        f"{priority_class!r} does not exist; create it or name one that does "
                        "(kubectl get workloadpriorityclasses)",
                    )
                )
                return False
            try:
                workload = self.workload(spec, active=True)
            except QueueError as err:
                self.settle(Verdict("Failed", False, False, "InvalidSpec", str(err)))
                return False
            self.actions.append(Create(workload))
            self.wait_for_kueue(
                "Queued",
                f"Submitted to LocalQueue {self.queue}: waiting for Kueue to admit it.",
            )
            return False
        if not admission.active:
            self.hold_workload(active=True)
        if admission.state == "admitted":
            ready = condition(self.written, READY)
            if ready is not None and ready.reason in QUEUE_REASONS:
                flavors = ", ".join(f"{p} → {f}" for p, f in sorted(admission.pool_flavors.items()))
                self.event("Normal", "Admitted", f"{admission.message} (flavors: {flavors}).")
            return True
        if admission.state in ("evicted", "released"):
            self.release_quota()
            self.wait_for_kueue(
                "Evicted",
                f"Kueue evicted the workload ({admission.reason}: {admission.message}); the "
                "stage pods are removed and it resumes from the last committed checkpoint "
                "when Kueue admits it again.",
            )
            return False
        if admission.message:
            # Pending: no quota now; Inadmissible: it cannot be admitted as it stands (its
            # LocalQueue or ClusterQueue missing or inactive): Kueue's words either way.
            reason = "WaitingForQuota" if admission.reason == "Pending" else "Inadmissible"
            self.wait_for_kueue(reason, f"LocalQueue {self.queue}: {admission.message}")
        else:
            self.wait_for_kueue(
                "Queued", f"Submitted to LocalQueue {self.queue}: waiting for Kueue to admit it."
            )
        return False

    def wait_for_kueue(self, reason: str, message: str) -> None:
        self.remove_pods()
        self.update(stages=[idle_stage(s) for s in self.status.stages])
        self.settle(Verdict("Suspended", False, False, reason, message))

    def workload(self, spec: FineTuneJob, *, active: bool) -> JsonDict:
        """The job's Workload for its recorded plan: one demand per planned stage."""
        plan = self.status.plan
        assert plan is not None
        nodes = list(self.observed.nodes.values())
        placement = spec.spec.placement
        demands = [
            StageDemand(
                stage.pool,
                {
                    **pool_selector(stage.pool, nodes, placement.gpu_label),
                    **placement.node_selector,
                },
                stage.predicted_memory_bytes or DEFAULT_MEMORY_BYTES,
            )
            for split in plan.splits()
            for stage in split
        ]
        return build_workload(
            self.job,
            demands,
            active=active,
            tolerations=[
                t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations
            ],
            priority_class_name=placement.priority_class_name,
            priority=self.observed.priority,
        )

    def hold_workload(self, *, active: bool) -> None:
        """Keep the Workload's spec.active as spec.suspend asks (Kueue evicts an inactive
        one and hands its quota on); an evicted one's quota is handed back once no pod is
        left."""
        workload = self.observed.workload
        if workload is None:
            return
        meta = workload["metadata"]
        if bool((workload.get("spec") or {}).get("active", True)) != active:
            self.actions.append(PatchWorkload(meta["name"], {"spec": {"active": active}}))
        if not active:
            self.release_quota()

    def release_quota(self) -> None:
        """Hand an evicted Workload's quota back once no stage pod is left (terminating ones
        count: they still hold their GPUs)."""
        workload = self.observed.workload
        if (
            workload is not None
            and read_admission(workload).state == "evicted"
            and not self.observed.pods
        ):
            self.actions.append(
                ApplyWorkloadStatus(release_quota(workload, rfc3339(self.now)), ADMISSION_MANAGER)
            )

    def finish_workload(self, succeeded: bool, message: str) -> None:
        """A finished job's Workload is marked Finished (Kueue frees its quota), before the
        job's own status says so: the job's loop stops once that status is written."""
        workload = self.observed.workload
        if self.queue is None or workload is None:
            return
        conditions = (workload.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Finished" and c.get("status") == "True" for c in conditions):
            return
        self.actions.append(
            ApplyWorkloadStatus(
                finished(workload, succeeded, message, rfc3339(self.now)), FINISHED_MANAGER
            )
        )

    def flavor_placement(self, pool: str) -> tuple[dict[str, str], list[JsonDict]]:
        """The node labels and tolerations of the flavour Kueue assigned to `pool`'s pod
        set (none for a job without a queue)."""
        if self.admission is None:
            return {}, []
        name = self.admission.pool_flavors.get(pool)
        flavor = self.observed.flavors.get(name) if name else None
        return flavor_placement(flavor) if flavor is not None else ({}, [])

    # --- the stages -------------------------------------------------------------------

    def run_stages(self, spec: FineTuneJob) -> None:
        plan = self.status.plan
        assert plan is not None
        pods = self.observed.pods
        limit = spec.spec.failure_policy.max_stage_restarts
        grace = timedelta(seconds=self.settings.node_lost_seconds)
        several = plan.several()
        out = given_up(self.status)
        progress = self.observed.progress
        if progress is not None and progress.done and self.follow_progress(spec, out):
            return  # the workers finished: a stage ending afterwards is no failure
        records = {(s.pipeline or 0, s.index): s for s in self.status.stages}
        verdicts: dict[StageKey, StageDecision] = {}
        entries: dict[StageKey, StageStatus] = {}
        restarting: list[PostEvent] = []
        exhausted: dict[int, str] = {}
        for key in planned_keys(plan):
            p, k = key
            planned = plan.splits()[p][k]
            entry = records.get(key) or StageStatus(
                index=k, pipeline=p if several else None, pool=planned.pool
            )
            entries[key] = entry
            if p in out:
                continue  # given up: its pods went when it was
            pod = pods.get(key)
            node_name = ((pod or {}).get("spec") or {}).get("nodeName")
            node = self.observed.nodes.get(node_name) if node_name else None
            record = StageRecord(k, entry.restarts, entry.phase, entry.pool)
            verdict = decide_stage(record, pod, node, now=self.now, node_grace=grace)
            name = stage_pod_name(self.name, k, p if several else None)
            if verdict.failure is not None:
                counted = after_failure(entry.restarts, limit)
                if counted is None:
                    why = (
                        f"Stage {stage_name(entry)} failed again ({verdict.failure}) after "
                        f"{entry.restarts} restarts; spec.failurePolicy.maxStageRestarts is "
                        f"{limit}."
                    )
                    # Any pipeline may go: the lowest one training writes the checkpoints, the
                    # progress and the result (docs/worker.md). The job fails with the last.
                    if out | set(exhausted) | {p} >= set(range(len(plan.splits()))):
                        self.fail(why)
                        return
                    exhausted.setdefault(p, why)
                    continue
                entry = entry.model_copy(
                    update={
                        "restarts": counted,
                        "phase": REPLACING,
                        "last_failure": verdict.failure,
                        "last_failure_time": rfc3339(self.now),
                    }
                )
                entries[key] = entry
                self.restarts += 1
                restarting.append(
                    PostEvent(
                        "Warning",
                        "StageRestarting",
                        f"Stage {stage_name(entry)} pod {name} ended ({verdict.failure}); "
                        f"replacing it (restart {entry.restarts} of {limit}).",
                    )
                )
            verdicts[key] = verdict
        for key in [key for key in entries if key[0] in exhausted]:
            verdicts.pop(key, None)
            entries[key] = idle_stage(entries[key])
        if restarting or exhausted:
            # Count first, then delete: see recovery.py for why this order is crash-safe.
            out |= set(exhausted)
            self.update(
                stages=[entries[key] for key in sorted(entries)],
                pipelines=pipeline_statuses(plan, list(entries.values()), out),
            )
            self.patch()
            self.actions += restarting
        for p, why in sorted(exhausted.items()):
            self.remove_pods(p)
            self.event(
                "Warning",
                "PipelineFailed",
                f"{why} Pipeline {p} is given up; the other pipelines train on without it.",
            )
        # The stages learn it from the store: one linking again waits for no stage of it.
        told = tuple(sorted(out))
        if out and is_s3(spec.spec.checkpoint.uri) and self.observed.told_given_up != told:
            self.actions.append(PutGivenUp(told))
        for key, verdict in verdicts.items():
            if verdict.action == "delete":
                meta = pods[key]["metadata"]
                self.actions.append(DeletePod(meta["name"], meta.get("uid"), verdict.force))
        waiting: dict[StageKey, str] = {}
        creating = [key for key, v in verdicts.items() if v.action == "create"]
        if creating:
            self.create_stages(spec, creating, entries, waiting)
        for key, verdict in verdicts.items():
            if verdict.action != "keep":
                continue
            pod = pods[key]
            annotations = pod["metadata"].get("annotations") or {}
            pool = annotations.get(POOL_ANNOTATION, entries[key].pool)
            entries[key] = observed_stage(entries[key], pod, pool)
            if WAITING_ANNOTATION in annotations and not (pod.get("spec") or {}).get("nodeName"):
                waiting[key] = annotations[WAITING_ANNOTATION]
        stages = [entries[key] for key in sorted(entries)]
        pipelines = pipeline_statuses(plan, stages, out)
        self.update(stages=stages, pipelines=pipelines)
        if self.follow_progress(spec, out):
            return
        self.settle(fleet_verdict(stages, pipelines, waiting))

    def create_stages(
        self,
        spec: FineTuneJob,
        stages: list[StageKey],
        entries: dict[StageKey, StageStatus],
        waiting: dict[StageKey, str],
    ) -> None:
        """Create the pods of `stages` (and the Service and link Secret they need).

        A replacement waits spec.failurePolicy.backoffSeconds from its stage's failure,
        `lastFailureTime` in status.stages (kept in the cluster). A stage whose failure time
        is unknown (a status written before the field existed) starts its wait now, and the
        time is recorded so that the next pass counts from it.
        """
        backoff = timedelta(seconds=spec.spec.failure_policy.backoff_seconds)
        due: list[StageKey] = []
        waits: list[timedelta] = []
        for key in stages:
            entry = entries[key]
            failed_at = parse_time(entry.last_failure_time)
            if failed_at is None and entry.restarts:
                failed_at = self.now
                entries[key] = entry.model_copy(update={"last_failure_time": rfc3339(self.now)})
            left = backoff_left(entry.restarts, failed_at, self.now, backoff)
            if left:
                waits.append(left)
            else:
                due.append(key)
        if waits:
            self.retry_after = min(waits).total_seconds()
        if not due:
            return
        plan = self.status.plan
        nodes = list(self.observed.nodes.values())
        assert plan is not None and self.observed.cluster_pods is not None
        splits = plan.splits()
        several = plan.several()
        counts = tuple(len(split) for split in splits)
        self.actions.append(CreateLinkSecret(counts))
        self.actions.append(Create(build_service(self.job)))
        shares = (
            [p.micro_batches for p in plan.pipelines]
            if plan.pipelines
            else [spec.spec.training.micro_batches]
        )
        configs = build_pipeline_configs(
            spec, splits, job_pod_endpoints(self.name, self.namespace, counts), shares
        )

        def need(key: StageKey) -> int:
            return splits[key[0]][key[1]].predicted_memory_bytes or DEFAULT_MEMORY_BYTES

        def planned_pool(key: StageKey) -> str:
            return entries[key].pool or splits[key[0]][key[1]].pool

        replacing = {key: (planned_pool(key), need(key)) for key in due if entries[key].restarts}
        choices: dict[StageKey, Choice] = {}
        # Under Kueue a replacement stays on the pool it was admitted on: another pool
        # would use quota Kueue did not grant.
        if replacing and self.queue is None:
            choices = place_replacements(
                spec, replacing, nodes, self.observed.cluster_pods, self.settings.catalog
            )
        # A replacement restores the newest commit unless another pipeline trains on: then
        # it rejoins from a live peer's state (docs/worker.md).
        live = {key[0] for key in entries} - {
            key[0] for key, s in entries.items() if s.phase != "Running"
        }
        committed = self.committed_step()
        label = spec.spec.placement.gpu_label
        for key in due:
            p, k = key
            entry = entries[key]
            pool = planned_pool(key)
            annotations = {INCARNATION_ANNOTATION: str(entry.restarts)}
            choice = choices.get(key)
            if choice is not None:
                pool = choice.pool
                if not choice.free:
                    why = f"Stage {stage_name(entry)} waits for a GPU on pool {pool}: {choice.why}."
                    annotations[WAITING_ANNOTATION] = why
                    waiting[key] = why
            flavor_labels, flavor_tolerations = self.flavor_placement(pool)
            selector = {
                **pool_selector(pool, nodes, label),
                **spec.spec.placement.node_selector,
                **flavor_labels,
            }
            pod = build_stage_pod(
                self.job,
                self.pod_inputs(
                    spec,
                    (p if several else None, k),
                    pool=pool,
                    selector=selector,
                    need=need(key),
                    config=configs[p][k],
                    tolerations=flavor_tolerations,
                ),
            )
            pod["metadata"]["annotations"].update(annotations)
            self.actions.append(Create(pod))
            update: dict[str, Any] = {
                "pool": pool,
                "phase": "Pending",
                "pod": pod["metadata"]["name"],
                "ready": False,
                "node": None,
            }
            if entry.restarts and committed is not None and not live - {p}:
                update["restored_from_step"] = committed
            entries[key] = entry.model_copy(update=update)

    def committed_step(self) -> int | None:
        """The newest committed checkpoint: a replacement restores it. The store's
        progress.json, read this pass, can be newer than what status last folded in."""
        fresh = self.observed.progress
        if fresh is not None and "lastCommittedStep" in fresh.status:
            return int(fresh.status["lastCommittedStep"])
        progress = self.status.progress
        return progress.last_committed_step if progress is not None else None

    def pod_inputs(
        self,
        spec: FineTuneJob,
        key: tuple[int | None, int],
        *,
        pool: str,
        selector: dict[str, str],
        need: int,
        config: JsonDict,
        tolerations: Sequence[JsonDict] = (),
    ) -> StagePodInputs:
        """`tolerations`: the assigned Kueue flavour's, added to the job's own."""
        ref = spec.spec.checkpoint.credentials_secret
        placement = spec.spec.placement
        return StagePodInputs(
            index=key[1],
            pipeline=key[0],
            pool=pool,
            node_selector=selector,
            memory_bytes=need,
            stage_config=config,
            image=spec.spec.image or self.settings.worker_image,
            credentials=CredentialsRef(ref.name, ref.access_key_key, ref.secret_key_key)
            if ref is not None
            else None,
            tolerations=_merged(
                [t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations],
                tolerations,
            ),
            priority_class_name=placement.priority_class_name,
        )

    def remove_pods(self, pipeline: int | None = None) -> None:
        """Delete the job's stage pods (of `pipeline` only, if given)."""
        for key, pod in sorted(self.observed.pods.items()):
            if pipeline is not None and key[0] != pipeline:
                continue
            meta = pod["metadata"]
            if not meta.get("deletionTimestamp"):
                self.actions.append(DeletePod(meta["name"], meta.get("uid")))

    # --- outcomes ---------------------------------------------------------------------

    def fail(self, why: str) -> None:
        """The policy allows no more restarts (of the last pipeline left): the job is Failed
        and its pods go."""
        self.remove_pods()
        self.update(stages=[idle_stage(s) for s in self.status.stages])
        self.finish_workload(False, why)
        self.settle(Verdict("Failed", False, False, "BackoffLimitExceeded", why))

    def follow_progress(self, spec: FineTuneJob, out: set[int]) -> bool:
        """Fold progress.json into status; True if the job finished (and was settled)."""
        progress = self.observed.progress
        if progress is not None:
            self.update(progress=ProgressStatus.model_validate(progress.status))
        stages, pods = self.status.stages, self.observed.pods
        live = [s for s in stages if (s.pipeline or 0) not in out]
        all_done = (
            bool(live)
            and len(pods) == len(live)
            and all((p.get("status") or {}).get("phase") == "Succeeded" for p in pods.values())
        )
        reported_done = progress is not None and progress.done
        if not (reported_done or all_done):
            return False
        uri = (progress.output if progress is not None else None) or output_uri(spec)
        self.update(output=OutputStatus(uri=uri))
        self.remove_pods()
        # Every pipeline not given up finished with the job, whatever its pods said last.
        pipelines = [
            p if p.phase == "Failed" else p.model_copy(update={"phase": "Succeeded"})
            for p in self.status.pipelines or ()
        ]
        self.update(stages=[idle_stage(s) for s in stages], pipelines=pipelines or None)
        self.finish_workload(True, f"Training finished; the result is at {uri}.")
        self.settle(
            Verdict(
                "Succeeded",
                True,
                False,
                "Succeeded",
                f"Training finished; the result is at {uri}.",
            )
        )
        return True

    # --- status and events ------------------------------------------------------------

    def update(self, **fields: Any) -> None:
        self.status = self.status.model_copy(update=fields)

    def settle(self, verdict: Verdict) -> None:
        """Apply the verdict to status, write what changed, and post an Event if due."""
        old = condition(self.written, READY)
        self.status = with_verdict(self.status, verdict, self.now, self.generation)
        self.patch()
        kind = EVENT_REASONS.get(verdict.reason)
        moved = old is None or (old.reason, old.message) != (verdict.reason, verdict.message)
        if kind and moved:
            self.event(kind, verdict.reason, verdict.message)

    def patch(self) -> None:
        self.status = finalize(self.status)
        if self.status != self.written:
            self.actions.append(PatchStatus(self.status))
            self.written = self.status

    def event(self, kind: str, reason: str, message: str) -> None:
        self.actions.append(PostEvent(kind, reason, message))
