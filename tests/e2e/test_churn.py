"""The job follows a changing fleet: a churn schedule with real training (`make chaos`;
issue 23, "Must show").

One job of two 2-stage pipelines (synchronous data parallelism: every step one global
batch), real worker processes, under the chart-installed operator against the real control
plane with a MinIO of its own (relaytrain_testkit.chaos). Its pools: `main`, four RTX 4090
nodes (exactly its four stages), and `joined`, with no node at first; both allowed by
spec.placement.pools. No restart is left to a stage (maxStageRestarts 0: a crash gives its
pipeline up at once) and a pipeline given up is tried again after 5 s (returnAfterSeconds,
doubled for each return it had). Nodes join and leave, one event after the other, each at
a seeded step once the job is over the previous one:

1. **spot**: the node under a stage of pipeline 1 gets the AWS spot-interruption taint; the
   pipeline leaves at a step boundary, and no GPU fits it (one is free): it stays out;
2. **pool added**: two nodes of pool `joined` join; pipeline 1 comes back on free GPUs and
   rejoins pipeline 0 with its state;
3. **drain**: `kubectl drain` of the node under stage 0 of pipeline 0 (the cordon, then the
   eviction); the pipeline leaves at a step boundary and comes back at once on the two GPUs
   free;
4. **node gone**: the node under a stage of pipeline 1 deleted without notice; the stage
   crashes with no restart left, and the pipeline is given up;
5. **pool back**: that node joins again; the pipeline given up comes back and rejoins.

It asserts: the job succeeds; its final loss is an uninterrupted two-pipeline run's
afterwards, bit for bit (the planned departures cost nothing, and the step a crash lands in
is trained again by the pipeline left: tests/e2e/test_local_pipelines_e2e.py shows both step
by step); no pipeline
training on ever restored a commit (no rollback for a planned departure, nor for the crash,
whose pipeline rejoins from the other's state); progress.json never stepped back; no stage
ever had two live pods. A table prints, per event: the time from the event to the operator's
record of it (the pipeline's status: Left, Failed, or back), from a node Ready to that
pipeline's first step with the other (its stages' "rejoined at step"), the commits the
survivors restored (none), the steps lost (trained again: progress.json going back, or a
survivor's restore behind the event's step; none); and the goodput: the uninterrupted
run's time over the churned one's, each alone on the same two cores (the GPUs are kwok's:
what the fleet of each moment could do is what these cores do).

About three minutes here: `make chaos` runs it; `make test` leaves it out, saying so.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client
from relaytrain_testkit.chaos import (
    Background,
    PodWatch,
    Progress,
    StageLogs,
    chaos_env,
    delete_nodes,
    final_loss,
    finished,
    job_status,
    node_ready,
)
from relaytrain_testkit.harness import kwok_nodes
from relaytrain_testkit.harness.operator_env import GROUP, PLURAL, VERSION, diagnostics, tiny_job
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos, pytest.mark.fleet_chaos]

SEED = 20261128
STAGES, PIPELINES = 2, 2
STEPS, EVERY = 1600, 20
"""1600 steps: the last event comes near step 700, and the pipeline given up then needs its
return delay (10 s) and a join (about 5 s) before it trains again, while the other trains
10 to 30 steps a second alone, by how busy the machine is (1000 steps were not enough on an
idle machine: the job finished first)."""
SPACING = 150
"""Steps between events: a pipeline takes ten seconds or more to come back (pods, processes,
slices and a peer's state), while the other trains about ten steps a second alone."""
RETURN_AFTER = 5
SPOT = "aws-node-termination-handler/spot-itn"
EVENTS = ["spot", "pool added", "drain", "node gone", "pool back"]
WAIT = 300.0


@dataclass
class Event:
    kind: str
    target: int
    """The step the job reaches before it happens."""
    pipeline: int = 0
    wall: float = 0.0
    """When it happened (time.time(), to read the stages' logs by)."""
    at_step: int = 0
    ready: float | None = None
    """When the GPUs it brings were Ready (time.time()), for a join."""
    recorded: float | None = None
    """Seconds from the event to the operator's record of it in the pipeline's status."""
    first_step: tuple[float, int] | None = None
    """(when, step) the pipeline it brought back first trained with the other."""
    note: str = ""
    restored: list[int] = field(default_factory=list)
    lost: int = 0
    """Steps the job trained again for it (progress going back, or a survivor's restore)."""


@pytest.fixture(scope="module")
def env(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with chaos_env(kube_cluster, tmp_path_factory.mktemp("churn")) as parts:
        yield parts


class Pipelines:
    """The job's status.pipelines, polled: when each (pipeline, phase, returns) was first
    seen."""

    def __init__(self, e: dict[str, Any], name: str) -> None:
        self.e, self.name = e, name
        self.first: dict[tuple[int, str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pipelines = job_status(self.e, self.name).get("pipelines") or []
            except client.ApiException:
                pipelines = []
            now = time.time()
            for p in pipelines:
                key = (p["index"], p.get("phase") or "", p.get("returns") or 0)
                self.first.setdefault(key, now)
            time.sleep(0.1)

    def seen(self, pipeline: int, phase: str, returns: int, after: float) -> float | None:
        """When pipeline `pipeline` was first seen in `phase` after `returns` returns, if
        that was after `after`."""
        t = self.first.get((pipeline, phase, returns))
        return t if t is not None and t >= after else None

    def back(self, pipeline: int, returns: int, after: float) -> float | None:
        """When pipeline `pipeline` was first seen back (in any phase but Left or Failed)
        with `returns` returns, if that was after `after`."""
        times = [
            t
            for (p, phase, r), t in self.first.items()
            if p == pipeline and r == returns and phase not in ("Left", "Failed") and t >= after
        ]
        return min(times) if times else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _job(minio: Any, secret: str, name: str, pools: list[str]) -> dict[str, Any]:
    return (
        tiny_job(name, minio)
        .credentials(secret)
        .pipeline(stages=STAGES, replicas=PIPELINES)
        .training(steps=STEPS)
        .checkpoint(every_steps=EVERY, keep=4)
        .failure_policy(max_stage_restarts=0, backoff_seconds=0)
        .set("spec.failurePolicy.returnAfterSeconds", RETURN_AFTER)
        .placement(pools=pools)
        .build()
    )


def _node_of(e: dict[str, Any], name: str, p: int, k: int) -> str:
    pod = e["core"].read_namespaced_pod(f"{name}-p{p}-s{k}", e["ns"])
    return str(pod.spec.node_name)


def _join(e: dict[str, Any], nodes: list[dict[str, Any]], created: list[str]) -> float:
    """Nodes join; returns when the last of them was Ready (time.time())."""
    core = e["core"]
    kwok_nodes.create_nodes(core.api_client, nodes)
    names = [n["metadata"]["name"] for n in nodes]
    created += [n for n in names if n not in created]
    for node in names:
        wait_for(f"{node} Ready", lambda node=node: node_ready(core, node))
    return time.time()


def test_the_job_follows_a_changing_fleet(env: dict[str, Any]) -> None:
    e = env
    core, ns = e["core"], e["ns"]
    rng = random.Random(SEED)
    tag = uuid.uuid4().hex[:5]
    main = {
        "name": f"churn{tag}-main", "product": "NVIDIA-GeForce-RTX-4090", "gpuMemoryMiB": 24564,
        "cpu": "16", "memory": "64Gi", "linkBandwidthMbps": 500, "linkLatencyMs": 30,
    }  # fmt: skip
    joined = {**main, "name": f"churn{tag}-joined"}
    apart = {**main, "name": f"churn{tag}-calm"}  # the uninterrupted run's own GPUs
    gpus = STAGES * PIPELINES
    nodes = [kwok_nodes.node_manifest(pool, i) for pool in (main, apart) for i in range(gpus)]
    created: list[str] = []
    _join(e, nodes, created)
    name = "churn"
    events = [Event(kind, 60 + SPACING * i + rng.randrange(1, 30)) for i, kind in enumerate(EVENTS)]
    try:
        pods = PodWatch(core, ns, name)
        progress = Progress(e["minio"], f"ckpt/{ns}/{name}/progress.json")
        logs = StageLogs(e["work"] / "pods" / ns, name)
        pipelines = Pipelines(e, name)
        # Both runs start with the test kubelet's prefork server up (the first stage pod
        # would otherwise wait for its imports, seconds the other run does not pay).
        e["runner"].start_prefork()
        started, created_at = time.monotonic(), time.time()
        e["custom"].create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, _job(e["minio"], "s3", name, [main["name"], joined["name"]])
        )
        gone: dict[str, Any] = {}
        try:
            for event in events:
                doc = progress.before(event.target, f"{event.kind} event", WAIT)
                event.at_step = int(doc["step"])
                _happen(e, name, event, joined, created, gone)
                _over(e, event, pipelines, logs)
            final = finished(e, name, 900)
            finished_at = time.time()
        except AssertionError as err:
            # What the operator recorded, and the cluster's side: the wait alone says little.
            status = job_status(e, name)
            raise AssertionError(f"{err}\nstatus: {status}\n{diagnostics(e)}") from None
        finally:
            pods.stop()
            pipelines.stop()
        churn_s = time.monotonic() - started
        assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
        loss = final_loss(e, e["minio"], name)
        # The uninterrupted run of the same job, on GPUs and a store of its own, afterwards:
        # alone on the same 2 cores, as the churned run was (its GPUs are kwok's: what the
        # fleet of each moment could do is what these cores do).
        calm_run = Background(e, _job(e["calm_minio"], "s3-calm", "calm", [apart["name"]]))
        # When it reached the first event's step: from there on the two runs differ by the
        # churn alone (before it, both start: pods, processes, first steps).
        calm_progress = Progress(e["calm_minio"], f"ckpt/{ns}/calm/progress.json")
        at_first = events[0].at_step
        calm_progress.wait(f"the uninterrupted run at step {at_first}",
                           lambda d: d["step"] >= at_first, timeout=WAIT)  # fmt: skip
        calm_first = time.time()
        calm = calm_run.result(900)
        assert calm["phase"] == "Succeeded", f"{calm}\n{diagnostics(e)}"
        calm_loss = final_loss(e, e["calm_minio"], "calm")

        ends = [ev.wall for ev in events[1:]] + [finished_at]
        print(f"\nChurn schedule for {PIPELINES} pipelines of {STAGES} stages (seed {SEED}), "
              f"{STEPS} steps, a commit every {EVERY}:")  # fmt: skip
        print("| event | pipeline | at step | to the operator's record | node Ready to first "
              "step | first step with the other | survivors restored | steps lost | goodput "
              "until the next | note |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        # The uninterrupted run's steps a second from the first event's step on.
        calm_rate = (STEPS - at_first) / (calm_run.ended - calm_first)
        # From the job's creation to the first event: its pods, processes and first steps.
        start_rate = progress.step_at(events[0].wall) / (events[0].wall - created_at)
        print(f"| (start) | - | 0 | - | - | - | - | - | {start_rate / calm_rate:.2f} | "
              "the job created |")  # fmt: skip
        for ev, end in zip(events, ends, strict=True):
            others = set(range(PIPELINES)) - {ev.pipeline}
            survivors = logs.restored_between(ev.wall, end, others)
            ev.restored = [] if survivors is None else [survivors]
            ready = (
                "-"
                if ev.first_step is None or ev.ready is None
                else f"{ev.first_step[0] - ev.ready:.1f} s"
            )
            first = "-" if ev.first_step is None else str(ev.first_step[1])
            recorded = "-" if ev.recorded is None else f"{ev.recorded:.1f} s"
            restored = "none" if survivors is None else str(survivors)
            # Steps the job trains again for the event: its progress going back, or the
            # survivors restoring a commit behind the step it happened at.
            ev.lost = max(
                progress.stepped_back(ev.wall, end),
                0 if survivors is None else ev.at_step - survivors,
            )
            # Steps a second from this event to the next (or the end) against the run
            # uninterrupted: where the time went.
            last = STEPS if end == finished_at else progress.step_at(end)
            rate = (last - progress.step_at(ev.wall)) / (end - ev.wall)
            print(f"| {ev.kind} | {ev.pipeline} | {ev.at_step} | {recorded} | {ready} | "
                  f"{first} | {restored} | {ev.lost} | {rate / calm_rate:.2f} | "
                  f"{ev.note} |")  # fmt: skip
        steady = (calm_run.ended - calm_first) / (finished_at - events[0].wall)
        print(f"wall {churn_s:.0f} s against {calm_run.seconds:.0f} s uninterrupted: goodput "
              f"{calm_run.seconds / churn_s:.2f}, {steady:.2f} from step {at_first} (the first "
              f"event) on; final loss {loss!r} against {calm_loss!r}; "
              f"{pods.events} pod events watched")  # fmt: skip

        # No survivor ever rolled back; progress never stepped back; one live pod a stage.
        assert [ev.kind for ev in events if ev.restored] == [], [
            (e.kind, e.restored) for e in events
        ]
        assert progress.seen == sorted(progress.seen), "progress.json stepped back"
        assert [(ev.kind, ev.lost) for ev in events if ev.lost] == []
        assert pods.events > 0 and max(pods.most.values()) == 1, dict(pods.most)
        assert loss == calm_loss, (loss, calm_loss)
        # Every event reached the operator's record, and every join its pipeline's steps.
        assert all(ev.recorded is not None for ev in events), events
        assert all(ev.first_step for ev in events if ev.kind != "spot" and ev.kind != "node gone")
        lives = {p["index"]: p for p in final.get("pipelines") or []}
        assert lives[1].get("returns") == 2 and lives[0].get("returns") == 1, lives
    finally:
        delete_nodes(core, created)


def _happen(
    e: dict[str, Any],
    name: str,
    ev: Event,
    joined: dict[str, Any],
    created: list[str],
    gone: dict[str, Any],
) -> None:
    """Make `ev` happen."""
    core, ns = e["core"], e["ns"]
    ev.wall = time.time()
    if ev.kind == "spot":
        ev.pipeline = 1
        node = _node_of(e, name, 1, 1)
        core.patch_node(node, {"spec": {"taints": [{"key": SPOT, "effect": "NoSchedule"}]}})
        ev.note = f"{node} tainted {SPOT}"
    elif ev.kind == "pool added":
        ev.pipeline = 1
        ev.ready = _join(e, [kwok_nodes.node_manifest(joined, i) for i in range(2)], created)
        ev.note = f"2 nodes of pool {joined['name']} joined"
    elif ev.kind == "drain":
        ev.pipeline = 0
        node = _node_of(e, name, 0, 0)
        core.patch_node(node, {"spec": {"unschedulable": True}})
        pod = f"{name}-p0-s0"
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=ns))
        core.create_namespaced_pod_eviction(pod, ns, body)
        ev.ready = ev.wall  # the GPUs it comes back on are free and Ready already
        ev.note = f"{node} cordoned, {pod} evicted"
    elif ev.kind == "node gone":
        ev.pipeline = 1
        node = _node_of(e, name, 1, 0)
        gone["node"] = core.read_node(node).to_dict()
        core.delete_node(node)
        ev.note = f"{node} deleted without notice"
    elif ev.kind == "pool back":
        ev.pipeline = 1
        back = gone["node"]["metadata"]["name"]
        pool = back.rsplit("-", 1)[0]
        main = {**joined, "name": pool}
        ev.ready = _join(e, [kwok_nodes.node_manifest(main, int(back.rsplit("-", 1)[1]))],
                         created)  # fmt: skip
        ev.note = f"{back} joined again"
    else:
        raise AssertionError(ev.kind)


def _over(e: dict[str, Any], ev: Event, pipelines: Pipelines, logs: StageLogs) -> None:
    """Wait until the job is over `ev`: the operator recorded it in the pipeline's status
    (out, or back), and a pipeline it brought back trains with the other."""
    p = ev.pipeline
    if ev.kind == "spot":
        at = wait_for(
            "pipeline 1 Left", lambda: pipelines.seen(p, "Left", 0, ev.wall), timeout=WAIT
        )
        ev.recorded = at - ev.wall
        return
    if ev.kind == "node gone":
        at = wait_for("pipeline 1 given up",
                      lambda: pipelines.seen(p, "Failed", 1, ev.wall), timeout=WAIT)  # fmt: skip
        ev.recorded = at - ev.wall
        return
    returns = {"pool added": 1, "drain": 1, "pool back": 2}[ev.kind]
    back = wait_for(f"pipeline {p} back after the {ev.kind} event",
                    lambda: pipelines.back(p, returns, ev.wall), timeout=WAIT)  # fmt: skip
    # A drain's departure may last one pass (it comes back at once): its record is its
    # Left phase when it was seen, else its return.
    left = pipelines.seen(p, "Left", 0, ev.wall) if ev.kind == "drain" else None
    # A join is the operator's to act on once its nodes are Ready.
    ev.recorded = (left or back) - (ev.wall if ev.kind == "drain" else ev.ready or ev.wall)
    ev.first_step = wait_for(
        f"pipeline {p} training with the other after the {ev.kind} event",
        lambda: logs.rejoined_after(ev.wall, p),
        timeout=WAIT,
    )
