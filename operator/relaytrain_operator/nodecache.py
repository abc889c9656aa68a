"""A short-lived snapshot of the cluster's nodes, shared by every job's periodic check.

Each job asks "is my pods' node still there and Ready?" every few seconds. With 100
jobs that is hundreds of node reads; one paged LIST every `ttl` seconds answers them all.
It is a cache of the cluster, not state: losing it (an operator restart) costs one LIST.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

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

    def refresh(self, nodes: list[JsonDict] | None = None) -> list[JsonDict]:
        """Replace the snapshot (with `nodes` if the caller just listed them)."""
        if nodes is None:
            nodes = self._list_nodes()
        with self._lock:
            self._nodes = {n["metadata"]["name"]: n for n in nodes}
            self._taken_at = time.monotonic()
        return nodes

    def all(self) -> list[JsonDict]:
        """Every node, from a snapshot at most `ttl` seconds old."""
        with self._lock:
            fresh = time.monotonic() - self._taken_at < self._ttl
            if fresh:
                return list(self._nodes.values())
        return self.refresh()

    def get(self, name: str) -> JsonDict | None:
        """The node called `name` (None if it does not exist).

        A name the snapshot lacks is read directly before it is called gone: a node that
        joined after the snapshot must not look lost.
        """
        with self._lock:
            fresh = time.monotonic() - self._taken_at < self._ttl
        if not fresh:
            self.refresh()
        with self._lock:
            node = self._nodes.get(name)
        if node is None:
            node = self._get_node(name)
            if node is not None:
                with self._lock:
                    self._nodes[name] = node
        return node
