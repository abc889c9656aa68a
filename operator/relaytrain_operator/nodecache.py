"""A short-lived snapshot of the cluster's nodes, shared by every job's periodic check.

Each job asks "is my pods' node still there and Ready?" every few seconds. With 100
jobs that is hundreds of node reads; one paged LIST every `ttl` seconds answers them all.
It is a cache of the cluster, not state: losing it (an operator restart) costs one LIST.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

JsonDict = dict[str, Any]


class NodeSnapshot:
    """Nodes by name, refreshed when older than `ttl` seconds."""

    def __init__(
        self,
        list_nodes: Callable[[], list[JsonDict]],
        get_node: Callable[[str], JsonDict | None],
        ttl: float,
    ) -> None:
        self._list_nodes = list_nodes
        self._get_node = get_node
        self._ttl = ttl
        self._lock = threading.Lock()
        self._nodes: dict[str, JsonDict] = {}
        self._taken_at = float("-inf")
        self._refreshing = False

    def refresh(self, nodes: list[JsonDict] | None = None) -> list[JsonDict]:
        """Replace the snapshot (with `nodes` if the caller just listed them)."""
        if nodes is None:
            nodes = self._list_nodes()
        with self._lock:
            self._nodes = {n["metadata"]["name"]: _slim(n) for n in nodes}
            self._taken_at = time.monotonic()
        return nodes

    def _current(self) -> dict[str, JsonDict]:
        """The snapshot; refreshed in the background once it is older than `ttl`.

        Readers never wait for a LIST of a large cluster (seconds on a busy API server)
        except the very first time: a stale snapshot is served while a fresh one loads.
        """
        with self._lock:
            empty = self._taken_at == float("-inf")
            stale = time.monotonic() - self._taken_at >= self._ttl
            start = stale and not empty and not self._refreshing
            if start:
                self._refreshing = True
        if empty:
            self.refresh()
        elif start:
            threading.Thread(target=self._refresh_in_background, daemon=True).start()
        with self._lock:
            return self._nodes

    def _refresh_in_background(self) -> None:
        try:
            self.refresh()
        except Exception:
            logger.exception("Listing the nodes failed; keeping the previous snapshot.")
        finally:
            with self._lock:
                self._refreshing = False

    def all(self) -> list[JsonDict]:
        """Every node, from a snapshot about `ttl` seconds old at most."""
        return list(self._current().values())

    def get(self, name: str) -> JsonDict | None:
        """The node called `name` (None if it does not exist).

        A name the snapshot lacks is read directly before it is called gone: a node that
        joined after the snapshot must not look lost.
        """
        node = self._current().get(name)
        if node is None:
            node = self._get_node(name)
            if node is not None:
                with self._lock:
                    self._nodes[name] = node
        return node


def _slim(node: JsonDict) -> JsonDict:
    """What the operator reads of a node: name, labels, annotations, unschedulable,
    allocatable and conditions (a 1,000-node snapshot stays small)."""
    meta = node.get("metadata") or {}
    status = node.get("status") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": meta.get("labels") or {},
            "annotations": meta.get("annotations") or {},
        },
        "spec": {"unschedulable": bool((node.get("spec") or {}).get("unschedulable"))},
        "status": {
            "allocatable": status.get("allocatable") or {},
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "lastTransitionTime")}
                for c in status.get("conditions") or []
            ],
        },
    }
