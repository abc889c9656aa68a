"""Simulated GPU nodes for the local cluster, built from a pool layout file.

`node_manifests(pools_doc)` turns hack/pools.yaml (or any file of that shape) into
Kubernetes Node objects that kwok's controller keeps Ready, labelled the way NVIDIA's
GPU feature discovery labels real GPU nodes. `python -m relaytrain_testkit.harness.kwok_nodes
POOLS.yaml --kubeconfig KUBECONFIG` (what hack/cluster.sh runs) creates them on that cluster
(existing nodes are left as they are).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
REQUIRED_FIELDS = ("name", "product", "nodes", "gpuMemoryMiB", "cpu", "memory")


def load_pools(path: str | Path) -> list[dict[str, Any]]:
    """Reads a pool layout file and checks each pool names what a node needs."""
    doc = yaml.safe_load(Path(path).read_text())
    pools = doc.get("pools") if isinstance(doc, dict) else None
    if not isinstance(pools, list) or not pools:
        raise ValueError(f"{path}: expected a top-level `pools:` list with at least one pool")
    for i, pool in enumerate(pools):
        missing = [f for f in REQUIRED_FIELDS if f not in pool]
        if missing:
            raise ValueError(f"{path}: pools[{i}] lacks {', '.join(missing)}")
        if int(pool["nodes"]) < 0:
            raise ValueError(f"{path}: pools[{i}].nodes must be >= 0, got {pool['nodes']}")
    return pools


def node_manifest(pool: dict[str, Any], index: int) -> dict[str, Any]:
    """One kwok node of `pool`: GPU labels, GPU capacity and the pool's network link."""
    gpus = str(pool.get("gpusPerNode", 1))
    capacity = {
        "cpu": str(pool["cpu"]),
        "memory": str(pool["memory"]),
        "pods": str(pool.get("maxPods", 110)),
        "nvidia.com/gpu": gpus,
        "ephemeral-storage": str(pool.get("ephemeralStorage", "500Gi")),
    }
    name = f"{pool['name']}-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "relaytrain.io/pool": str(pool["name"]),
                "nvidia.com/gpu.product": str(pool["product"]),
                "nvidia.com/gpu.memory": str(pool["gpuMemoryMiB"]),
                "nvidia.com/gpu.count": gpus,
                "nvidia.com/gpu.present": "true",
            },
            "annotations": {
                KWOK_ANNOTATION: "fake",
                "node.alpha.kubernetes.io/ttl": "0",
                "relaytrain.io/link-bandwidth-mbps": str(pool.get("linkBandwidthMbps", 1000)),
                "relaytrain.io/link-latency-ms": str(pool.get("linkLatencyMs", 10)),
            },
        },
        "spec": {},
        "status": {
            "allocatable": dict(capacity),
            "capacity": dict(capacity),
        },
    }


def node_manifests(pools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every node of every pool, in file order."""
    return [node_manifest(pool, i) for pool in pools for i in range(int(pool["nodes"]))]


def create_nodes(api_client: Any, nodes: list[dict[str, Any]]) -> int:
    """Creates the nodes that do not exist yet; returns how many it created."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api_client)
    created = 0
    for node in nodes:
        try:
            core.create_node(node)  # type: ignore[arg-type]  # a manifest dict is fine
            created += 1
        except ApiException as exc:
            if exc.status != 409:
                raise
    return created


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pools", help="pool layout file, e.g. hack/pools.yaml")
    parser.add_argument("--kubeconfig", required=True)
    args = parser.parse_args(argv)

    from kubernetes import config

    nodes = node_manifests(load_pools(args.pools))
    api = config.new_client_from_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
    created = create_nodes(api, nodes)
    print(f"Created {created} of {len(nodes)} GPU nodes from {args.pools}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


SLOW_GPU = {
    "Kwok-Slow-GPU": {
        "tflops": 1e-5, "fp32Tflops": 1e-5, "memoryMiB": 24564, "memoryBandwidthGBs": 1.0,
        "bf16": True,
    }
}  # fmt: skip
"""A GPU for the chart's catalog (value `gpuCatalog`), so slow that the planner finds a
pipeline more worth its join for the tiny model (on the GPUs the catalog knows, its step is
all fixed costs): what growth and re-split tests price on."""


def slow_pool(name: str, count: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A kwok pool `name` of SLOW_GPU nodes (links of 500 Mbit/s, 30 ms) and `count` node
    manifests of it, one GPU each."""
    pool = {
        "name": name, "product": "Kwok-Slow-GPU", "gpuMemoryMiB": 24564, "cpu": "16",
        "memory": "64Gi", "linkBandwidthMbps": 500, "linkLatencyMs": 30,
    }  # fmt: skip
    return pool, [node_manifest(pool, i) for i in range(count)]
