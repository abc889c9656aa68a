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

from relaytrain_operator.actions import (
    Action,
    Create,
    CreateLinkSecret,
    DeletePod,
    PatchStatus,
    PostEvent,
)
from relaytrain_operator.builders.labels import POOL_ANNOTATION, STAGE_LABEL, stage_pod_name
from relaytrain_operator.builders.pod import CredentialsRef, StagePodInputs, build_stage_pod
from relaytrain_operator.builders.service import build_service
from relaytrain_operator.placement import Choice, place_replacements, pool_selector
from relaytrain_operator.planner import Catalog
from relaytrain_operator.planning import PlanError, check_deployable, make_plan, training_shape
from relaytrain_operator.progress import Progress
from relaytrain_operator.recovery import (
    INCARNATION_ANNOTATION,
    REPLACING,
    StageDecision,
    StageRecord,
    after_failure,
    backoff_left,
)
from relaytrain_operator.recovery import decide as decide_stage
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
from relaytrain_operator.stage_config import build_stage_configs, output_uri, pod_endpoints
from relaytrain_operator.status import (
    READY,
    Verdict,
    condition,
    finalize,
    idle_stage,
    is_terminal,
    load_status,
    observed_stage,
    parse_time,
    rfc3339,
    running_verdict,
    with_verdict,
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
}


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
    pods: Mapping[int, JsonDict] = field(default_factory=dict)
    """The job's stage pods by stage index, terminating ones included."""
    nodes: Mapping[str, JsonDict] = field(default_factory=dict)
    """Nodes by name: at least those of the stage pods (a pod's node missing here is gone);
    every node when `cluster_pods` is observed."""
    cluster_pods: Sequence[JsonDict] | None = None
    """Active pods of the whole cluster (what holds GPUs); read when `needs().room`."""
    model: ModelConfig | None = None
    """The model's config.json; read when `needs().model`."""
    progress: Progress | None = None
    """The workers' progress.json, folded (None: none yet, unreadable, or not read)."""


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
    but the planner and worker cannot use, e.g. a LoRA target that is no linear layer, or
    that this operator cannot deploy yet: several pipelines)."""
    try:
        parsed = parse_job(job)
        training_shape(parsed)
        check_deployable(parsed)
    except (SpecError, ValueError) as err:
        return str(err)
    return parsed


def stage_pods(pods: Sequence[JsonDict]) -> dict[int, JsonDict]:
    """A job's pods by the stage label they carry (pods without one are not stages)."""
    result: dict[int, JsonDict] = {}
    for pod in pods:
        raw = ((pod.get("metadata") or {}).get("labels") or {}).get(STAGE_LABEL, "")
        if raw.isdigit():
            result[int(raw)] = pod
    return result


def _started(status: FineTuneJobStatus) -> bool:
    return status.plan is not None and status.start_time is not None


def needs(job: JsonDict, pods: Mapping[int, JsonDict]) -> Needs:
    """Which costly inputs `decide` needs for `job`, given its stage pods as indexed."""
    spec = parse_spec(job)
    status = load_status(job.get("status"))
    if isinstance(spec, str) or is_terminal(status) or spec.spec.suspend:
        return Needs()
    if not _started(status):
        return Needs(room=True, model=True)
    assert status.plan is not None
    missing = any(s.index not in pods for s in status.plan.stages)
    return Needs(pods=missing, room=missing, progress=is_s3(spec.spec.checkpoint.uri))


def decide(observed: Observed, settings: Settings) -> Decision:
    """The actions and new status for the job in `observed`."""
    job = observed.job
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        # Gone, or going: the garbage collector deletes its children (owner references).
        return Decision()
    return _Pass(job, observed, settings).run()


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
        self.run_stages(spec)

    # --- the first plan ---------------------------------------------------------------

    def plan(self, spec: FineTuneJob) -> bool:
        """Plan the job and record the plan; False (with a condition) when it cannot."""
        model, pods = self.observed.model, self.observed.cluster_pods
        assert model is not None and pods is not None, "needs() asks for both before a plan"
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
        except PlanError as err:
            self.update(plan=None)
            self.settle(Verdict("Pending", False, False, "Unschedulable", str(err)))
            return False
        plan = PlanStatus.model_validate(planned)
        self.update(
            plan=plan,
            start_time=rfc3339(self.now),
            stages=[StageStatus(index=s.index, pool=s.pool) for s in plan.stages],
        )
        # The plan is recorded before any pod exists: a restart after this point builds
        # the same pods from it.
        self.settle(Verdict("Planning", False, True, "Planned", "Creating the stage pods."))
        pools = " → ".join(f"{s.pool}[{s.layer_start}:{s.layer_end})" for s in plan.stages)
        self.event("Normal", "Planned", f"Planned {len(plan.stages)} stages: {pools}.")
        return True

    # --- the stages -------------------------------------------------------------------

    def run_stages(self, spec: FineTuneJob) -> None:
        plan = self.status.plan
        assert plan is not None
        pods = self.observed.pods
        limit = spec.spec.failure_policy.max_stage_restarts
        grace = timedelta(seconds=self.settings.node_lost_seconds)
        records = {s.index: s for s in self.status.stages}
        verdicts: dict[int, StageDecision] = {}
        entries: dict[int, StageStatus] = {}
        restarting: list[PostEvent] = []
        for planned in plan.stages:
            k = planned.index
            entry = records.get(k) or StageStatus(index=k, pool=planned.pool)
            pod = pods.get(k)
            node_name = ((pod or {}).get("spec") or {}).get("nodeName")
            node = self.observed.nodes.get(node_name) if node_name else None
            record = StageRecord(k, entry.restarts, entry.phase, entry.pool)
            verdict = decide_stage(record, pod, node, now=self.now, node_grace=grace)
            if verdict.failure is not None:
                counted = after_failure(entry.restarts, limit)
                if counted is None:
                    self.fail(k, verdict.failure, entry.restarts, limit)
                    return
                entry = entry.model_copy(
                    update={
                        "restarts": counted,
                        "phase": REPLACING,
                        "last_failure": verdict.failure,
                    }
                )
                self.restarts += 1
                restarting.append(
                    PostEvent(
                        "Warning",
                        "StageRestarting",
                        f"Stage {k} pod {stage_pod_name(self.name, k)} ended "
                        f"({verdict.failure}); replacing it (restart {entry.restarts} of "
                        f"{limit}).",
                    )
                )
            verdicts[k] = verdict
            entries[k] = entry
        if restarting:
            # Count first, then delete: see recovery.py for why this order is crash-safe.
            self.update(stages=[entries[k] for k in sorted(entries)])
            self.patch()
            self.actions += restarting
        for k, verdict in verdicts.items():
            if verdict.action == "delete":
                meta = pods[k]["metadata"]
                self.actions.append(DeletePod(meta["name"], meta.get("uid"), verdict.force))
        waiting: dict[int, str] = {}
        creating = [k for k, v in verdicts.items() if v.action == "create"]
        if creating:
            self.create_stages(spec, creating, entries, bool(restarting), waiting)
        for k, verdict in verdicts.items():
            if verdict.action != "keep":
                continue
            pod = pods[k]
            annotations = pod["metadata"].get("annotations") or {}
            pool = annotations.get(POOL_ANNOTATION, entries[k].pool)
            entries[k] = observed_stage(entries[k], pod, pool)
            if WAITING_ANNOTATION in annotations and not (pod.get("spec") or {}).get("nodeName"):
                waiting[k] = annotations[WAITING_ANNOTATION]
        self.update(stages=[entries[k] for k in sorted(entries)])
        if self.follow_progress(spec):
            return
        self.settle(running_verdict(self.status.stages, waiting))

    def create_stages(
        self,
        spec: FineTuneJob,
        stages: list[int],
        entries: dict[int, StageStatus],
        counted_now: bool,
        waiting: dict[int, str],
    ) -> None:
        """Create the pods of `stages` (and the Service and link Secret they need).

        A replacement waits spec.failurePolicy.backoffSeconds from the failure, measured
        from when the Ready condition turned to StageRestarting (kept in the cluster).
        """
        backoff = timedelta(seconds=spec.spec.failure_policy.backoff_seconds)
        ready = condition(self.written, READY)
        failed_at = (
            parse_time(ready.last_transition_time)
            if ready is not None and ready.reason == "StageRestarting"
            else None
        )
        if counted_now:
            failed_at = self.now
        due, waits = [], []
        for k in stages:
            left = backoff_left(entries[k].restarts, failed_at, self.now, backoff)
            if left:
                waits.append(left)
            else:
                due.append(k)
        if waits:
            self.retry_after = max(waits).total_seconds()
        if not due:
            return
        plan = self.status.plan
        nodes = list(self.observed.nodes.values())
        assert plan is not None and self.observed.cluster_pods is not None
        self.actions.append(CreateLinkSecret((len(plan.stages),)))
        self.actions.append(Create(build_service(self.job)))
        configs = build_stage_configs(
            spec, plan, pod_endpoints(self.name, self.namespace, len(plan.stages))
        )

        def need(k: int) -> int:
            return plan.stages[k].predicted_memory_bytes or DEFAULT_MEMORY_BYTES

        replacing = {
            k: (entries[k].pool or plan.stages[k].pool, need(k)) for k in due if entries[k].restarts
        }
        choices: dict[int, Choice] = {}
        if replacing:
            choices = place_replacements(
                spec, replacing, nodes, self.observed.cluster_pods, self.settings.catalog
            )
        committed = self.committed_step()
        label = spec.spec.placement.gpu_label
        for k in due:
            entry = entries[k]
            pool = entry.pool or plan.stages[k].pool
            annotations = {INCARNATION_ANNOTATION: str(entry.restarts)}
            choice = choices.get(k)
            if choice is not None:
                pool = choice.pool
                if not choice.free:
                    why = f"Stage {k} waits for a GPU on pool {pool}: {choice.why}."
                    annotations[WAITING_ANNOTATION] = why
                    waiting[k] = why
            selector = {**pool_selector(pool, nodes, label), **spec.spec.placement.node_selector}
            pod = build_stage_pod(
                self.job,
                self.pod_inputs(
                    spec, k, pool=pool, selector=selector, need=need(k), config=configs[k]
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
            if entry.restarts and committed is not None:
                update["restored_from_step"] = committed
            entries[k] = entry.model_copy(update=update)

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
        k: int,
        *,
        pool: str,
        selector: dict[str, str],
        need: int,
        config: JsonDict,
    ) -> StagePodInputs:
        ref = spec.spec.checkpoint.credentials_secret
        placement = spec.spec.placement
        return StagePodInputs(
            index=k,
            pool=pool,
            node_selector=selector,
            memory_bytes=need,
            stage_config=config,
            image=spec.spec.image or self.settings.worker_image,
            credentials=CredentialsRef(ref.name, ref.access_key_key, ref.secret_key_key)
            if ref is not None
            else None,
            tolerations=[
                t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations
            ],
            priority_class_name=placement.priority_class_name,
        )

    def remove_pods(self) -> None:
        for pod in self.observed.pods.values():
            meta = pod["metadata"]
            if not meta.get("deletionTimestamp"):
                self.actions.append(DeletePod(meta["name"], meta.get("uid")))

    # --- outcomes ---------------------------------------------------------------------

    def fail(self, stage: int, failure: str, restarts: int, limit: int) -> None:
        """The policy allows no more restarts: the job is Failed and its pods go."""
        self.remove_pods()
        self.update(stages=[idle_stage(s) for s in self.status.stages])
        self.settle(
            Verdict(
                "Failed",
                False,
                False,
                "BackoffLimitExceeded",
                f"Stage {stage} failed again ({failure}) after {restarts} restarts; "
                f"spec.failurePolicy.maxStageRestarts is {limit}.",
            )
        )

    def follow_progress(self, spec: FineTuneJob) -> bool:
        """Fold progress.json into status; True if the job finished (and was settled)."""
        progress = self.observed.progress
        if progress is not None:
            self.update(progress=ProgressStatus.model_validate(progress.status))
        stages, pods = self.status.stages, self.observed.pods
        all_done = (
            bool(stages)
            and len(pods) == len(stages)
            and all((p.get("status") or {}).get("phase") == "Succeeded" for p in pods.values())
        )
        reported_done = progress is not None and progress.done
        if not (reported_done or all_done):
            return False
        uri = (progress.output if progress is not None else None) or output_uri(spec)
        self.update(output=OutputStatus(uri=uri))
        self.remove_pods()
        self.update(stages=[idle_stage(s) for s in stages])
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
