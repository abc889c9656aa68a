"""GPU room in the cluster, from nodes and pods (pure: dicts in, values out).

The planner turns nodes into pools (`planner.pools_from_nodes`); this module first takes
away what other pods already hold, so a job is planned only onto GPUs that are free:
a node's allocatable `nvidia.com/gpu` minus the GPU requests of the pods bound to it, and
a pool's room minus pods that are pinned to it but not yet bound (the operator's own
pending stage pods), so two jobs planned one after the other do not both count one GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from relaytrain_operator.builders.labels import JOB_LABEL, POOL_ANNOTATION

GPU_RESOURCE = "nvidia.com/gpu"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
POOL_LABEL = "relaytrain.io/pool"
"""Node label naming a pool; without it a node's pool is its GPU label's value (as the
planner's `pools_from_nodes` groups them)."""

JsonDict = dict[str, Any]


def _quantity(value: Any) -> int:
    """A GPU count quantity ("1", 2) as an int; GPUs are whole."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def node_ready(node: JsonDict) -> bool:
    """True if the node reports Ready and is not cordoned."""
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def pod_gpus(pod: JsonDict) -> int:
    """GPUs a pod holds (its containers' requests, falling back to limits)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("requests") or {}).get(GPU_RESOURCE)
        if value is None:
            value = (resources.get("limits") or {}).get(GPU_RESOURCE)
        total += _quantity(value or 0)
    return total


def node_pool(node: JsonDict, label_key: str) -> str | None:
    """The pool a node belongs to (None: not a GPU node under `label_key`)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if label_key not in labels:
        return None
    return str(labels.get(POOL_LABEL) or labels[label_key])


def pool_selector(pool: str, nodes: Iterable[JsonDict], label_key: str) -> dict[str, str]:
    """The nodeSelector that pins a pod to `pool`: the GPU label's value, plus the pool
    label where the nodes carry one (pools named apart from their product)."""
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if label_key in labels and labels.get(POOL_LABEL) == pool:
            return {label_key: labels[label_key], POOL_LABEL: pool}
    return {label_key: pool}


def _belongs_to(pod: JsonDict, job: tuple[str, str] | None) -> bool:
    if job is None:
        return False
    meta = pod.get("metadata") or {}
    return meta.get("namespace") == job[0] and (meta.get("labels") or {}).get(JOB_LABEL) == job[1]


def _is_active(pod: JsonDict) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _slim(node: JsonDict, free_gpus: int) -> JsonDict:
    """The parts of a node the planner reads, with `free_gpus` as its allocatable GPUs.

    A fresh small dict, not a deep copy: planning runs once per job over every node, and
    copying whole Node objects (conditions, images, managed fields) dominated its time.
    """
    meta = node.get("metadata") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
        },
        "spec": {"unschedulable": bool((node.get("spec") or {}).get("unschedulable"))},
        "status": {"allocatable": {GPU_RESOURCE: str(free_gpus)}},
    }


def free_nodes(
    nodes: Iterable[JsonDict],
    pods: Iterable[JsonDict],
    label_key: str,
    exclude_job: tuple[str, str] | None = None,
) -> list[JsonDict]:
    """Ready GPU nodes carrying `label_key`, each a copy whose allocatable GPUs are free ones.

    Pods pinned to a pool but not yet bound (the operator's own pending stage pods carry
    the pool annotation) count against that pool. Pods of `exclude_job` (namespace, name)
    do not count as holding GPUs: when a job is
    (re)planned, its own stages' GPUs are its to use.
    """
    bound: dict[str, int] = defaultdict(int)
    pinned: dict[str, int] = defaultdict(int)
    for pod in pods:
        if not _is_active(pod) or _belongs_to(pod, exclude_job):
            continue
        gpus = pod_gpus(pod)
        if not gpus:
            continue
        spec = pod.get("spec") or {}
        if spec.get("nodeName"):
            bound[spec["nodeName"]] += gpus
        elif POOL_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}):
            pinned[pod["metadata"]["annotations"][POOL_ANNOTATION]] += gpus

    result: list[JsonDict] = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if label_key not in labels or not node_ready(node):
            continue
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        free = _quantity(allocatable.get(GPU_RESOURCE, 0)) - bound[node["metadata"]["name"]]
        if free <= 0:
            continue
        result.append(_slim(node, free))

    # Pods pinned to a pool but not yet bound take their GPUs from that pool's nodes,
    # fullest-first, the way the scheduler is about to.
    for node in sorted(result, key=lambda n: -_quantity(n["status"]["allocatable"][GPU_RESOURCE])):
        pool = node_pool(node, label_key) or ""
        if not pinned.get(pool):
            continue
        free = _quantity(node["status"]["allocatable"][GPU_RESOURCE])
        taken = min(free, pinned[pool])
        pinned[pool] -= taken
        node["status"]["allocatable"][GPU_RESOURCE] = str(free - taken)
    return [n for n in result if _quantity(n["status"]["allocatable"][GPU_RESOURCE]) > 0]


@dataclass(frozen=True)
class PoolRoom:
    """Free GPUs of one pool and the memory of each."""

    free_gpus: int
    """GPUs free now across the pool's ready nodes."""
    memory_mib: int
    """Memory of one GPU of the pool (smallest node label seen; 0 if unlabelled)."""


def pool_rooms(free: Iterable[JsonDict], label_key: str) -> dict[str, PoolRoom]:
    """Per pool (value of `label_key`): free GPUs and GPU memory, from `free_nodes` output."""
    gpus: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = {}
    for node in free:
        labels = node["metadata"]["labels"]
        pool = node_pool(node, label_key) or ""
        gpus[pool] += _quantity(node["status"]["allocatable"][GPU_RESOURCE])
        mib = _quantity(labels.get(GPU_MEMORY_LABEL, 0))
        memory[pool] = min(memory.get(pool, mib), mib)
    return {pool: PoolRoom(gpus[pool], memory[pool]) for pool in gpus}


def choose_pool(
    current: str,
    need_mib: int,
    rooms: dict[str, PoolRoom],
    catalog_memory: dict[str, int] | None = None,
    allowed: Iterable[str] = (),
) -> str:
    """Where a replaced stage goes: its own pool if it has a free GPU, else the
    compatible pool (GPU memory fits the stage) with the least memory that fits,
    keeping larger GPUs for stages that need them. With no room anywhere the stage
    stays on its pool and waits there for a GPU.
    """
    if rooms.get(current, PoolRoom(0, 0)).free_gpus > 0:
        return current
    allowed_set = set(allowed)
    catalog_memory = catalog_memory or {}
    fits = [
        (room.memory_mib or catalog_memory.get(pool, 0), pool)
        for pool, room in rooms.items()
        if room.free_gpus > 0
        and (not allowed_set or pool in allowed_set)
        and (room.memory_mib or catalog_memory.get(pool, 0)) >= need_mib
    ]
    return min(fits)[1] if fits else current
