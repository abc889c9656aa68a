"""Kueue: a FineTuneJob that names a LocalQueue is admitted through a Workload the operator
owns (pure: the Workload built, its admission read, the status patches that hand quota back).

The integration is Kueue's external-framework contract (docs/operator.md "Queueing with
Kueue"): the operator plays the part Kueue's own job reconcilers play for batch Jobs. A job
labelled `kueue.x-k8s.io/queue-name` gets one Workload per pipeline (one for the whole job
when it has one pipeline, or a store its stages cannot be told through), owned by the job
(the garbage collector deletes it with the job), with one pod set per GPU pool of that
pipeline (count: the stages placed there; the pod template: a stage's requests and the
pool's node selector, so the flavour Kueue assigns is one whose nodes are that pool). Kueue
then admits, preempts and re-admits a job's pipelines one by one. No stage pod exists until Kueue
reserves quota and admits it; the assigned flavours' node labels and tolerations are added
to every stage pod; a replaced stage keeps the admission (the Workload is untouched). When
Kueue evicts the workload (preempted by a higher priority, or deactivated), the stage pods go
and, once none is left, the operator hands the quota back (QuotaReserved False, the
admission cleared, as Kueue's reconcilers do); re-admitted, the stages restore the last
committed checkpoint. A finished job marks its Workload Finished, which frees the quota.

`spec.suspend` stays the user's: the operator does not rewrite the spec (a GitOps tool would
see it drift) but maps it onto the Workload's `spec.active`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relaytrain_operator.domain.builders.labels import PIPELINE_LABEL, job_labels, owner_reference
from relaytrain_operator.domain.builders.pod import memory_request

JsonDict = dict[str, Any]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The LocalQueue a job is submitted to (Kueue's own label)."""
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""A WorkloadPriorityClass for the job's Workload (Kueue's own label)."""
GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"
"""v1beta2: the version Kueue v0.15's controllers read and write."""
FLAVORS = "resourceflavors"
PRIORITY_CLASSES = "workloadpriorityclasses"
ADMISSION_MANAGER = "kueue-admission"
"""The field manager Kueue writes admissions with: the operator hands quota back under the
same name, so the apply removes the admission that manager owns."""
FINISHED_MANAGER = "relaytrain-operator"
MAX_POD_SETS = 8
"""Kueue's limit on a Workload's pod sets."""
ADMISSION_CONDITIONS = (
    "QuotaReserved",
    "Evicted",
    "Admitted",
    "Preempted",
    "Requeued",
    "DeactivationTarget",
)
"""The conditions Kueue's admission manager owns (kept as they are when quota is handed
back, but QuotaReserved and Admitted)."""


class QueueError(ValueError):
    """A plan Kueue cannot hold as one Workload."""


def queue_name(job: Mapping[str, Any]) -> str | None:
    """The LocalQueue the job is submitted to, or None when Kueue is not asked."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    name = labels.get(QUEUE_LABEL)
    return str(name) if name else None


def workload_name(job_name: str, pipeline: int | None = None) -> str:
    """The Workload of job `job_name`, or of its pipeline `pipeline` (Kueue's own naming:
    kind, name, a short hash)."""
    if pipeline is None:
        digest = hashlib.sha256(f"finetunejob/{job_name}".encode()).hexdigest()[:5]
        return f"finetunejob-{job_name[:230]}-{digest}"
    digest = hashlib.sha256(f"finetunejob/{job_name}/{pipeline}".encode()).hexdigest()[:5]
    return f"finetunejob-{job_name[:220]}-p{pipeline}-{digest}"


def workload_names(job_name: str, pipelines: int | None) -> dict[int, str]:
    """The job's Workloads by pipeline: one per pipeline for `pipelines` of them, or (None)
    the job's one Workload, under 0."""
    if pipelines is None:
        return {0: workload_name(job_name)}
    return {p: workload_name(job_name, p) for p in range(pipelines)}


def by_pipeline(found: Iterable[JsonDict]) -> tuple[bool | None, dict[int, JsonDict]]:
    """The job's Workloads as listed (by its label): whether they are one per pipeline (None
    when there are none yet), and them by pipeline (the job's one Workload under 0).

    A job keeps the layout it was queued with: where the job's one Workload exists (queued
    by an operator from before Workloads per pipeline, 2026-11-28), it holds the job, so
    that its admission and quota are the job's rather than left behind beside new ones."""
    workloads = list(found)
    whole = [w for w in workloads if PIPELINE_LABEL not in (w["metadata"].get("labels") or {})]
    if whole:
        return False, {0: whole[0]}
    if not workloads:
        return None, {}
    return True, {int(w["metadata"]["labels"][PIPELINE_LABEL]): w for w in workloads}


def _pod_set_name(pool: str, taken: set[str]) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", pool.lower()).strip("-")[:55] or "pool"
    base, n = name, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


@dataclass(frozen=True)
class StageDemand:
    """What one planned stage asks of the cluster."""

    pool: str
    selector: Mapping[str, str]
    """The node selector that pins it to its pool."""
    memory_bytes: int


def build_workload(
    job: JsonDict,
    stages: Sequence[StageDemand],
    *,
    active: bool,
    tolerations: Sequence[JsonDict] = (),
    priority_class_name: str | None = None,
    priority: int | None = None,
    pipeline: int | None = None,
    gpu_resource: str = "nvidia.com/gpu",
) -> JsonDict:
    """The Workload of the job (or of its pipeline `pipeline`) for `stages`: one pod set per
    pool, in the order the plan first uses them. `priority`: the value of the
    WorkloadPriorityClass the job's priority label names (Kueue orders and preempts by
    spec.priority; the class is only its name)."""
    pools: dict[str, list[StageDemand]] = {}
    for stage in stages:
        pools.setdefault(stage.pool, []).append(stage)
    if len(pools) > MAX_POD_SETS:
        raise QueueError(
            f"metadata.labels[{QUEUE_LABEL}]: the plan spans {len(pools)} GPU pools and a Kueue "
            f"Workload holds at most {MAX_POD_SETS} pod sets; narrow spec.placement.pools or "
            f"submit the job without a queue"
        )
    meta = job["metadata"]
    taken: set[str] = set()
    pod_sets = []
    for pool, demands in pools.items():
        # What each stage pod requests (builders.pod): the pod set's pods must ask no more.
        amount = {gpu_resource: "1", "memory": memory_request(max(d.memory_bytes for d in demands))}
        spec: JsonDict = {
            "restartPolicy": "Never",
            "nodeSelector": dict(demands[0].selector),
            "containers": [
                {"name": "worker", "resources": {"requests": amount, "limits": dict(amount)}}
            ],
        }
        if tolerations:
            spec["tolerations"] = [dict(t) for t in tolerations]
        if priority_class_name:
            spec["priorityClassName"] = priority_class_name
        pod_sets.append(
            {
                "name": _pod_set_name(pool, taken),
                "count": len(demands),
                "template": {"metadata": {"labels": {"relaytrain.io/pool": pool}}, "spec": spec},
            }
        )
    labels = {
        **job_labels(meta["name"]),
        **{k: v for k, v in (meta.get("labels") or {}).items() if k == PRIORITY_LABEL},
    }
    if pipeline is not None:
        labels[PIPELINE_LABEL] = str(pipeline)
    workload: JsonDict = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(meta["name"], pipeline),
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "queueName": queue_name(job),
            "podSets": pod_sets,
            "active": active,
        },
    }
    priority_class = priority_class_of(job)
    if priority_class:
        workload["spec"]["priorityClassRef"] = {
            "group": GROUP,
            "kind": "WorkloadPriorityClass",
            "name": priority_class,
        }
        workload["spec"]["priority"] = priority or 0
    return workload


def priority_class_of(job: Mapping[str, Any]) -> str | None:
    """The WorkloadPriorityClass the job's label names, if any."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    name = labels.get(PRIORITY_LABEL)
    return str(name) if name else None


def _condition(workload: Mapping[str, Any], kind: str) -> JsonDict | None:
    conditions = (workload.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def _true(workload: Mapping[str, Any], kind: str) -> bool:
    found = _condition(workload, kind)
    return found is not None and found.get("status") == "True"


@dataclass(frozen=True)
class Admission:
    """Where the job's Workload stands with Kueue."""

    state: str
    """missing, pending (no quota yet), admitted, evicted (must stop and hand the quota
    back) or released (evicted, quota handed back, waiting to be admitted again)."""
    reason: str = ""
    message: str = ""
    pool_flavors: Mapping[str, str] = field(default_factory=dict)
    """pool → the flavour Kueue assigned to its pod set (its GPU resource's)."""
    pool_counts: Mapping[str, int] = field(default_factory=dict)
    """pool → the pods its admitted pod set holds (what Kueue granted there)."""
    active: bool = True
    """The Workload's spec.active."""

    def why_out(self) -> str:
        """Why a pipeline whose Workload this is does not train (it is not admitted)."""
        if self.state in ("evicted", "released"):
            return f"Kueue evicted its Workload ({self.reason}: {self.message})"
        if self.message:
            return f"its Workload waits for Kueue ({self.message})"
        return "its Workload waits for Kueue to admit it"


def read_admission(
    workload: Mapping[str, Any] | None, gpu_resource: str = "nvidia.com/gpu"
) -> Admission:
    """The job's standing with Kueue from its Workload (None: not created yet)."""
    if workload is None:
        return Admission("missing")
    active = bool((workload.get("spec") or {}).get("active", True))
    reserved = _true(workload, "QuotaReserved")
    evicted = _condition(workload, "Evicted")
    if evicted is not None and evicted.get("status") == "True":
        state = "evicted" if reserved else "released"
        return Admission(
            state,
            str(evicted.get("reason") or ""),
            str(evicted.get("message") or ""),
            active=active,
        )
    if reserved and _true(workload, "Admitted"):
        flavors: dict[str, str] = {}
        counts: dict[str, int] = {}
        pod_sets = (workload.get("spec") or {}).get("podSets") or []
        names = {
            p["name"]: ((p.get("template") or {}).get("metadata") or {})
            .get("labels", {})
            .get("relaytrain.io/pool")
            for p in pod_sets
        }
        sizes = {p["name"]: int(p.get("count", 1)) for p in pod_sets}
        admission = (workload.get("status") or {}).get("admission") or {}
        for assigned in admission.get("podSetAssignments") or []:
            pool = names.get(assigned.get("name"))
            flavor = (assigned.get("flavors") or {}).get(gpu_resource)
            if pool and flavor:
                flavors[str(pool)] = str(flavor)
                count = assigned.get("count", sizes.get(assigned.get("name"), 0))
                counts[str(pool)] = counts.get(str(pool), 0) + int(count)
        queue = admission.get("clusterQueue", "")
        return Admission(
            "admitted", "Admitted", f"Admitted by ClusterQueue {queue}", flavors, counts, active
        )
    pending = _condition(workload, "QuotaReserved")
    return Admission(
        "pending",
        str((pending or {}).get("reason") or "Pending"),
        str((pending or {}).get("message") or ""),
        active=active,
    )


def release_quota(workload: Mapping[str, Any], now: str) -> JsonDict:
    """The server-side apply (as Kueue's admission manager) that hands an evicted workload's
    quota back: QuotaReserved and Admitted False, the admission gone, the other admission
    conditions (Evicted, Preempted, ...) kept as Kueue wrote them."""
    evicted = _condition(workload, "Evicted") or {}
    message = str(evicted.get("message") or "Evicted")
    generation = (workload.get("metadata") or {}).get("generation")
    kept = []
    for kind in ADMISSION_CONDITIONS:
        found = _condition(workload, kind)
        if kind in ("QuotaReserved", "Admitted"):
            reason = "Pending" if kind == "QuotaReserved" else "NoReservation"
            kept.append(
                {
                    "type": kind,
                    "status": "False",
                    "reason": reason,
                    "message": message[:32768],
                    "lastTransitionTime": now,
                    "observedGeneration": generation,
                }
            )
        elif found is not None:
            kept.append(dict(found))
    status: JsonDict = {"conditions": kept}
    old = workload.get("status") or {}
    for key in ("requeueState", "accumulatedPastExecutionTimeSeconds", "schedulingStats"):
        if old.get(key) is not None:
            status[key] = old[key]
    return _apply(workload, status)


def finished(workload: Mapping[str, Any], succeeded: bool, message: str, now: str) -> JsonDict:
    """The server-side apply that marks the workload Finished (Kueue frees its quota)."""
    condition = {
        "type": "Finished",
        "status": "True",
        "reason": "Succeeded" if succeeded else "Failed",
        "message": message[:32768],
        "lastTransitionTime": now,
        "observedGeneration": (workload.get("metadata") or {}).get("generation"),
    }
    return _apply(workload, {"conditions": [condition]})


def _apply(workload: Mapping[str, Any], status: JsonDict) -> JsonDict:
    meta = workload.get("metadata") or {}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
        "status": status,
    }


def flavor_placement(flavor: Mapping[str, Any]) -> tuple[dict[str, str], list[JsonDict]]:
    """A ResourceFlavor's node labels and tolerations, which its pods get (as Kueue adds
    them to an admitted Job's pods)."""
    spec = flavor.get("spec") or {}
    labels = {str(k): str(v) for k, v in (spec.get("nodeLabels") or {}).items()}
    return labels, [dict(t) for t in spec.get("tolerations") or []]
