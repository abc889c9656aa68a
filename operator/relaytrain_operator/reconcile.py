"""One reconciliation of one FineTuneJob: parse → plan → build → apply → status.

Every pass starts from the cluster: the job is read fresh (not taken from the event that
triggered the pass), its pods are listed, and its status says what was already counted.
Nothing that decides is kept in memory, so an operator killed at any point and started
again carries on where the cluster says it was, creating no second pod (pod names are
fixed per stage, and a create of an existing name is refused) and counting no failure
twice (see recovery.py).

Passes for one job never overlap (a lock per job); the first planning of jobs is
serialised (one planning lock), so a job is planned only after the pods of the job
planned before it exist and hold their GPUs.
"""

from __future__ import annotations

import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from relaytrain_operator import metrics
from relaytrain_operator.apply import ClusterApi
from relaytrain_operator.builders.labels import POOL_ANNOTATION, STAGE_LABEL, stage_pod_name
from relaytrain_operator.builders.pod import CredentialsRef, StagePodInputs, build_stage_pod
from relaytrain_operator.builders.secret import build_link_secret
from relaytrain_operator.builders.service import build_service
from relaytrain_operator.nodecache import NodeSnapshot
from relaytrain_operator.objectstore import StoreAccess, StoreError, read_json
from relaytrain_operator.options import OperatorOptions
from relaytrain_operator.planner import Catalog
from relaytrain_operator.planning import PlanError, make_plan, training_shape
from relaytrain_operator.pools import choose_pool, free_nodes, pool_rooms, pool_selector
from relaytrain_operator.progress import read_progress
from relaytrain_operator.recovery import (
    INCARNATION_ANNOTATION,
    REPLACING,
    StageDecision,
    StageRecord,
    decide,
)
from relaytrain_operator.spec import FineTuneJob, SpecError, is_s3, parse_job
from relaytrain_operator.stage_config import build_stage_configs, output_uri, pod_endpoints
from relaytrain_operator.status import (
    READY,
    Verdict,
    changes,
    condition,
    finalize,
    is_terminal,
    parse_time,
    rfc3339,
    running_verdict,
    stage_entry,
    with_verdict,
)

logger = logging.getLogger(__name__)

JsonDict = dict[str, Any]
MIB = 1024 * 1024
DEFAULT_MEMORY_BYTES = 4 * 1024 * MIB
# Reasons whose condition change is worth an Event (a user should notice these).
EVENT_REASONS = {
    "InvalidSpec": "Warning",
    "Unschedulable": "Warning",
    "ModelUnavailable": "Warning",
    "BackoffLimitExceeded": "Warning",
    "Suspended": "Normal",
    "Succeeded": "Normal",
    "Planned": "Normal",
}


@dataclass(frozen=True)
class JobEvent:
    """An Event to post on the job."""

    type: str
    """Normal or Warning."""
    reason: str
    """CamelCase reason, e.g. StageRestarting."""
    message: str
    """What happened, for people."""


@dataclass
class Outcome:
    """What one pass did, for the handler to report."""

    job: JsonDict | None
    """The job as read at the start of the pass (None: it is gone)."""
    events: list[JobEvent] = field(default_factory=list)
    """Events to post on the job."""
    phase: str | None = None
    """The job's phase after the pass."""


class Reconciler:
    """Reconciles jobs; one instance per operator process."""

    def __init__(
        self, api: ClusterApi, options: OperatorOptions, catalog: Catalog | None = None
    ) -> None:
        self.api = api
        self.options = options
        self.catalog = catalog
        self.nodes = NodeSnapshot(
            api.list_nodes, api.get_node, ttl=max(1.0, options.resync_seconds)
        )
        # Re-entrant: a first pass holds it through planning and creating its pods, and
        # creating pods takes it again (for replacements, harmlessly).
        self.planning = threading.RLock()
        # Threads that create a job's stage pods side by side.
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="create")
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # Model configs by URI: small, immutable in practice, and re-read after a restart.
        self._model_configs: dict[str, JsonDict] = {}

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """Drop what was kept for a deleted job (its lock, its phase in the metrics)."""
        with self._locks_guard:
            self._locks.pop((namespace, name), None)
        metrics.record_phase(namespace, name, None)

    def reconcile(self, namespace: str, name: str, now: datetime | None = None) -> Outcome:
        """One pass over the job `namespace/name`."""
        with self._lock(namespace, name), metrics.timed_reconcile():
            job = self.api.get_job(namespace, name)
            if job is None or job["metadata"].get("deletionTimestamp"):
                metrics.record_phase(namespace, name, None)
                return Outcome(job=None)
            run = _Pass(self, job, now or datetime.now(UTC))
            run.execute()
            metrics.record_phase(namespace, name, run.phase)
            return Outcome(job=job, events=run.events, phase=run.phase)

    # --- reads the passes share ---------------------------------------------------

    def store_access(self, job: FineTuneJob) -> StoreAccess:
        """Endpoint and credentials of the job's object store (from its Secret)."""
        checkpoint = job.spec.checkpoint
        ref = checkpoint.credentials_secret
        access_key = secret_key = None
        if ref is not None:
            namespace = job.metadata.namespace
            access_key = self.api.get_secret_value(namespace, ref.name, ref.access_key_key)
            secret_key = self.api.get_secret_value(namespace, ref.name, ref.secret_key_key)
        return StoreAccess(checkpoint.endpoint, access_key, secret_key)

    def model_config(self, job: FineTuneJob) -> JsonDict:
        """The base model's config.json. Raises StoreError when it cannot be read."""
        uri = job.spec.model.uri
        if uri in self._model_configs:
            return self._model_configs[uri]
        if uri.startswith("hf://"):
            raise StoreError(
                f"spec.model.uri {uri}: the operator plans from the model's config.json and "
                f"has no hub access; copy the model to an s3:// prefix"
            )
        access = self.store_access(job) if is_s3(uri) else None
        config = read_json(uri, "config.json", access)
        if config is None:
            raise StoreError(f"spec.model.uri {uri} has no config.json")
        self._model_configs[uri] = config
        return config


class _Pass:
    """The state of one reconciliation pass."""

    def __init__(self, owner: Reconciler, job: JsonDict, now: datetime) -> None:
        self.owner = owner
        self.api = owner.api
        self.job = job
        self.now = now
        self.namespace: str = job["metadata"]["namespace"]
        self.name: str = job["metadata"]["name"]
        self.generation: int | None = job["metadata"].get("generation")
        self.old: JsonDict = dict(job.get("status") or {})
        self.status: JsonDict = {k: v for k, v in self.old.items() if k != "kopf"}
        self.events: list[JobEvent] = []
        self.phase: str | None = self.old.get("phase")

    # --- the pass ---------------------------------------------------------------------

    def execute(self) -> None:
        try:
            parsed = parse_job(self.job)
            # Valid for the API server, but not something the planner and worker can run
            # (e.g. a LoRA target that is no linear layer of a Llama-family model).
            training_shape(parsed)
        except (SpecError, ValueError) as err:
            self.settle(Verdict("Failed", False, False, "InvalidSpec", str(err)))
            return
        if is_terminal(self.old):
            self.remove_pods()
            return
        if parsed.spec.suspend:
            self.remove_pods()
            self.status["stages"] = [_idle(s) for s in self.status.get("stages") or []]
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
        started = self.status.get("plan") and self.status.get("startTime")
        with nullcontext() if started else self.owner.planning:
            if not started and not self.plan(parsed):
                return
            self.run_stages(parsed)

    def plan(self, job: FineTuneJob) -> bool:
        """Plan the job and record the plan; False (with a condition) when it cannot."""
        try:
            config = self.owner.model_config(job)
        except StoreError as err:
            self.settle(Verdict("Pending", False, False, "ModelUnavailable", str(err)))
            return False
        # Nodes may be a few seconds old (they change slowly); pods must be fresh, they
        # say which GPUs the jobs planned just before this one hold.
        nodes = self.owner.nodes.all()
        pods = self.api.list_active_pods()
        options = self.owner.options
        try:
            planned = make_plan(
                job,
                config,
                nodes,
                pods,
                catalog=self.owner.catalog,
                default_link=(options.default_link_mbps, options.default_link_latency_ms),
            )
        except PlanError as err:
            self.status.pop("plan", None)
            self.settle(Verdict("Pending", False, False, "Unschedulable", str(err)))
            return False
        logger.info(
            "Planned FineTuneJob %s/%s: %d stages.",
            self.namespace,
            self.name,
            len(planned["stages"]),
        )
        self.status["plan"] = planned
        self.status["startTime"] = rfc3339(self.now)
        self.status["stages"] = [
            {"index": s["index"], "pool": s["pool"], "restarts": 0} for s in planned["stages"]
        ]
        pools = " → ".join(
            f"{s['pool']}[{s['layerStart']}:{s['layerEnd']})" for s in planned["stages"]
        )
        self.events.append(
            JobEvent("Normal", "Planned", f"Planned {len(planned['stages'])} stages: {pools}.")
        )
        # The plan is recorded before any pod exists: a restart after this point builds
        # the same pods from it.
        self.settle(Verdict("Planning", False, True, "Planned", "Creating the stage pods."))
        return True

    def run_stages(self, job: FineTuneJob) -> None:
        plan = self.status["plan"]
        pods = self._pods_by_stage()
        records = {int(e["index"]): e for e in self.status.get("stages") or [] if "index" in e}
        limit = job.spec.failure_policy.max_stage_restarts
        grace = timedelta(seconds=self.owner.options.node_lost_seconds)
        decisions: dict[int, StageDecision] = {}
        entries: dict[int, JsonDict] = {}
        counted = False
        for planned in plan["stages"]:
            k = int(planned["index"])
            entry = dict(records.get(k) or {"index": k, "pool": planned["pool"], "restarts": 0})
            record = StageRecord.from_status(entry)
            pod = pods.get(k)
            node_name = ((pod or {}).get("spec") or {}).get("nodeName")
            node = self.owner.nodes.get(node_name) if node_name else None
            decision = decide(record, pod, node, now=self.now, node_grace=grace)
            if decision.failure is not None:
                if record.restarts >= limit:
                    self.fail(k, decision.failure, record.restarts, limit)
                    return
                counted = True
                entry.update(
                    restarts=record.restarts + 1, phase=REPLACING, lastFailure=decision.failure
                )
                metrics.STAGE_RESTARTS.labels(namespace=self.namespace).inc()
                self.events.append(
                    JobEvent(
                        "Warning",
                        "StageRestarting",
                        f"Stage {k} pod {stage_pod_name(self.name, k)} ended "
                        f"({decision.failure}); replacing it (restart {record.restarts + 1} of "
                        f"{limit}).",
                    )
                )
            decisions[k] = decision
            entries[k] = entry
        if counted:
            # Count first, then delete: see recovery.py for why this order is crash-safe.
            self.status["stages"] = [entries[k] for k in sorted(entries)]
            self.patch()
        for k, decision in decisions.items():
            pod = pods.get(k)
            if decision.action == "delete" and pod is not None:
                self.api.delete_pod(
                    self.namespace,
                    pod["metadata"]["name"],
                    pod["metadata"]["uid"],
                    force=decision.force,
                )
        creating = [k for k, d in decisions.items() if d.action == "create"]
        if creating:
            self.create_stages(job, creating, entries, counted)
        for k, entry in entries.items():
            pod = pods.get(k)
            if decisions[k].action == "keep" and pod is not None:
                entries[k] = {
                    **entry,
                    **stage_entry(
                        k,
                        pod,
                        pool=pod["metadata"]
                        .get("annotations", {})
                        .get(POOL_ANNOTATION, entry.get("pool")),
                        restarts=int(entry.get("restarts", 0)),
                    ),
                }
        self.status["stages"] = [entries[k] for k in sorted(entries)]
        if self.follow_progress(job, pods):
            return
        self.settle(running_verdict(self.status["stages"]))

    # --- children ---------------------------------------------------------------------

    def create_stages(
        self, job: FineTuneJob, stages: list[int], entries: dict[int, JsonDict], counted_now: bool
    ) -> None:
        """Create the pods of `stages` (and the Service and link Secret they need).

        A replacement waits spec.failurePolicy.backoffSeconds from the failure, measured
        from when the Ready condition turned to StageRestarting (kept in the cluster).
        """
        backoff = timedelta(seconds=job.spec.failure_policy.backoff_seconds)
        ready = condition(self.old, READY) or {}
        failed_at = (
            parse_time(ready.get("lastTransitionTime"))
            if (ready.get("reason") == "StageRestarting")
            else None
        )
        if counted_now:
            failed_at = self.now

        def is_due(k: int) -> bool:
            if int(entries[k].get("restarts", 0)) == 0 or backoff.total_seconds() == 0:
                return True
            return failed_at is not None and self.now - failed_at >= backoff

        due = [k for k in stages if is_due(k)]
        if not due:
            return
        self.api.create(build_link_secret(self.job, secrets.token_urlsafe(32)))
        self.api.create(build_service(self.job))
        # A replacement looks at the nodes as they are now (one may just have joined), and
        # takes the planning lock: choosing its pool and creating its pod must not
        # interleave with another job being planned onto the same free GPUs.
        replacing = any(int(entries[k].get("restarts", 0)) for k in due)
        with self.owner.planning if replacing else nullcontext():
            nodes = self.owner.nodes.refresh() if replacing else self.owner.nodes.all()
            self._create_pods(job, due, entries, nodes)

    def _create_pods(
        self,
        job: FineTuneJob,
        due: list[int],
        entries: dict[int, JsonDict],
        nodes: list[JsonDict],
    ) -> None:
        plan = self.status["plan"]
        configs = build_stage_configs(
            job, plan, pod_endpoints(self.name, self.namespace, len(plan["stages"]))
        )
        label = job.spec.placement.gpu_label
        rooms = None
        built: dict[int, tuple[str, JsonDict]] = {}
        for k in due:
            entry = entries[k]
            planned = plan["stages"][k]
            need = int(planned.get("predictedMemoryBytes") or DEFAULT_MEMORY_BYTES)
            pool = entry.get("pool") or planned["pool"]
            restarts = int(entry.get("restarts", 0))
            if restarts:
                if rooms is None:
                    free = free_nodes(nodes, self.api.list_active_pods(), label)
                    rooms = pool_rooms(free, label)
                pool = choose_pool(pool, -(-need // MIB), rooms, allowed=job.spec.placement.pools)
            selector = {**pool_selector(pool, nodes, label), **job.spec.placement.node_selector}
            pod = build_stage_pod(
                self.job,
                self._pod_inputs(
                    job, k, pool=pool, selector=selector, need=need, config=configs[k]
                ),
            )
            pod["metadata"]["annotations"][INCARNATION_ANNOTATION] = str(restarts)
            built[k] = (pool, pod)
        # The stages' pods are independent: create them side by side (a job's pods then
        # appear in one round trip, not one per stage).
        created = dict(
            zip(
                built,
                self.owner.pool.map(self.api.create, [p for _, p in built.values()]),
                strict=True,
            )
        )
        committed = (self.status.get("progress") or {}).get("lastCommittedStep")
        if any(int(entries[k].get("restarts", 0)) for k in built) and is_s3(
            job.spec.checkpoint.uri
        ):
            # A replacement restores the newest commit in the store, which can be newer
            # than the progress this job's status last folded in.
            fresh = read_progress(job, self.owner.store_access(job), self.now)
            if fresh is not None:
                committed = fresh.status.get("lastCommittedStep", committed)
        for k, (pool, pod) in built.items():
            if not created[k]:
                continue
            entry = entries[k]
            entry.update(pool=pool, phase="Pending", pod=pod["metadata"]["name"], ready=False)
            entry.pop("node", None)
            if int(entry.get("restarts", 0)) and committed is not None:
                entry["restoredFromStep"] = committed

    def _pod_inputs(
        self,
        job: FineTuneJob,
        k: int,
        *,
        pool: str,
        selector: dict[str, str],
        need: int,
        config: JsonDict,
    ) -> StagePodInputs:
        ref = job.spec.checkpoint.credentials_secret
        placement = job.spec.placement
        return StagePodInputs(
            index=k,
            pool=pool,
            node_selector=selector,
            memory_bytes=need,
            stage_config=config,
            image=job.spec.image or self.owner.options.worker_image,
            credentials=CredentialsRef(ref.name, ref.access_key_key, ref.secret_key_key)
            if ref is not None
            else None,
            tolerations=[
                t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations
            ],
            priority_class_name=placement.priority_class_name,
        )

    def _pods_by_stage(self) -> dict[int, JsonDict]:
        pods: dict[int, JsonDict] = {}
        for pod in self.api.list_stage_pods(self.namespace, self.name):
            raw = (pod["metadata"].get("labels") or {}).get(STAGE_LABEL, "")
            if raw.isdigit():
                pods[int(raw)] = pod
        return pods

    def remove_pods(self) -> None:
        for pod in self.api.list_stage_pods(self.namespace, self.name):
            if not pod["metadata"].get("deletionTimestamp"):
                self.api.delete_pod(self.namespace, pod["metadata"]["name"], pod["metadata"]["uid"])

    # --- outcomes ---------------------------------------------------------------------

    def fail(self, stage: int, failure: str, restarts: int, limit: int) -> None:
        """The policy allows no more restarts: the job is Failed and its pods go."""
        self.remove_pods()
        self.status["stages"] = [_idle(s) for s in self.status.get("stages") or []]
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

    def follow_progress(self, job: FineTuneJob, pods: dict[int, JsonDict]) -> bool:
        """Fold progress.json into status; True if the job finished (and was settled)."""
        progress = None
        if is_s3(job.spec.checkpoint.uri):
            progress = read_progress(job, self.owner.store_access(job), self.now)
        if progress is not None:
            self.status["progress"] = progress.status
        stages = self.status.get("stages") or []
        all_done = (
            bool(stages)
            and len(pods) == len(stages)
            and all((p.get("status") or {}).get("phase") == "Succeeded" for p in pods.values())
        )
        if not (progress is not None and progress.done) and not all_done:
            return False
        self.status["output"] = {
            "uri": (progress.output if progress is not None and progress.output else None)
            or output_uri(job)
        }
        self.remove_pods()
        self.status["stages"] = [_idle(s) for s in stages]
        self.settle(
            Verdict(
                "Succeeded",
                True,
                False,
                "Succeeded",
                f"Training finished; the result is at {self.status['output']['uri']}.",
            )
        )
        return True

    def settle(self, verdict: Verdict) -> None:
        """Apply the verdict to status, patch what changed, and note an Event if due."""
        old_ready = condition(self.old, READY) or {}
        self.status = with_verdict(self.status, verdict, self.now, self.generation)
        self.phase = verdict.phase
        kind = EVENT_REASONS.get(verdict.reason)
        moved = (old_ready.get("reason"), old_ready.get("message")) != (
            verdict.reason,
            verdict.message,
        )
        if kind and moved and verdict.reason != "Planned":
            self.events.append(JobEvent(kind, verdict.reason, verdict.message))
        self.patch()

    def patch(self) -> None:
        new = finalize(self.status)
        patch = changes(self.old, new)
        if patch:
            self.api.patch_job_status(self.namespace, self.name, patch)
            self.old = {**self.old, **{k: v for k, v in patch.items() if v is not None}}
            for key, value in patch.items():
                if value is None:
                    self.old.pop(key, None)
        self.status = new


def _idle(entry: JsonDict) -> JsonDict:
    """A stage entry with no pod (suspended, finished or failed job)."""
    kept = ("index", "pool", "restarts", "lastFailure", "restoredFromStep")
    return {k: v for k, v in entry.items() if k in kept}
