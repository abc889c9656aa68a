"""Where stages may go (pure: node and pod dicts in, values out).

One module answers "which nodes may this job use, what is free on them, and where does a
replaced stage go", for the three callers that place stages: the first plan
(`planning.make_plan`), the replacement of a failed stage (`decide`), and `relaytrain plan`.

- Eligible: a node carrying the job's GPU label (`spec.placement.gpuLabel`), in one of
  `spec.placement.pools` when the list is not empty (a pool is named by its
  `relaytrain.io/pool` label or its GPU label value), carrying every label of
  `spec.placement.nodeSelector`, with no NoSchedule/NoExecute taint the job's tolerations
  do not tolerate, and (for a live cluster) Ready and not cordoned.
- Free: a node's allocatable `nvidia.com/gpu` minus the GPU requests of the active pods
  bound to it; a pool's room minus pods pinned to it but not yet bound (the operator's own
  pending stage pods), so two jobs placed one after the other do not both count one GPU.
- GPU memory: the node's `nvidia.com/gpu.memory` label, else the catalog's value for its
  product.
- The replacement: its own pool when that has a free GPU; else the eligible pool with a
  free GPU whose memory fits the stage, smallest memory first (larger GPUs stay for stages
  that need them); else it waits on its own pool, and `Choice.why` says why.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from relaytrain_operator.domain.builders.labels import JOB_LABEL, POOL_ANNOTATION
from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    Catalog,
    PlanError,
    Pool,
    UnknownGpuError,
    pools_from_file,
)
from relaytrain_operator.domain.planner.cost import CostSettings
from relaytrain_operator.domain.planner.pools import GPU_RESOURCE, MEMORY_LABEL, POOL_LABEL
from relaytrain_operator.domain.planner.pools import pools_from_nodes as _pools_from_nodes
from relaytrain_operator.spec import FineTuneJob, PlacementSpec, Toleration

__all__ = [
    "GPU_RESOURCE",
    "POOL_LABEL",
    "Choice",
    "PoolRoom",
    "choose_pool",
    "eligible_nodes",
    "file_pools",
    "free_nodes",
    "job_pools",
    "node_pool",
    "node_ready",
    "place_replacements",
    "pod_gpus",
    "pool_rooms",
    "pool_selector",
    "usable_mib",
    "why_ineligible",
]

JsonDict = dict[str, Any]
Key = TypeVar("Key", int, tuple[int, int])
"""A replaced stage: its index, or (pipeline, stage)."""
MIB = 1024 * 1024
GIB = 1024 * MIB
# Taint effects that keep a pod off a node unless tolerated (PreferNoSchedule only prefers).
_REPELLING = ("NoSchedule", "NoExecute")


def _quantity(value: Any) -> int:
    """A GPU count quantity ("1", 2) as an int; GPUs are whole."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def node_ready(node: Mapping[str, Any]) -> bool:
    """True if the node reports Ready and is not cordoned."""
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def node_pool(node: Mapping[str, Any], label_key: str) -> str | None:
    """The pool a node belongs to (None: not a GPU node under `label_key`)."""
    labels = _labels(node)
    if label_key not in labels:
        return None
    return str(labels.get(POOL_LABEL) or labels[label_key])


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs a pod holds (its containers' requests, falling back to limits)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("requests") or {}).get(GPU_RESOURCE)
        if value is None:
            value = (resources.get("limits") or {}).get(GPU_RESOURCE)
        total += _quantity(value or 0)
    return total


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Toleration]) -> bool:
    """Kubernetes' rule: a toleration matches a taint's effect (empty: every effect) and
    its key and value (`Exists`: any value; `Exists` without a key: every taint)."""
    for t in tolerations:
        if t.effect is not None and t.effect != taint.get("effect"):
            continue
        if t.operator == "Exists":
            if t.key is None or t.key == taint.get("key"):
                return True
        elif t.key == taint.get("key") and (t.value or "") == (taint.get("value") or ""):
            return True
    return False


def why_ineligible(
    node: Mapping[str, Any],
    placement: PlacementSpec,
    *,
    require_ready: bool = True,
    dtype: str | None = None,
    catalog: Catalog | None = None,
) -> str | None:
    """Why the job may not use `node` (None: it may). `require_ready` is False for node
    lists read from a file, which carry no conditions. With `dtype`, a node whose GPU does
    not train in it natively (a V100 has no bfloat16) is not eligible either; a GPU the
    catalog lacks is not judged. Planning leaves `dtype` out: the planner drops such a pool
    itself and says so."""
    labels = _labels(node)
    label_key = placement.gpu_label
    if label_key not in labels:
        return f"no label {label_key}"
    pool = node_pool(node, label_key)
    if placement.pools and pool not in placement.pools and labels[label_key] not in placement.pools:
        return "not in spec.placement.pools"
    if dtype is not None:
        try:
            if not (catalog or DEFAULT_CATALOG)[labels[label_key]].supports(dtype):
                return f"no native {dtype} (spec.model.dtype)"
        except UnknownGpuError:
            pass
    for key, value in sorted(placement.node_selector.items()):
        if labels.get(key) != value:
            return f"no label {key}={value} (spec.placement.nodeSelector)"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in _REPELLING and not _tolerated(taint, placement.tolerations):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"taint {taint.get('key')}{value}:{taint.get('effect')} not tolerated"
    if require_ready and not node_ready(node):
        return "not Ready or cordoned"
    return None


def eligible_nodes(
    nodes: Iterable[Mapping[str, Any]],
    placement: PlacementSpec,
    *,
    require_ready: bool = True,
    dtype: str | None = None,
    catalog: Catalog | None = None,
) -> list[Mapping[str, Any]]:
    """The nodes a job with `placement` may use (`why_ineligible`)."""
    return [
        n
        for n in nodes
        if why_ineligible(n, placement, require_ready=require_ready, dtype=dtype, catalog=catalog)
        is None
    ]


def _belongs_to(pod: Mapping[str, Any], job: tuple[str, str] | None) -> bool:
    if job is None:
        return False
    meta = pod.get("metadata") or {}
    return meta.get("namespace") == job[0] and (meta.get("labels") or {}).get(JOB_LABEL) == job[1]


def _is_active(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _slim(node: Mapping[str, Any], free_gpus: int) -> JsonDict:
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
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    label_key: str,
    exclude_job: tuple[str, str] | None = None,
    *,
    require_ready: bool = True,
) -> list[JsonDict]:
    """GPU nodes carrying `label_key` (Ready ones, with `require_ready`), each a copy whose
    allocatable GPUs are the free ones; nodes with none free are left out.

    Pods pinned to a pool but not yet bound (the operator's own pending stage pods carry
    the pool annotation) count against that pool. Pods of `exclude_job` (namespace, name)
    do not count as holding GPUs: when a job is (re)planned, its own stages' GPUs are its
    to use.
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
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        if spec.get("nodeName"):
            bound[spec["nodeName"]] += gpus
        elif POOL_ANNOTATION in annotations:
            pinned[annotations[POOL_ANNOTATION]] += gpus

    result: list[JsonDict] = []
    # In name order, whatever order the nodes were listed in: which of a pool's equally
    # free nodes a pinned pod takes (and so the pool's memory, the plan and its message)
    # must not change from pass to pass.
    for node in sorted(nodes, key=lambda n: str((n.get("metadata") or {}).get("name"))):
        if label_key not in _labels(node) or (require_ready and not node_ready(node)):
            continue
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        free = _quantity(allocatable.get(GPU_RESOURCE, 0)) - bound[node["metadata"]["name"]]
        if free > 0:
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


def job_pools(
    job: FineTuneJob,
    nodes: Iterable[JsonDict],
    pods: Iterable[JsonDict],
    *,
    default_link: tuple[float, float] | None = None,
    require_ready: bool = True,
) -> list[Pool]:
    """The planner's pools for `job`: its eligible nodes' free GPUs (its own pods' GPUs
    count as free). Raises planner.PoolError for nodes that cannot be made pools of."""
    placement = job.spec.placement
    own = (job.metadata.namespace, job.metadata.name)
    eligible = eligible_nodes(nodes, placement, require_ready=require_ready)
    free = free_nodes(eligible, pods, placement.gpu_label, own, require_ready=require_ready)
    return _pools_from_nodes(free, placement.gpu_label, default_link=default_link)


def file_pools(
    job: FineTuneJob, doc: Any, *, default_link: tuple[float, float] | None = None
) -> list[Pool]:
    """The planner's pools for `job` from a nodes file (`relaytrain plan --nodes`).

    A node list goes through the job's placement like live nodes, but needs no conditions
    (files seldom carry them) and holds no pods. A pools file (hack/pools.yaml) has no node
    labels: only `spec.placement.pools` applies to it. Raises PlanError when the job may use
    none of them, planner.PoolError for input that is not nodes or pools.
    """
    placement = job.spec.placement
    label_key = placement.gpu_label
    if isinstance(doc, Mapping) and "pools" in doc:
        pools = pools_from_file(doc, label_key, default_link=default_link)
        kept = [
            p
            for p in pools
            if not placement.pools or p.name in placement.pools or p.product in placement.pools
        ]
        if not kept:
            names = ", ".join(sorted(p.name for p in pools))
            raise PlanError(
                f"spec.placement.pools {sorted(placement.pools)} matches none of the pools: "
                f"{names}."
            )
        return kept
    if isinstance(doc, Mapping) and isinstance(doc.get("items"), list):
        items: list[Any] = doc["items"]
    elif isinstance(doc, Mapping) and doc.get("kind") == "Node":
        items = [doc]
    elif isinstance(doc, list):
        items = doc
    else:
        return pools_from_file(doc, label_key, default_link=default_link)  # says what it wants
    nodes = [n for n in items if isinstance(n, Mapping)]
    eligible = eligible_nodes(nodes, placement, require_ready=False)
    gpu_nodes = [n for n in nodes if node_pool(n, label_key) is not None]
    if gpu_nodes and not eligible:
        reasons = "; ".join(
            f"{(n.get('metadata') or {}).get('name')}: "
            f"{why_ineligible(n, placement, require_ready=False)}"
            for n in gpu_nodes[:5]
        )
        raise PlanError(f"No node in the file is eligible for the job ({reasons}).")
    return pools_from_file(eligible, label_key, default_link=default_link)


def pool_selector(pool: str, nodes: Iterable[Mapping[str, Any]], label_key: str) -> dict[str, str]:
    """The nodeSelector that pins a pod to `pool`: the GPU label's value, plus the pool
    label where the nodes carry one (pools named apart from their product)."""
    for node in nodes:
        labels = _labels(node)
        if label_key in labels and labels.get(POOL_LABEL) == pool:
            return {label_key: labels[label_key], POOL_LABEL: pool}
    return {label_key: pool}


# --- the replacement of a failed stage ----------------------------------------------------


@dataclass(frozen=True)
class PoolRoom:
    """Free GPUs of one pool and the memory of each."""

    free_gpus: int
    """GPUs free now across the pool's eligible, ready nodes."""
    memory_mib: int
    """Memory of one GPU of the pool (the smallest seen; 0 if unknown)."""


def _memory_mib(node: Mapping[str, Any], label_key: str, catalog: Catalog) -> int:
    labels = _labels(node)
    mib = _quantity(labels.get(MEMORY_LABEL, 0))
    if mib:
        return mib
    try:
        return catalog[str(labels.get(label_key))].memory_mib
    except UnknownGpuError:
        return 0


def pool_rooms(
    free: Iterable[Mapping[str, Any]], label_key: str, catalog: Catalog | None = None
) -> dict[str, PoolRoom]:
    """Per pool: free GPUs and GPU memory, from `free_nodes` output."""
    catalog = catalog or DEFAULT_CATALOG
    gpus: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = {}
    for node in free:
        pool = node_pool(node, label_key) or ""
        gpus[pool] += _quantity(node["status"]["allocatable"][GPU_RESOURCE])
        mib = _memory_mib(node, label_key, catalog)
        memory[pool] = min(memory.get(pool, mib), mib)
    return {pool: PoolRoom(gpus[pool], memory[pool]) for pool in gpus}


def usable_mib(memory_mib: int) -> int:
    """What a plan may use of a GPU of ``memory_mib`` (the planner's margin and reserve):
    a stage planned for one pool fits another's GPU only within this."""
    return CostSettings().usable_bytes(memory_mib) // MIB


def choose_pool(current: str, need_mib: int, rooms: Mapping[str, PoolRoom]) -> str:
    """Where a replaced stage goes, among the eligible pools in `rooms`: its own pool if it
    has a free GPU, else the pool with a free GPU whose usable memory (`usable_mib`, what
    the planner would give a stage there) fits the stage, least memory first (ties by
    name), keeping larger GPUs for stages that need them. With no room anywhere the stage
    stays on its pool and waits there for a GPU.
    """
    if rooms.get(current, PoolRoom(0, 0)).free_gpus > 0:
        return current
    fits = [
        (room.memory_mib, pool)
        for pool, room in rooms.items()
        if room.free_gpus > 0 and usable_mib(room.memory_mib) >= need_mib
    ]
    return min(fits)[1] if fits else current


@dataclass(frozen=True)
class Choice:
    """Where one replaced stage goes."""

    pool: str
    """The pool its pod is pinned to."""
    free: bool
    """A GPU of that pool is free now; False: the pod waits on its own pool."""
    why: str = ""
    """When not free: why no eligible pool has room, for the job's condition and Event."""


def _why_no_room(
    job: FineTuneJob,
    need_mib: int,
    nodes: Sequence[Mapping[str, Any]],
    rooms: Mapping[str, PoolRoom],
    catalog: Catalog,
) -> str:
    """One reason per pool of the cluster why it cannot take the stage now."""
    placement = job.spec.placement
    label_key = placement.gpu_label
    members: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for node in nodes:
        pool = node_pool(node, label_key)
        if pool is not None:
            members[pool].append(node)
    reasons: dict[str, str] = {}
    for pool, pool_nodes in members.items():
        room = rooms.get(pool)
        if room is not None and room.free_gpus > 0:
            usable = usable_mib(room.memory_mib) / 1024
            reasons[pool] = f"{room.memory_mib / 1024:.1f} GiB per GPU, {usable:.1f} usable"
            continue
        dtype = job.spec.model.dtype
        whys = [why_ineligible(n, placement, dtype=dtype, catalog=catalog) for n in pool_nodes]
        reasons[pool] = str(whys[0]) if all(whys) else "no free GPU"
    listed = "; ".join(f"pool {p}: {r}" for p, r in sorted(reasons.items()))
    return f"no eligible node has a free GPU with {need_mib / 1024:.1f} GiB" + (
        f" ({listed})" if listed else ""
    )


def place_replacements(
    job: FineTuneJob,
    stages: Mapping[Key, tuple[str, int]],
    nodes: Sequence[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    catalog: Catalog | None = None,
) -> dict[Key, Choice]:
    """Where each replaced stage goes: `stages` maps (pipeline, stage) to (its current pool,
    the bytes it needs). The GPUs free now on the job's eligible nodes whose GPU trains in the
    job's dtype are handed out in stage order, so two replacements do not both count one free
    GPU."""
    catalog = catalog or DEFAULT_CATALOG
    label_key = job.spec.placement.gpu_label
    eligible = eligible_nodes(
        nodes, job.spec.placement, dtype=job.spec.model.dtype, catalog=catalog
    )
    rooms = dict(pool_rooms(free_nodes(eligible, pods, label_key), label_key, catalog))
    choices: dict[Key, Choice] = {}
    for k in sorted(stages):
        current, need_bytes = stages[k]
        need_mib = -(-need_bytes // MIB)
        pool = choose_pool(current, need_mib, rooms)
        room = rooms.get(pool)
        if room is None or room.free_gpus <= 0:
            choices[k] = Choice(pool, False, _why_no_room(job, need_mib, nodes, rooms, catalog))
            continue
        rooms[pool] = PoolRoom(room.free_gpus - 1, room.memory_mib)
        choices[k] = Choice(pool, True)
    return choices
