"""A chaos schedule with real training (`make chaos`; issue 14 item 5).

One 3-stage job of real worker processes, run by the chart-installed operator against the
real control plane (relaytrain_testkit.harness.operator_env) with a MinIO of its own, takes
in one run, at seeded steps, one after the other:

- five stage SIGKILLs (victims seeded), one of them while a checkpoint is being written
  (the committing last stage is held with SIGSTOP once the workers report the checkpoint
  step and killed once another stage's files of that step are in the store, its manifest
  not), and one followed by a SIGKILL of the operator pod while the replacement is in flight;
- MinIO stopped for 12 s and started again at its address;
- the node under a stage deleted, its pool full, so that the stage moves to another pool;
- the link between stages 0 and 1 cut mid-step (its TCP connections reset with `ss -K`).

The job must succeed, with a final loss within 2 % of an uninterrupted run of the same job
and seed (on a MinIO and GPUs of its own, which no fault touches, started as the outage is
due: it trains while the chaos job waits for its store); every committed checkpoint
verifies (every file's checksum against its manifest); no two live pods ever hold one stage
(a watch of every pod event); and no stage process was ever restarted but the victims'. A
table of the faults, the step each hit, the steps redone and the seconds to recover, and
the goodput against the uninterrupted run, is printed.
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

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]

SEED = 20261124
STEPS, EVERY = 400, 10
OUTAGE_SECONDS = 12.0
LOSS_TOLERANCE = 0.02
"""The chaos run's final loss against the uninterrupted run's, relative."""
SCHEDULE = ["kill", "kill-mid-checkpoint", "kill+operator", "minio", "kill", "node", "link",
            "kill"]  # fmt: skip
"""The faults in the order they are injected (five of them kill a stage)."""
RECOVER_SECONDS = 300.0
LINK_PORT = 29500


@pytest.fixture(scope="module")
def env(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with chaos_env(kube_cluster, tmp_path_factory.mktemp("chaos")) as parts:
        yield parts


def _stage_pid(e: dict[str, Any], name: str, k: int) -> int:
    local = e["runner"].local_pod(e["ns"], f"{name}-stage-{k}")
    assert local is not None, f"stage {k} runs no process"
    return int(local.process.pid)


def _starts(e: dict[str, Any], name: str) -> Counter[str]:
    return Counter(lp.name for lp in e["runner"].history if lp.name.startswith(f"{name}-stage-"))


def _job(minio: Any, secret: str, name: str, pools: list[str]) -> dict[str, Any]:
    return (
        tiny_job(name, minio)
        .credentials(secret)
        .training(steps=STEPS)
        .checkpoint(every_steps=EVERY, keep=100)  # every commit kept (40)
        .failure_policy(max_stage_restarts=20, backoff_seconds=0)
        .placement(pools=pools)
        .build()
    )


def test_a_chaos_schedule_with_real_training(env: dict[str, Any]) -> None:
    e = env
    core, ns = e["core"], e["ns"]
    api = core.api_client
    rng = random.Random(SEED)
    tag = uuid.uuid4().hex[:5]
    # Pools of the job's own: three GPUs for three stages, and later one spare elsewhere.
    busy = {
        "name": f"chaos{tag}-a", "product": "NVIDIA-GeForce-RTX-4090", "gpuMemoryMiB": 24564,
        "cpu": "16", "memory": "64Gi", "linkBandwidthMbps": 500, "linkLatencyMs": 30,
    }  # fmt: skip
    spare = {**busy, "name": f"chaos{tag}-b", "product": "NVIDIA-A100-SXM4-40GB",
             "gpuMemoryMiB": 40960}  # fmt: skip
    # The uninterrupted run's three GPUs: a pool of the same GPUs that the chaos job may not
    # use (its own pool stays full for the node fault).
    apart = {**busy, "name": f"chaos{tag}-c"}
    nodes = [kwok_nodes.node_manifest(pool, i) for pool in (busy, apart) for i in range(3)]
    kwok_nodes.create_nodes(api, nodes)
    created = [n["metadata"]["name"] for n in nodes]
    pools = [busy["name"], spare["name"]]
    custom = e["custom"]
    calm_run: Background | None = None
    try:
        name = "chaos"
        # A fault every 35 steps or so, at a seeded offset (rarely on a commit), the last one
        # (by step 15 + 35 * 7 + 14 = 274) well before the end: on an idle machine the job
        # trains 300 steps while the test waits out the link fault's (2026-11-28).
        targets = [15 + 35 * i + rng.randrange(1, 15) for i in range(len(SCHEDULE))]
        faults = [Fault(kind, target) for kind, target in zip(SCHEDULE, targets, strict=True)]
        pods = PodWatch(core, ns, name)
        progress = Progress(e["minio"], f"ckpt/{ns}/{name}/progress.json")
        logs = StageLogs(e["work"] / "pods" / ns, name)
        started = time.monotonic()
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL,
                                               _job(e["minio"], "s3", name, pools))  # fmt: skip
        try:
            for fault in faults:
                if fault.kind == "minio":
                    # The uninterrupted run of the same job and seed, on a store and GPUs of
                    # its own (no fault touches it), starts as the outage is due: it trains
                    # while the chaos job waits for its store.
                    calm_job = _job(e["calm_minio"], "s3-calm", "calm", [apart["name"]])
                    calm_run = Background(e, calm_job)
                progress.before(fault.target, f"{fault.kind} fault", RECOVER_SECONDS)
                fault.wall = time.time()
                injected = _inject(e, fault, name, rng, progress, spare, created)
                if fault.kind != "minio":  # the step the pipeline broke at, from its logs
                    lost = wait_for(
                        f"the {fault.kind} fault in the stages' logs",
                        lambda f=fault: logs.lost_after(f.wall),  # type: ignore[misc]
                        timeout=120,
                    )
                    fault.at_step = max(fault.at_step, lost)
                progress.wait(
                    f"training past step {fault.at_step} after the {fault.kind} fault",
                    lambda d, f=fault: d["step"] > f.at_step or d.get("done"),  # type: ignore[misc]
                    timeout=RECOVER_SECONDS,
                )
                fault.recover_s = time.monotonic() - injected
            final = finished(e, name, 900)
        finally:
            pods.stop()
        chaos_s = time.monotonic() - started
        assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
        loss = final_loss(e, e["minio"], name)
        assert calm_run is not None
        calm = calm_run.result(900)
        calm_s = calm_run.seconds
        assert calm["phase"] == "Succeeded", f"{calm}\n{diagnostics(e)}"
        calm_loss = final_loss(e, e["calm_minio"], "calm")

        # The table; what each fault rolled back to is what the stages logged restoring.
        ends = [f.wall for f in faults[1:]] + [time.time()]
        for f, end in zip(faults, ends, strict=True):
            f.restored = logs.restored_between(f.wall, end)
        print(f"\nChaos schedule (seed {SEED}), {STEPS} steps, a commit every {EVERY}:")
        print("| fault | stage | broke at step | restored commit | steps redone | recovered in "
              "| note |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        redone_total = 0
        for f in faults:
            redone = f.at_step - f.restored if f.restored is not None else 0
            redone_total += redone
            print(f"| {f.kind} | {'-' if f.stage is None else f.stage} | {f.at_step} | "
                  f"{'-' if f.restored is None else f.restored} | {redone} | "
                  f"{f.recover_s:.1f} s | {f.note} |")  # fmt: skip
        print(f"survived {len(faults)} of {len(faults)}; {redone_total} steps redone; wall "
              f"{chaos_s:.0f} s against {calm_s:.0f} s uninterrupted (goodput "
              f"{calm_s / chaos_s:.2f}); final loss {loss!r} against {calm_loss!r}; "
              f"{pods.events} pod events watched")  # fmt: skip
        # Every fault but the store's outage broke the pipeline and rolled it back to the
        # newest commit, no further than one interval; the outage rolled nothing back.
        for f in faults:
            if f.kind == "minio":
                assert f.restored is None, f
            else:
                assert f.restored is not None and 0 <= f.at_step - f.restored <= EVERY, f

        assert abs(loss - calm_loss) <= LOSS_TOLERANCE * calm_loss, (loss, calm_loss)
        # No stage ever had two live pods.
        assert pods.events > 0 and max(pods.most.values()) == 1, dict(pods.most)
        # Processes started: one per stage, plus one per fault that took that stage's
        # process (a kill, or its node's deletion); the link cut, the store's outage and the
        # operator's death restarted none.
        hit = Counter(f"{name}-stage-{f.stage}" for f in faults if f.stage is not None)
        expected = Counter({f"{name}-stage-{k}": 1 for k in range(3)}) + hit
        assert _starts(e, name) == expected, (
            f"{_starts(e, name)} processes started, {expected} expected:\n{diagnostics(e)}"
        )
        # Every commit verifies, file by file.
        commits = verify_commits(e, name, STEPS)
        print(f"{len(commits)} commits verified; status restarts {final.get('restarts')}")
    finally:
        delete_nodes(core, created)


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
    if fault.kind == "kill":
        fault.stage = rng.randrange(3)
        os.kill(_stage_pid(e, name, fault.stage), signal.SIGKILL)
        return time.monotonic()
    if fault.kind == "kill-mid-checkpoint":
        fault.stage = 2  # the last stage commits
        at, fault.at_step, written = kill_mid_commit(
            e, name, progress, EVERY, lambda: _stage_pid(e, name, 2), RECOVER_SECONDS
        )
        stages = sorted({n.split("/stage-")[1].split("/")[0] for n in written if "/stage-" in n})
        fault.note = f"step {fault.at_step}: stage(s) {', '.join(stages)} saved, no manifest"
        return at
    if fault.kind == "kill+operator":
        fault.stage = rng.randrange(3)
        pod = f"{name}-stage-{fault.stage}"
        at, fault.note = kill_then_operator(e, pod, _stage_pid(e, name, fault.stage))
        return at
    if fault.kind == "minio":
        at = time.monotonic()
        store_outage(e, OUTAGE_SECONDS)
        fault.note = f"down {OUTAGE_SECONDS:.0f} s"
        return at
    if fault.kind == "node":
        fault.stage = rng.randrange(3)
        at, fault.note = move_to_spare(e, f"{name}-stage-{fault.stage}", spare, created)
        return at
    if fault.kind == "link":
        port = next(
            p for address, p in e["runner"].ports.items()
            if address.startswith(f"{name}-stage-1.") and address.endswith(f":{LINK_PORT}")
        )  # fmt: skip
        reset = reset_connections([port])
        assert reset, "no connection to stage 1 to reset"
        fault.note = f"{reset} connection(s) to stage 1 reset"
        return time.monotonic()
    raise AssertionError(f"unknown fault {fault.kind}")
