"""Observe → decide → apply, for one job at a time, driven by the job's kopf daemon.

Each unfinished FineTuneJob has one daemon (handlers/jobs.py) that calls `Runner.run`:
a loop that reconciles the job now, whenever it is rung (a stage pod failed or went away,
the spec changed), and every `--resync-seconds` otherwise. One loop per job, so passes of
one job never overlap and need no lock. A finished job (Succeeded, or Failed for good)
has no daemon: it costs no timer, no read and no request.

A pass: read the job (fresh: the status says what was already counted), take its stage
pods and nodes from kopf's indexes, read what `decide.needs` asks for (`observe`), decide
(`decide`, pure), apply (`apply.Executor`). Passes that place pods (a first plan, a pod to
create) hold one lock from reading the cluster's free GPUs to creating their pods, so the
next one sees those pods holding their GPUs. Blocking work (API calls, S3, the planner)
runs in a thread pool, off kopf's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from kubernetes.client.exceptions import ApiException

from relaytrain_operator.domain.planner import Catalog
from relaytrain_operator.loop import metrics
from relaytrain_operator.loop.actions import PostEvent
from relaytrain_operator.loop.apply import ClusterApi, EventPoster, Executor
from relaytrain_operator.loop.decide import Decision, Settings, decide, needs, stage_pods
from relaytrain_operator.loop.observe import Observer
from relaytrain_operator.loop.options import OperatorOptions

JsonDict = dict[str, Any]
JobKey = tuple[str, str]
Index = Mapping[Any, Iterable[JsonDict]]
"""A kopf index as the runner reads it: key → the values indexed under it."""
_T = TypeVar("_T")
# Shortest wait between two passes of one job (a back-off that is due "now").
_MIN_WAIT = 0.1


class Stopped(Protocol):
    """kopf's `stopped` flag of a daemon."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Awaitable[Any]: ...


@dataclass
class _Bell:
    """Rung to make a job's loop run a pass now."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int | None = None
    """metadata.generation the last pass saw: a job event with another one is a spec change."""


class Runner:
    """Reconciles jobs; one instance per operator process."""

    def __init__(
        self,
        api: ClusterApi,
        options: OperatorOptions,
        catalog: Catalog | None,
        post_event: EventPoster,
    ) -> None:
        self.options = options
        self.settings = Settings(
            node_lost_seconds=options.node_lost_seconds,
            worker_image=options.worker_image,
            worker_device=options.worker_device,
            default_link=(options.default_link_mbps, options.default_link_latency_ms),
            catalog=catalog,
            secret_propagation_seconds=options.secret_propagation_seconds,
            join_seconds=options.join_seconds,
        )
        self.observer = Observer(api)
        self.executor = Executor(api, post_event, store_access=self.observer.store_access)
        self._threads = ThreadPoolExecutor(
            max_workers=options.max_workers, thread_name_prefix="reconcile"
        )
        self._placing = asyncio.Lock()
        self._bells: dict[JobKey, _Bell] = {}

    def ring(self, namespace: str, name: str, generation: int | None = None) -> None:
        """Make the job's loop run a pass now; with `generation`, only if its spec changed
        since the last pass (the job's own status patches do not ring)."""
        bell = self._bells.get((namespace, name))
        if bell is not None and (generation is None or generation != bell.generation):
            bell.event.set()

    def ring_all(self) -> None:
        """Make every job's loop run a pass now (a node joined: a pipeline may fit)."""
        for bell in list(self._bells.values()):
            bell.event.set()

    async def run(
        self, namespace: str, name: str, stopped: Stopped, nodes: Index, pods: Index
    ) -> None:
        """Reconcile the job until `stopped` (it finished, is deleted, or the operator
        exits). An error propagates: kopf retries the daemon after a delay."""
        key = (namespace, name)
        bell = self._bells.setdefault(key, _Bell())
        try:
            while not stopped:
                bell.event.clear()
                decision = await self.reconcile(namespace, name, nodes, pods, bell)
                wait = self.options.resync_seconds
                if decision.retry_after is not None:
                    wait = max(_MIN_WAIT, min(wait, decision.retry_after))
                await _first(bell.event.wait(), stopped.wait(), timeout=wait)
        finally:
            self._bells.pop(key, None)

    async def reconcile(
        self, namespace: str, name: str, nodes: Index, pods: Index, bell: _Bell | None = None
    ) -> Decision:
        """One pass over the job `namespace/name`."""
        with metrics.timed_reconcile(namespace, name):
            now = datetime.now(UTC)
            job = await self._in_thread(self.executor.api.get_job, namespace, name)
            if job is None:
                return Decision()
            if bell is not None:
                bell.generation = job["metadata"].get("generation")
            try:
                decision = await self._pass(job, now, nodes, pods)
            except ApiException as exc:
                if exc.status == 403:  # a read or a write: told on the job, then retried
                    self.executor.report_forbidden(job, exc)
                raise
            if decision.restarts:
                metrics.STAGE_RESTARTS.labels(namespace=namespace).inc(decision.restarts)
            for action in decision.actions:
                if not isinstance(action, PostEvent):
                    continue
                change = action.change or metrics.CHANGES.get(action.reason)
                if change is not None:
                    metrics.PIPELINE_CHANGES.labels(namespace=namespace, change=change).inc()
            return decision

    async def _pass(self, job: JsonDict, now: datetime, nodes: Index, pods: Index) -> Decision:
        """Observe what the decision needs, decide, and apply its actions."""
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        indexed = stage_pods(list(pods.get((namespace, name), ())))
        wanted = needs(job, indexed, now)
        if wanted.pods:
            indexed = await self._in_thread(self.observer.stage_pods, namespace, name)
            wanted = needs(job, indexed, now)
        async with self._placing if wanted.room else contextlib.nullcontext():
            known = _nodes(nodes, None if wanted.room else indexed.values())
            observed = await self._in_thread(
                self.observer.observe, job, indexed, known, wanted, now
            )
            decision = await self._in_thread(decide, observed, self.settings)
            await self._in_thread(self.executor.run, job, decision.actions, now)
        return decision

    async def _in_thread(self, call: Callable[..., _T], *args: Any) -> _T:
        """`call(*args)` in the pool, with this task's context (kopf's event poster)."""
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._threads, functools.partial(context.run, call, *args)
        )


def _nodes(index: Index, pods: Iterable[JsonDict] | None) -> dict[str, JsonDict]:
    """Nodes from the index: every one (`pods` None), or those the pods are bound to."""
    if pods is None:
        return {n["metadata"]["name"]: n for key in list(index) for n in index[key]}
    names = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
    return {str(name): n for name in names for n in index.get(name, ())}


async def _first(*waits: Awaitable[Any], timeout: float) -> None:
    """Wait until the first of `waits` is done, or `timeout` seconds."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
