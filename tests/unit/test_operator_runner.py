"""The runner's loop on its own: a job's passes run now, when rung, after a back-off or at
the resync, one at a time; they stop when told; an error propagates; a gone job is left
alone.

The loop's collaborators — reading the job, observing, deciding, applying — are plain
functions here that record what they were given. What the real ones do against the API
server (the executor, the observer, whole passes) is tested in
tests/k8s/test_operator_executor.py and tests/e2e/test_operator_store.py.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Awaitable, Mapping
from datetime import datetime
from typing import Any

import pytest
from kubernetes import client
from relaytrain_operator.loop import runner as runner_module
from relaytrain_operator.loop.actions import Action, PostEvent
from relaytrain_operator.loop.apply import ClusterApi
from relaytrain_operator.loop.decide import Decision, Needs, Observed, Settings
from relaytrain_operator.loop.options import OperatorOptions
from relaytrain_operator.loop.runner import Runner, _first
from relaytrain_testkit.decide_cases import JOB, NODES, pod, running_status
from relaytrain_testkit.harness.waiting import wait_for_async as until
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

JsonDict = dict[str, Any]
RUNNING_JOB = JOB.status(running_status())  # namespace "ns", name "j", generation 4; two stages
PODS = {("ns", "j"): [pod(0), pod(1)]}  # both stages indexed: no pod listing is needed
NODES_INDEX = {n["metadata"]["name"]: [n] for n in NODES}


class Stop:
    """kopf's `stopped` flag of a daemon."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self, timeout: float | None = None) -> None:
        await self.event.wait()


class Loop:
    """A Runner whose collaborators are this object's plain functions.

    `get_job` returns `job`; `decide` returns `decisions` in turn (then empty ones) and
    records when each pass decided; `observe` and `apply` record what they were given;
    `waits` holds how long the loop chose to wait after each pass before the next.
    `fail` names the one that raises instead; `gate`, when given, holds the first
    decision until it is set. The runner's API client points at a closed port: a call
    that reached it would fail the test.
    """

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        *,
        job: Job | None = RUNNING_JOB,
        decisions: list[Decision] | None = None,
        resync_seconds: float = 30.0,
        fail: str | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.job = job.build() if job is not None else None
        self.decisions = list(decisions or [])
        self.fail = fail
        self.gate = gate
        self.passes: list[float] = []
        self.observed: list[tuple[JsonDict, Mapping[int, JsonDict], set[str], Needs]] = []
        self.applied: list[tuple[JsonDict, tuple[Action, ...]]] = []
        self.waits: list[float] = []
        nowhere = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))
        options = OperatorOptions(resync_seconds=resync_seconds)
        self.runner = Runner(ClusterApi(nowhere), options, None, lambda *a: None)
        monkeypatch.setattr(self.runner.executor.api, "get_job", self.get_job)
        monkeypatch.setattr(self.runner.observer, "observe", self.observe)
        monkeypatch.setattr(runner_module, "decide", self.decide)
        monkeypatch.setattr(self.runner.executor, "run", self.apply)
        monkeypatch.setattr(runner_module, "_first", self.first)

    def _maybe_fail(self, what: str) -> None:
        if self.fail == what:
            raise RuntimeError(f"{what}: API server unavailable")

    def get_job(self, namespace: str, name: str) -> JsonDict | None:
        self._maybe_fail("get_job")
        return copy.deepcopy(self.job)

    def observe(
        self,
        job: JsonDict,
        pods: Mapping[int, JsonDict],
        nodes: Mapping[str, JsonDict],
        wanted: Needs,
        now: datetime,
    ) -> Observed:
        self._maybe_fail("observe")
        self.observed.append((job, pods, set(nodes), wanted))
        return Observed(job=job, now=now, pods=pods, nodes=nodes)

    def decide(self, observed: Observed, settings: Settings) -> Decision:
        self._maybe_fail("decide")
        self.passes.append(time.monotonic())
        if self.gate is not None and len(self.passes) == 1:
            assert self.gate.wait(5), "the test never opened the gate"
        return self.decisions.pop(0) if self.decisions else Decision()

    def apply(self, job: JsonDict, actions: tuple[Action, ...], now: datetime) -> None:
        self._maybe_fail("apply")
        self.applied.append((job, actions))

    async def first(self, *waits: Awaitable[Any], timeout: float) -> None:
        self.waits.append(timeout)
        await _first(*waits, timeout=timeout)

    def start(self, stop: Stop) -> asyncio.Task[None]:
        return asyncio.create_task(self.runner.run("ns", "j", stop, NODES_INDEX, PODS))


def test_a_pass_observes_the_job_it_read_and_applies_what_was_decided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    event = PostEvent("Normal", "Planned", "x")
    loop = Loop(monkeypatch, decisions=[Decision(actions=(event,), retry_after=5.0)])
    decision = asyncio.run(loop.runner.reconcile("ns", "j", NODES_INDEX, PODS))
    assert decision.actions == (event,) and decision.retry_after == 5.0
    ((job, pods, nodes, wanted),) = loop.observed
    assert job == RUNNING_JOB.build()
    assert {k: p["metadata"]["name"] for k, p in pods.items()} == {
        (0, 0): "j-stage-0",
        (0, 1): "j-stage-1",
    }
    assert nodes == {"a100-0", "rtx-0"}  # the nodes of the job's pods, not every node
    assert not wanted.pods and not wanted.room  # every stage is indexed
    assert loop.applied == [(RUNNING_JOB.build(), (event,))]


def test_the_loop_runs_when_rung_and_stops_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = Loop(monkeypatch)
    runner = loop.runner
    stop = Stop()

    async def scenario() -> None:
        task = loop.start(stop)
        await until("the first pass", lambda: len(loop.passes) == 1)
        bell = runner._bells[("ns", "j")]
        runner.ring("ns", "j", generation=4)  # the job's own status patch: same generation
        assert not bell.event.is_set()  # the loop is not woken
        runner.ring("ns", "j", generation=5)  # the spec changed
        await until("a pass for the new spec", lambda: len(loop.passes) == 2)
        runner.ring("ns", "j")  # a stage pod ended
        await until("a pass for the pod", lambda: len(loop.passes) == 3)
        runner.ring("ns", "other")  # no loop runs for that job: nothing happens
        assert not bell.event.is_set() and ("ns", "other") not in runner._bells
        stop.event.set()
        await asyncio.wait_for(task, 1)  # at once, not at the 30 s resync
        assert runner._bells == {}  # a finished loop leaves nothing behind
        runner.ring("ns", "j")  # and a late ring is no error

    asyncio.run(scenario())
    assert len(loop.applied) == 3


def test_a_ring_during_a_pass_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    loop = Loop(monkeypatch, gate=gate)
    stop = Stop()

    async def scenario() -> None:
        task = loop.start(stop)
        await until("the first pass to decide", lambda: len(loop.passes) == 1)
        loop.runner.ring("ns", "j")  # while the first pass is still deciding
        gate.set()
        await until("a second pass", lambda: len(loop.passes) == 2, timeout=2)
        stop.event.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("resync", "retry_after", "gap"),
    [
        pytest.param(30.0, 0.3, 0.3, id="back-off-before-resync"),
        pytest.param(0.3, 30.0, 0.3, id="resync-before-back-off"),
        pytest.param(30.0, 0.0, 0.1, id="due-now-waits-the-shortest-wait"),
    ],
)
def test_the_next_pass_comes_at_the_back_off_or_the_resync_whichever_is_first(
    monkeypatch: pytest.MonkeyPatch,
    resync: float,
    retry_after: float,
    gap: float,
) -> None:
    loop = Loop(monkeypatch, decisions=[Decision(retry_after=retry_after)], resync_seconds=resync)
    stop = Stop()

    async def scenario() -> None:
        task = loop.start(stop)
        await until("the wait after the second pass", lambda: len(loop.waits) == 2)
        stop.event.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(scenario())
    assert gap * 0.9 <= loop.passes[1] - loop.passes[0] < 5.0
    # The first wait is the gap; after the second pass, which asked for nothing, the loop
    # goes back to the resync.
    assert loop.waits == [gap, resync]


@pytest.mark.parametrize("fail", ["get_job", "observe", "decide", "apply"])
def test_an_error_in_a_pass_propagates_and_the_loop_lets_go_of_the_job(
    monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    loop = Loop(monkeypatch, fail=fail)
    with pytest.raises(RuntimeError, match=f"{fail}: API server unavailable"):
        asyncio.run(loop.runner.run("ns", "j", Stop(), NODES_INDEX, PODS))
    assert loop.runner._bells == {}  # kopf retries the daemon, which starts a new loop


def test_a_gone_job_decides_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = Loop(monkeypatch, job=None)
    decision = asyncio.run(loop.runner.reconcile("ns", "j", NODES_INDEX, PODS))
    assert decision.actions == () and decision.status is None and decision.retry_after is None
    assert loop.observed == [] and loop.passes == [] and loop.applied == []
