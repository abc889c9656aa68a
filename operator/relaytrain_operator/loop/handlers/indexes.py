"""kopf indexes of the nodes and the stage pods: what every pass reads, kept by kopf's
watches instead of a request per pass. kopf fills them before any handler runs, so a
restarted operator's first passes see the whole cluster.

Each entry is a slim copy (what placement and the decisions read), so 1,000 nodes and
their pods stay small in memory.
"""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.loop.handlers.filters import served

JsonDict = dict[str, Any]


def _slim_node(body: kopf.Body) -> JsonDict:
    """Name, labels, annotations, unschedulable, taints, allocatable and conditions."""
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    return {
        "metadata": {
            "name": body.metadata.name,
            "labels": dict(body.metadata.labels),
            "annotations": dict(body.metadata.annotations),
        },
        "spec": {
            "unschedulable": bool(spec.get("unschedulable")),
            "taints": [dict(t) for t in spec.get("taints") or []],
        },
        "status": {
            "allocatable": dict(status.get("allocatable") or {}),
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "lastTransitionTime")}
                for c in status.get("conditions") or []
            ],
        },
    }


def _containers(status: JsonDict) -> list[JsonDict]:
    """How each ended container ended (its exit code and termination message: the stage's
    own words, relaytrain_contract.exits) and why each waiting one waits (the kubelet's
    reason and message: a missing Secret, an image it cannot pull); nothing of a running
    one."""
    out = []
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        for kind, keys in (("terminated", ("exitCode", "message")),
                           ("waiting", ("reason", "message"))):  # fmt: skip
            if state.get(kind):
                kept = {k: state[kind].get(k) for k in keys if k in state[kind]}
                out.append({"name": container.get("name"), "image": container.get("image"),
                            "state": {kind: kept}})  # fmt: skip
    return out


def _slim_pod(body: kopf.Body) -> JsonDict:
    """Metadata the decisions read, the node it is bound to, its phase and conditions, and
    how its containers ended."""
    meta = body.metadata
    status = body.get("status") or {}
    slim: JsonDict = {
        "metadata": {
            "name": meta.name,
            "namespace": meta.namespace,
            "uid": meta.uid,
            "labels": dict(meta.labels),
            "annotations": dict(meta.annotations),
            # How long a replacement has waited for a GPU (decide/resplit.py).
            "creationTimestamp": meta.creation_timestamp,
        },
        "spec": {"nodeName": (body.get("spec") or {}).get("nodeName")},
        "status": {
            "phase": status.get("phase"),
            "reason": status.get("reason"),
            "conditions": [
                {k: c.get(k) for k in ("type", "status")} for c in status.get("conditions") or []
            ],
        },
    }
    containers = _containers(status)
    if containers:
        slim["status"]["containerStatuses"] = containers
    if meta.deletion_timestamp:
        slim["metadata"]["deletionTimestamp"] = meta.deletion_timestamp
    return slim


@kopf.index("nodes")
async def node_index(*, name: str, body: kopf.Body, **_: Any) -> dict[str, JsonDict]:
    return {name: _slim_node(body)}


@kopf.index("pods", labels={JOB_LABEL: kopf.PRESENT}, when=served)
async def pod_index(
    *, namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], JsonDict]:
    return {(namespace or "", labels[JOB_LABEL]): _slim_pod(body)}
