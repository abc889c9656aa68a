"""A chaos schedule for a job of two pipelines (`make chaos`; issue 25 item 5).

One job of two 2-stage pipelines of real worker processes, run by the chart-installed
operator against the real control plane with a MinIO of its own (relaytrain_testkit.chaos),
takes in one run, at seeded steps, one after the other:

- stage SIGKILLs in both pipelines: one in pipeline 1, one in pipeline 0 (the writer's: the
  lowest pipeline training writes checkpoints, progress and history), and the writer's
  last stage killed while it commits (held with SIGSTOP once the workers report the
  checkpoint step, killed once another stage's files of that step are in the store and
  its manifest is not);
- a stage SIGKILLed and the operator pod SIGKILLed while the replacement is in flight;
- MinIO stopped for 30 s and started again at its address;
- the node under a stage deleted without notice, its pool full, so that the stage moves
  to a spare pool;
- the replica links between the pipelines cut (pipeline 1's replica connections reset with
  `ss -K`).

A pipeline a fault hits is out until it rejoins the other with its state; the other trains
on. The job must succeed with the final loss of an uninterrupted run of the same job (two
pipelines on GPUs and a MinIO of their own, started as the outage is due), bit for bit: a
pipeline rejoins with the other's state, a step a fault breaks is trained again by the
pipeline left, and a pipeline trains the same bits whoever shares the step; every
committed checkpoint verifies; no two live pods ever hold one stage; no process was
restarted but the victims'; the job's progress never steps back; and the pipeline a fault
did not hit never restores a commit (the survivors never roll back). A table of the faults,
the pipeline each hit, the step it broke at and the step it rejoined at, and the seconds
until it trained again, is printed.

It takes about three minutes here, more than the test session's budget allows: `make chaos`
runs it (with the one-pipeline schedule of test_chaos.py); `make test` leaves it out.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from relaytrain_contract.names import REPLICA_PORT
from relaytrain_testkit.chaos import (
    Background,
    Fault,
    PodWatch,
    Progress,
    StageLogs,
    chaos_env,
    delete_nodes,
    final_loss,
    finished,
    kill_mid_commit,
    kill_then_operator,
    move_to_spare,
    reset_connections,
    store_outage,
    verify_commits,
)
from relaytrain_testkit.harness import kwok_nodes
from relaytrain_testkit.harness.operator_env import GROUP, PLURAL, VERSION, diagnostics, tiny_job
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos, pytest.mark.fleet_chaos]

SEED = 20261127
STAGES, PIPELINES = 2, 2
STEPS, EVERY = 1200, 20
SPACING = 150
"""Steps between faults: a pipeline takes ten seconds or more to rejoin (a pod, a process,
its slice and a peer's state), while the other trains about ten steps a second alone."""
OUTAGE_SECONDS = 30.0
SCHEDULE = ["kill", "kill-writer", "kill-mid-checkpoint", "kill+operator", "minio", "node",
            "link"]  # fmt: skip
"""The faults in the order they are injected."""
RECOVER_SECONDS = 300.0


@pytest.fixture(scope="module")
def env(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with chaos_env(kube_cluster, tmp_path_factory.mktemp("chaos-fleet")) as parts:
        yield parts


def _pod_name(name: str, p: int, k: int) -> str:
    return f"{name}-p{p}-s{k}"


def _stage_pid(e: dict[str, Any], name: str, p: int, k: int) -> int:
    local = e["runner"].local_pod(e["ns"], _pod_name(name, p, k))
    assert local is not None, f"stage p{p}/s{k} runs no process"
    return int(local.process.pid)


def _starts(e: dict[str, Any], name: str) -> Counter[str]:
    return Counter(lp.name for lp in e["runner"].history if lp.name.startswith(f"{name}-p"))


def _job(minio: Any, secret: str, name: str, pools: list[str]) -> dict[str, Any]:
    return (
        tiny_job(name, minio)
        .credentials(secret)
        .pipeline(stages=STAGES, replicas=PIPELINES)
        .training(steps=STEPS)
        .checkpoint(every_steps=EVERY, keep=STEPS // EVERY)  # every commit kept
        .failure_policy(max_stage_restarts=20, backoff_seconds=0)
        .placement(pools=pools)
        .build()
    )


def test_a_chaos_schedule_for_two_pipelines(env: dict[str, Any]) -> None:
    e = env
    core, ns = e["core"], e["ns"]
    rng = random.Random(SEED)
    tag = uuid.uuid4().hex[:5]
    # Four GPUs for the job's four stages, a spare pool for the node fault, and four of the
    # uninterrupted run's own.
    busy = {
        "name": f"fleet{tag}-a", "product": "NVIDIA-GeForce-RTX-4090", "gpuMemoryMiB": 24564,
        "cpu": "16", "memory": "64Gi", "linkBandwidthMbps": 500, "linkLatencyMs": 30,
    }  # fmt: skip
    spare = {**busy, "name": f"fleet{tag}-b", "product": "NVIDIA-A100-SXM4-40GB",
             "gpuMemoryMiB": 40960}  # fmt: skip
    apart = {**busy, "name": f"fleet{tag}-c"}
    gpus = STAGES * PIPELINES
    nodes = [kwok_nodes.node_manifest(pool, i) for pool in (busy, apart) for i in range(gpus)]
    kwok_nodes.create_nodes(core.api_client, nodes)
    created = [n["metadata"]["name"] for n in nodes]
    calm_run: Background | None = None
    try:
        name = "fleet"
        targets = [30 + SPACING * i + rng.randrange(1, 30) for i in range(len(SCHEDULE))]
        faults = [Fault(kind, target) for kind, target in zip(SCHEDULE, targets, strict=True)]
        pods = PodWatch(core, ns, name)
        progress = Progress(e["minio"], f"ckpt/{ns}/{name}/progress.json")
        logs = StageLogs(e["work"] / "pods" / ns, name)
        started = time.monotonic()
        e["custom"].create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, _job(e["minio"], "s3", name, [busy["name"], spare["name"]])
        )
        try:
            for fault in faults:
                if fault.kind == "minio":
                    calm_job = _job(e["calm_minio"], "s3-calm", "calm", [apart["name"]])
                    calm_run = Background(e, calm_job)
                progress.before(fault.target, f"{fault.kind} fault", RECOVER_SECONDS)
                fault.wall = time.time()
                injected = _inject(e, fault, name, rng, progress, spare, created)
                _recover(fault, progress, logs, injected)
            final = finished(e, name, 900)
        finally:
            pods.stop()
        chaos_s = time.monotonic() - started
        assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
        loss = final_loss(e, e["minio"], name)
        assert calm_run is not None
        calm = calm_run.result(900)
        assert calm["phase"] == "Succeeded", f"{calm}\n{diagnostics(e)}"
        calm_loss = final_loss(e, e["calm_minio"], "calm")

        ends = [f.wall for f in faults[1:]] + [time.time()]
        print(f"\nChaos schedule for {PIPELINES} pipelines of {STAGES} stages (seed {SEED}), "
              f"{STEPS} steps, a commit every {EVERY}:")  # fmt: skip
        print("| fault | hit | broke at step | rejoined at step | back in | others restored "
              "| note |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        rolled_back = []
        for f, end in zip(faults, ends, strict=True):
            hit = _hit(f)
            others = set(range(PIPELINES)) - hit
            f.restored = logs.restored_between(f.wall, end, others) if others else None
            if f.restored is not None:
                rolled_back.append(f)
            back = min(filter(None, (logs.rejoined_after(f.wall, p) for p in hit)), default=None)
            where = "-" if not hit else (
                f"p{f.pipeline}/s{f.stage}" if f.stage is not None else "both"
            )  # fmt: skip
            print(f"| {f.kind} | {where} | {f.at_step} | {'-' if back is None else back[1]} | "
                  f"{f.recover_s:.1f} s | {'-' if f.restored is None else f.restored} | "
                  f"{f.note} |")  # fmt: skip
        print(f"survived {len(faults)} of {len(faults)}; wall {chaos_s:.0f} s against "
              f"{calm_run.seconds:.0f} s uninterrupted; final loss {loss!r} against "
              f"{calm_loss!r}; {pods.events} pod events watched")  # fmt: skip

        # The survivors never rolled back, and the job's progress never stepped back.
        assert rolled_back == [], rolled_back
        assert progress.seen == sorted(progress.seen), "progress.json stepped back"
        assert loss == calm_loss, (loss, calm_loss)
        # No stage ever had two live pods.
        assert pods.events > 0 and max(pods.most.values()) == 1, dict(pods.most)
        # Processes started: one per stage, plus one per fault that took a stage's process
        # (a kill, or its node's deletion); the link cut, the outage and the operator's
        # death restarted none.
        taken = Counter(
            _pod_name(name, f.pipeline, f.stage)
            for f in faults
            if f.stage is not None and f.pipeline is not None
        )
        every = {_pod_name(name, p, k): 1 for p in range(PIPELINES) for k in range(STAGES)}
        assert _starts(e, name) == Counter(every) + taken, (_starts(e, name), taken)
        commits = verify_commits(e, name, STEPS)
        print(f"{len(commits)} commits verified; status restarts {final.get('restarts')}")
    finally:
        delete_nodes(core, created)


def _hit(fault: Fault) -> set[int]:
    """The pipelines `fault` took out: none for the store's outage, both for the link cut."""
    if fault.kind == "minio":
        return set()
    if fault.kind == "link":
        return set(range(PIPELINES))
    assert fault.pipeline is not None
    return {fault.pipeline}


def _recover(fault: Fault, progress: Progress, logs: StageLogs, injected: float) -> None:
    """Wait until the job got over `fault`: the pipeline it hit rejoined (for the link cut,
    either), or after the outage, the job trained past the step it was at."""
    if fault.kind == "minio":
        progress.wait(
            f"training past step {fault.at_step} after the outage",
            lambda d: d["step"] > fault.at_step or d.get("done"),
            timeout=RECOVER_SECONDS,
        )
    else:
        if fault.kind != "link":  # a replica link's end breaks no pipeline's own links
            fault.at_step = max(
                fault.at_step,
                wait_for(
                    f"the {fault.kind} fault in the stages' logs",
                    lambda: logs.lost_after(fault.wall),
                    timeout=120,
                ),
            )
        wait_for(
            f"the pipeline the {fault.kind} fault took out to rejoin",
            lambda: (
                any(logs.rejoined_after(fault.wall, p) for p in _hit(fault))
                or (progress.now() or {}).get("done")
            ),
            timeout=RECOVER_SECONDS,
        )
    fault.recover_s = time.monotonic() - injected


def _inject(
    e: dict[str, Any],
    fault: Fault,
    name: str,
    rng: random.Random,
    progress: Progress,
    spare: dict[str, Any],
    created: list[str],
) -> float:
    """Inject `fault`; returns the moment it took effect (monotonic)."""
    doc = progress.now() or {}
    fault.at_step = int(doc.get("step", 0))
    if fault.kind in ("kill", "kill-writer"):
        fault.pipeline = 1 if fault.kind == "kill" else 0
        fault.stage = rng.randrange(STAGES)
        os.kill(_stage_pid(e, name, fault.pipeline, fault.stage), signal.SIGKILL)
        return time.monotonic()
    if fault.kind == "kill-mid-checkpoint":
        # The writer's pipeline (0, the lowest training) commits from its last stage.
        fault.pipeline, fault.stage = 0, STAGES - 1
        at, fault.at_step, written = kill_mid_commit(
            e, name, progress, EVERY, lambda: _stage_pid(e, name, 0, STAGES - 1),
            RECOVER_SECONDS,
        )  # fmt: skip
        fault.note = f"step {fault.at_step}: {len(written)} file(s) saved, no manifest"
        return at
    if fault.kind == "kill+operator":
        fault.pipeline, fault.stage = rng.randrange(PIPELINES), rng.randrange(STAGES)
        pod = _pod_name(name, fault.pipeline, fault.stage)
        at, fault.note = kill_then_operator(
            e, pod, _stage_pid(e, name, fault.pipeline, fault.stage)
        )
        return at
    if fault.kind == "minio":
        at = time.monotonic()
        store_outage(e, OUTAGE_SECONDS)
        fault.note = f"down {OUTAGE_SECONDS:.0f} s"
        return at
    if fault.kind == "node":
        fault.pipeline, fault.stage = rng.randrange(PIPELINES), rng.randrange(STAGES)
        pod = _pod_name(name, fault.pipeline, fault.stage)
        at, fault.note = move_to_spare(e, pod, spare, created)
        return at
    if fault.kind == "link":
        # The replica listeners of pipeline 1: each at its own loopback IP (the runner's).
        hosts = [ip for host, ip in e["runner"].ips.items() if host.startswith(f"{name}-p1-")]
        assert hosts, e["runner"].ips
        reset = sum(reset_connections([REPLICA_PORT], host) for host in hosts)
        assert reset, "no replica connection to reset"
        fault.note = f"{reset} replica connection(s) to pipeline 1 reset"
        return time.monotonic()
    raise AssertionError(f"unknown fault {fault.kind}")
