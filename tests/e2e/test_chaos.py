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

import io
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from relaytrain_testkit.harness import kwok_nodes
from relaytrain_testkit.harness.minio_server import start_minio, stop_minio
from relaytrain_testkit.harness.operator_env import (
    GROUP,
    PLURAL,
    VERSION,
    diagnostics,
    operator_env,
    stored_json,
    tiny_job,
)
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]

SEED = 20261124
STEPS, EVERY = 300, 10
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
    work = tmp_path_factory.mktemp("chaos")
    (work / "minio").mkdir()
    (work / "minio-calm").mkdir()
    proc, minio = start_minio(work / "minio", work / "minio.log")
    held = {"minio": proc}
    try:
        # The uninterrupted run's store: one of its own, so that the outage is not its.
        held["calm"], calm = start_minio(work / "minio-calm", work / "minio-calm.log")
        with operator_env(kube_cluster, minio, work) as parts:
            _mirror(minio, calm, ["models/", "data/"])
            parts["core"].create_namespaced_secret(
                parts["ns"],
                client.V1Secret(
                    metadata=client.V1ObjectMeta(name="s3-calm"),
                    string_data={
                        "AWS_ACCESS_KEY_ID": calm.access_key,
                        "AWS_SECRET_ACCESS_KEY": calm.secret_key,
                    },
                ),
            )
            yield {**parts, "held": held, "calm_minio": calm}
    finally:
        for server in held.values():
            stop_minio(server)


def _mirror(src: Any, dst: Any, prefixes: list[str]) -> None:
    """Copies the objects under `prefixes` from one MinIO's bucket to another's."""
    a, b = src.client(), dst.client()
    if not b.bucket_exists(dst.bucket):
        b.make_bucket(dst.bucket)
    for prefix in prefixes:
        for obj in a.list_objects(src.bucket, prefix, recursive=True):
            resp = a.get_object(src.bucket, obj.object_name)
            try:
                data = resp.read()
            finally:
                resp.close()
                resp.release_conn()
            b.put_object(dst.bucket, obj.object_name, io.BytesIO(data), len(data))


@dataclass
class Fault:
    kind: str
    target: int
    """The step the workers reach before it is injected."""
    stage: int | None = None
    """The stage it hits (killed, moved), if one."""
    at_step: int = 0
    """The step training broke at (the stages' logs; progress.json's when nothing broke)."""
    wall: float = 0.0
    """When it was injected (time.time(), to read the stages' logs by)."""
    restored: int | None = None
    """The commit the stages restored after it (their logs), if they rolled back."""
    recover_s: float = 0.0
    """Seconds from the injection until the job trained past `at_step`."""
    note: str = ""


class PodWatch:
    """Every event of the job's pods, from a watch: the most pods ever live at once for one
    stage (live: not being deleted, not Succeeded or Failed)."""

    def __init__(self, core: Any, ns: str, job: str) -> None:
        self.core, self.ns, self.job = core, ns, job
        self.live: dict[str, str] = {}  # pod uid -> stage
        self.most: Counter[str] = Counter()
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        version = None
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod, self.ns, timeout_seconds=5,
                    label_selector=f"relaytrain.io/job={self.job}", resource_version=version,
                ):  # fmt: skip
                    pod = event["object"]
                    version = pod.metadata.resource_version
                    self._see(event["type"], pod)
                    if self._stop.is_set():
                        break
            except Exception:  # an expired version or a dropped stream: list afresh
                version = None

    def _see(self, kind: str, pod: Any) -> None:
        self.events += 1
        stage = (pod.metadata.labels or {}).get("relaytrain.io/stage", "?")
        alive = (
            kind != "DELETED"
            and pod.metadata.deletion_timestamp is None
            and (pod.status.phase or "Pending") not in ("Succeeded", "Failed")
        )
        if alive:
            self.live[pod.metadata.uid] = stage
        else:
            self.live.pop(pod.metadata.uid, None)
        count = sum(1 for s in self.live.values() if s == stage)
        self.most[stage] = max(self.most[stage], count)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


class Progress:
    """progress.json of the job, read straight from MinIO (None while it cannot be read)."""

    def __init__(self, minio: Any, key: str) -> None:
        self.minio, self.key = minio, key
        self.mc = minio.client()

    def now(self) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = stored_json(self.mc, self.minio.bucket, self.key)
        except Exception:
            return None
        return doc

    def wait(
        self,
        what: str,
        until: Callable[[dict[str, Any]], bool],
        timeout: float,
        interval: float = 0.05,
    ) -> Any:
        def ready() -> Any:
            doc = self.now()
            return doc if doc is not None and until(doc) else None

        return wait_for(what, ready, timeout=timeout, interval=interval)


_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ relaytrain\.stage: Stage \d+ "
    r"(?:lost a link at step (\d+)|restored committed step (\d+))",
    re.MULTILINE,
)


class StageLogs:
    """What the job's stage processes logged (every container.log of every pod of theirs):
    the steps training broke at and the commits restored, with when (their clock is ours)."""

    SLACK = 0.1
    """Seconds a line may read earlier than the fault it follows (the logs truncate to the
    millisecond). No more: the previous fault's restores can be logged well under a second
    before the next fault (a deleted node's stage stops a second or so late, that many steps
    nearer the next fault), and they are not the next fault's."""

    def __init__(self, pods_dir: Path, job: str) -> None:
        self.pods_dir, self.job = pods_dir, job

    def _lines(self) -> list[tuple[float, int | None, int | None]]:
        out = []
        for path in self.pods_dir.glob(f"{self.job}-stage-*/*/container.log"):
            for m in _LINE.finditer(path.read_text(errors="replace")):
                when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
                lost, restored = m.group(3), m.group(4)
                out.append((when + int(m.group(2)) / 1000, lost and int(lost),
                            restored and int(restored)))  # fmt: skip
        return out

    def lost_after(self, t: float) -> int | None:
        """The highest step a stage lost a link at since `t` (None: none yet)."""
        t -= self.SLACK
        steps = [lost for when, lost, _ in self._lines() if when >= t and lost is not None]
        return max(steps) if steps else None

    def restored_between(self, t0: float, t1: float) -> int | None:
        """The lowest commit a stage restored between `t0` and `t1`."""
        t0 -= self.SLACK
        steps = [r for when, _, r in self._lines() if t0 <= when < t1 and r is not None]
        return min(steps) if steps else None


def _stage_pid(e: dict[str, Any], name: str, k: int) -> int:
    local = e["runner"].local_pod(e["ns"], f"{name}-stage-{k}")
    assert local is not None, f"stage {k} runs no process"
    return int(local.process.pid)


def _starts(e: dict[str, Any], name: str) -> Counter[str]:
    return Counter(lp.name for lp in e["runner"].history if lp.name.startswith(f"{name}-stage-"))


def _status(e: dict[str, Any], name: str) -> dict[str, Any]:
    job = e["custom"].get_namespaced_custom_object(GROUP, VERSION, e["ns"], PLURAL, name)
    return job.get("status") or {}


def _finished(e: dict[str, Any], name: str, timeout: float) -> dict[str, Any]:
    try:
        return wait_for(  # type: ignore[no-any-return]
            f"{name} to finish",
            lambda: (st := _status(e, name)).get("phase") in ("Succeeded", "Failed") and st,
            timeout=timeout,
        )
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None


def _job(minio: Any, secret: str, name: str, pools: list[str]) -> dict[str, Any]:
    return (
        tiny_job(name, minio)
        .credentials(secret)
        .training(steps=STEPS)
        .checkpoint(every_steps=EVERY, keep=100)  # every commit kept (30)
        .failure_policy(max_stage_restarts=20, backoff_seconds=0)
        .placement(pools=pools)
        .build()
    )


class Background:
    """A job created now and waited for in a thread of its own: its final status and the
    seconds from its creation until it was seen finished."""

    def __init__(self, e: dict[str, Any], job: dict[str, Any]) -> None:
        self.status: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._started = time.monotonic()
        e["custom"].create_namespaced_custom_object(GROUP, VERSION, e["ns"], PLURAL, job)
        name = job["metadata"]["name"]
        self._thread = threading.Thread(target=self._wait, args=(e, name), daemon=True)
        self._thread.start()

    def _wait(self, e: dict[str, Any], name: str) -> None:
        try:
            self.status = _finished(e, name, 900)
        except BaseException as exc:  # re-raised by result()
            self.error = exc
        self.seconds = time.monotonic() - self._started

    def result(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"no end of the job after {timeout:g} s"
        if self.error is not None:
            raise self.error
        assert self.status is not None
        return self.status


def _final_loss(e: dict[str, Any], minio: Any, name: str) -> float:
    key = f"ckpt/{e['ns']}/{name}/loss-history.json"
    return float(stored_json(minio.client(), minio.bucket, key)[-1]["loss"])


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
        # (by step 15 + 35 * 7 + 14 = 274) well before the end.
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
                doc = progress.wait(
                    f"step {fault.target} before the {fault.kind} fault",
                    lambda d, f=fault: d["step"] >= f.target or d.get("done"),  # type: ignore[misc]
                    timeout=RECOVER_SECONDS,
                )
                assert not doc.get("done"), f"the job finished before the {fault.kind} fault"
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
            final = _finished(e, name, 900)
        finally:
            pods.stop()
        chaos_s = time.monotonic() - started
        assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
        loss = _final_loss(e, e["minio"], name)
        assert calm_run is not None
        calm = calm_run.result(900)
        calm_s = calm_run.seconds
        assert calm["phase"] == "Succeeded", f"{calm}\n{diagnostics(e)}"
        calm_loss = _final_loss(e, e["calm_minio"], "calm")

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
        assert _starts(e, name) == expected, (_starts(e, name), expected)
        # Every commit verifies, file by file.
        from relaytrain_worker.state import checkpoint as ckpt
        from relaytrain_worker.state.store import open_store

        minio = e["minio"]
        store = open_store(f"s3://{minio.bucket}/ckpt", endpoint=minio.url,
                           access_key=minio.access_key, secret_key=minio.secret_key)  # fmt: skip
        prefix = f"{ns}/{name}"
        commits = ckpt.committed_steps(store, prefix)
        assert commits and commits[-1] == STEPS
        for step in commits:
            ckpt.verify_step(store, prefix, step)
        print(f"{len(commits)} commits verified; status restarts {final.get('restarts')}")
    finally:
        for node in created:
            try:
                core.delete_node(node)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


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
    core, ns = e["core"], e["ns"]
    doc = progress.now() or {}
    fault.at_step = int(doc.get("step", 0))
    if fault.kind == "kill":
        fault.stage = rng.randrange(3)
        os.kill(_stage_pid(e, name, fault.stage), signal.SIGKILL)
        return time.monotonic()
    if fault.kind == "kill-mid-checkpoint":
        return _kill_mid_checkpoint(e, fault, name, progress)
    if fault.kind == "kill+operator":
        fault.stage = rng.randrange(3)
        pod = f"{name}-stage-{fault.stage}"
        old = core.read_namespaced_pod(pod, ns).metadata.uid
        os.kill(_stage_pid(e, name, fault.stage), signal.SIGKILL)
        at = time.monotonic()

        def replacement_created() -> Any:
            now = _pod(core, ns, pod)
            return now if now is not None and now.metadata.uid != old else None

        new = wait_for("the replacement pod", replacement_created, timeout=120, interval=0.02)
        release = e["release"]
        operator = release.operator_pod()
        local = release.runner.local_pod(release.namespace, operator.metadata.name)
        os.kill(local.process.pid, signal.SIGKILL)
        # In flight: created, and its stage not yet training (its process starting, or not
        # even started by the kubelet).
        started = e["runner"].local_pod(ns, pod)
        loading = started is not None and started.uid == new.metadata.uid
        fault.note = "operator killed; the replacement " + (
            "pod's process loading" if loading else "pod not yet started"
        )
        return at
    if fault.kind == "minio":
        at = time.monotonic()
        stop_minio(e["held"]["minio"])
        time.sleep(OUTAGE_SECONDS)  # the outage itself
        e["held"]["minio"], _ = start_minio(
            e["work"] / "minio", e["work"] / "minio.log", again=e["minio"]
        )
        fault.note = f"down {OUTAGE_SECONDS:.0f} s"
        return at
    if fault.kind == "node":
        fault.stage = rng.randrange(3)
        pod = core.read_namespaced_pod(f"{name}-stage-{fault.stage}", ns)
        node = kwok_nodes.node_manifest(spare, 0)
        kwok_nodes.create_nodes(core.api_client, [node])
        created.append(node["metadata"]["name"])
        # The spare GPU is up (Ready, its not-ready taint gone) before the node goes: a
        # replacement placed while none is free waits on its own pool (issue 23: a waiting
        # stage does not yet move to a GPU that joins later).
        wait_for("the spare node to be Ready", lambda: _ready(core, node["metadata"]["name"]))
        core.delete_node(pod.spec.node_name)
        at = time.monotonic()
        moved = wait_for(
            "the stage on the spare pool",
            lambda: (
                (p := _pod(core, ns, f"{name}-stage-{fault.stage}")) is not None
                and p.spec.node_name == node["metadata"]["name"]
                and p
            ),
            timeout=120,
        )
        fault.note = f"{pod.spec.node_name} deleted; moved to {moved.spec.node_name}"
        return at
    if fault.kind == "link":
        port = next(
            p for address, p in e["runner"].ports.items()
            if address.startswith(f"{name}-stage-1.") and address.endswith(f":{LINK_PORT}")
        )  # fmt: skip
        cut = subprocess.run(
            ["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert cut.returncode == 0 and "ESTAB" in cut.stdout, (cut.stdout, cut.stderr)
        fault.note = f"{cut.stdout.count('ESTAB')} connection(s) to stage 1 reset"
        return time.monotonic()
    raise AssertionError(f"unknown fault {fault.kind}")


def _ready(core: Any, name: str) -> bool:
    node = core.read_node(name)
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    taints = node.spec.taints or []
    return ready and not any(t.key.startswith("node.kubernetes.io/") for t in taints)


def _pod(core: Any, ns: str, name: str) -> Any:
    try:
        pod = core.read_namespaced_pod(name, ns)
    except client.ApiException:
        return None
    return pod if pod.metadata.deletion_timestamp is None else None


def _kill_mid_checkpoint(e: dict[str, Any], fault: Fault, name: str, progress: Progress) -> float:
    """Hold the last stage (it commits) with SIGSTOP as soon as the workers report a
    checkpoint step not yet committed; once stage 0's files of that step are in the store
    and its manifest is not, kill it. Tried at the next checkpoint step if the commit won."""
    mc, bucket = e["minio"].client(), e["minio"].bucket
    base = f"ckpt/{e['ns']}/{name}"
    fault.stage = 2
    for _ in range(10):
        doc = progress.wait(
            "a checkpoint step being committed",
            lambda d: d["step"] % EVERY == 0 and (d.get("lastCommittedStep") or 0) < d["step"],
            timeout=RECOVER_SECONDS,
            interval=0.005,  # the window is a checkpoint's save: tens of milliseconds
        )
        step = int(doc["step"])
        pid = _stage_pid(e, name, 2)
        os.kill(pid, signal.SIGSTOP)

        def objects(step: int = step) -> list[str]:
            return [o.object_name for o in mc.list_objects(bucket, f"{base}/step-{step}/",
                                                           recursive=True)]  # fmt: skip

        if any(n.endswith("manifest.json") for n in objects()):
            os.kill(pid, signal.SIGCONT)  # the commit won the race: try the next commit,
            progress.wait(  # once training is past this one
                f"training past step {step}", lambda d, s=step: d["step"] > s,
                timeout=RECOVER_SECONDS,
            )  # fmt: skip
            continue
        try:
            wait_for(
                "stage 0's files of the step",
                lambda: any("/stage-0/" in n for n in objects()),
                timeout=60,
                interval=0.05,
            )
        except AssertionError:
            os.kill(pid, signal.SIGCONT)
            raise
        os.kill(pid, signal.SIGKILL)
        at = time.monotonic()
        written = objects()
        assert not any(n.endswith("manifest.json") for n in written)
        fault.at_step = step
        stages = sorted({n.split("/stage-")[1].split("/")[0] for n in written if "/stage-" in n})
        fault.note = f"step {step}: stage(s) {', '.join(stages)} saved, no manifest"
        return at
    raise AssertionError("every checkpoint was committed before the last stage could be held")
