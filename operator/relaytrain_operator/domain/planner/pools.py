"""GPU pools: groups of identical GPUs behind similar network links.

A pool is what the planner places stages on: every GPU in it is the same product with the
same memory, reached over a link of (at least) the given bandwidth and (at most) the given
latency. Pools come from Kubernetes Node objects (plain dicts, as ``kubectl get nodes -o
json`` prints them) or from the simulated-fleet file ``hack/pools.yaml``.

Node conventions (the same the local kwok cluster uses):
- label ``nvidia.com/gpu.product`` (configurable): the GPU product, as GPU feature discovery
  writes it; nodes without it are not GPU nodes and are skipped;
- label ``relaytrain.io/pool``: the pool name (default: the product);
- label ``nvidia.com/gpu.memory``: MiB per GPU (default: the catalog's value);
- allocatable (else capacity) ``nvidia.com/gpu``: GPUs the node offers;
- annotations ``relaytrain.io/link-bandwidth-mbps`` and ``relaytrain.io/link-latency-ms``.

Nodes of one pool that disagree are merged conservatively: the smallest memory and
bandwidth, the largest latency, so a plan never assumes more than every node has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import isnan
from typing import Any

PRODUCT_LABEL = "nvidia.com/gpu.product"
POOL_LABEL = "relaytrain.io/pool"
MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_RESOURCE = "nvidia.com/gpu"
BANDWIDTH_ANNOTATION = "relaytrain.io/link-bandwidth-mbps"
LATENCY_ANNOTATION = "relaytrain.io/link-latency-ms"


class PoolError(ValueError):
    """Malformed pool or node input; the message names the object and field."""


@dataclass(frozen=True)
class Pool:
    """A set of identical GPUs the planner may put stages on (one GPU per stage)."""

    name: str
    """Pool name (label ``relaytrain.io/pool``), used in node selectors."""
    product: str
    """GPU product label value; looked up in the catalog."""
    gpus: int
    """GPUs available for this job."""
    link_bandwidth_mbps: float
    """Network bandwidth of each node's link, megabits per second."""
    link_latency_ms: float
    """One-way latency of each node's link to the network, milliseconds."""
    memory_mib: int | None = None
    """Memory per GPU in MiB; None takes the catalog's value."""
    nodes: int = 1
    """Nodes in the pool (informational)."""

    def __post_init__(self) -> None:
        where = f"pool {self.name!r}"
        if not self.name:
            raise PoolError("pool name must not be empty")
        if not self.product:
            raise PoolError(f"{where}: product must not be empty")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus <= 0:
            raise PoolError(f"{where}: gpus must be a positive integer, got {self.gpus!r}")
        if not _positive(self.link_bandwidth_mbps):
            raise PoolError(
                f"{where}: linkBandwidthMbps must be a positive number, "
                f"got {self.link_bandwidth_mbps!r}"
            )
        if not _number(self.link_latency_ms) or self.link_latency_ms < 0:
            raise PoolError(
                f"{where}: linkLatencyMs must be a number >= 0, got {self.link_latency_ms!r}"
            )
        if self.memory_mib is not None and not (
            isinstance(self.memory_mib, int) and _positive(self.memory_mib)
        ):
            raise PoolError(
                f"{where}: gpuMemoryMiB must be a positive integer, got {self.memory_mib!r}"
            )


def _number(value: object) -> bool:
    """A real number: not a bool, not NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and not isnan(value)


def _positive(value: object) -> bool:
    return _number(value) and float(value) > 0  # type: ignore[arg-type]


def _parse_number(raw: object, where: str) -> float:
    try:
        return float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PoolError(f"{where} must be a number, got {raw!r}") from None


def _gpu_count(node: Mapping[str, Any], name: str) -> int:
    status = node.get("status") or {}
    raw = (status.get("allocatable") or {}).get(GPU_RESOURCE)
    if raw is None:
        raw = (status.get("capacity") or {}).get(GPU_RESOURCE)
    if raw is None:
        return 0
    try:
        return int(str(raw))
    except ValueError:
        raise PoolError(f"node {name!r}: {GPU_RESOURCE} must be an integer, got {raw!r}") from None


def pools_from_nodes(
    nodes: Iterable[Mapping[str, Any]],
    label_key: str = PRODUCT_LABEL,
    used: Mapping[str, int] | None = None,
    default_link: tuple[float, float] | None = None,
) -> list[Pool]:
    """Group Kubernetes Node dicts into pools.

    ``used`` maps node name -> GPUs already taken there (subtracted). Unschedulable
    (cordoned) nodes and nodes without the product label or without free GPUs are
    skipped. A node without link annotations is an error unless ``default_link``
    (bandwidth Mbps, latency ms) says what to assume.
    """
    used = used or {}
    merged: dict[str, dict[str, Any]] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", "?"))
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        product = labels.get(label_key)
        if not product or (node.get("spec") or {}).get("unschedulable"):
            continue
        gpus = _gpu_count(node, name) - int(used.get(name, 0))
        if gpus <= 0:
            continue
        if BANDWIDTH_ANNOTATION in annotations:
            bandwidth = _parse_number(
                annotations[BANDWIDTH_ANNOTATION], f"node {name!r}: {BANDWIDTH_ANNOTATION}"
            )
            latency = _parse_number(
                annotations.get(LATENCY_ANNOTATION, 0), f"node {name!r}: {LATENCY_ANNOTATION}"
            )
        elif default_link is not None:
            bandwidth, latency = default_link
        else:
            raise PoolError(
                f"node {name!r} lacks annotation {BANDWIDTH_ANNOTATION} (and "
                f"{LATENCY_ANNOTATION}); annotate it or pass a default link"
            )
        if bandwidth <= 0:
            raise PoolError(f"node {name!r}: {BANDWIDTH_ANNOTATION} must be > 0, got {bandwidth}")
        if latency < 0:
            raise PoolError(f"node {name!r}: {LATENCY_ANNOTATION} must be >= 0, got {latency}")
        memory = labels.get(MEMORY_LABEL)
        memory_mib = (
            int(_parse_number(memory, f"node {name!r}: label {MEMORY_LABEL}")) if memory else None
        )
        pool_name = str(labels.get(POOL_LABEL) or product)
        entry = merged.setdefault(
            pool_name,
            {
                "product": product,
                "gpus": 0,
                "nodes": 0,
                "bw": bandwidth,
                "lat": latency,
                "mem": memory_mib,
            },
        )
        if entry["product"] != product:
            raise PoolError(
                f"pool {pool_name!r} mixes GPU products {entry['product']!r} and {product!r} "
                f"(node {name!r}); give them different {POOL_LABEL} labels"
            )
        entry["gpus"] += gpus
        entry["nodes"] += 1
        entry["bw"] = min(entry["bw"], bandwidth)
        entry["lat"] = max(entry["lat"], latency)
        if memory_mib is not None:
            entry["mem"] = memory_mib if entry["mem"] is None else min(entry["mem"], memory_mib)
    return [
        Pool(
            name=pool_name,
            product=e["product"],
            gpus=e["gpus"],
            link_bandwidth_mbps=e["bw"],
            link_latency_ms=e["lat"],
            memory_mib=e["mem"],
            nodes=e["nodes"],
        )
        for pool_name, e in sorted(merged.items())
    ]


def _pool_from_entry(entry: Mapping[str, Any], index: int) -> Pool:
    where = f"pools[{index}]"
    if not isinstance(entry, Mapping):
        raise PoolError(f"{where} must be a mapping")
    for key in ("name", "product", "linkBandwidthMbps"):
        if key not in entry:
            raise PoolError(f"{where} lacks {key!r}")
    nodes = entry.get("nodes", 1)
    per_node = entry.get("gpusPerNode", 1)
    if "gpus" in entry:
        gpus = entry["gpus"]
    elif isinstance(nodes, int) and isinstance(per_node, int):
        gpus = nodes * per_node
    else:
        raise PoolError(f"{where}: nodes and gpusPerNode must be integers")
    return Pool(
        name=str(entry["name"]),
        product=str(entry["product"]),
        gpus=gpus,
        link_bandwidth_mbps=entry["linkBandwidthMbps"],
        link_latency_ms=entry.get("linkLatencyMs", 0),
        memory_mib=entry.get("gpuMemoryMiB"),
        nodes=nodes if isinstance(nodes, int) else 1,
    )


def pools_from_file(doc: Any, label_key: str = PRODUCT_LABEL, **kwargs: Any) -> list[Pool]:
    """Pools from a parsed YAML/JSON document.

    Accepts a NodeList / List of Nodes (``kubectl get nodes -o yaml``), a bare list of
    Node dicts, or the ``hack/pools.yaml`` format (``{"pools": [{name, product, nodes,
    gpusPerNode, gpuMemoryMiB, linkBandwidthMbps, linkLatencyMs}]}``). Extra keyword
    arguments go to :func:`pools_from_nodes`.
    """
    if isinstance(doc, Mapping) and "pools" in doc:
        entries = doc["pools"]
        if not isinstance(entries, list) or not entries:
            raise PoolError("pools must be a non-empty list")
        pools = [_pool_from_entry(e, i) for i, e in enumerate(entries)]
    elif isinstance(doc, Mapping) and isinstance(doc.get("items"), list):
        pools = pools_from_nodes(doc["items"], label_key, **kwargs)
    elif isinstance(doc, Mapping) and doc.get("kind") == "Node":
        pools = pools_from_nodes([doc], label_key, **kwargs)
    elif isinstance(doc, list):
        pools = pools_from_nodes(doc, label_key, **kwargs)
    else:
        raise PoolError(
            "nodes file must be a NodeList/List of Nodes, a list of Nodes, or a mapping "
            "with a 'pools' list"
        )
    names = [p.name for p in pools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise PoolError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
    if not pools:
        raise PoolError(f"no GPU nodes found (no node has label {label_key!r} and free GPUs)")
    return pools
