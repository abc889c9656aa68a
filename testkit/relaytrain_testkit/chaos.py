"""What the chaos schedules share (tests/e2e/test_chaos.py: one pipeline; test_chaos_fleet.py:
several): their environment (the chart-installed operator, a MinIO the faults may stop and
one of the uninterrupted run's own), the faults' records, a watch of the job's pods, the
job's progress read from the store, and what the stages logged.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
)
from relaytrain_testkit.harness.waiting import wait_for


@contextmanager
def chaos_env(kube_cluster: Any, work: Path) -> Iterator[dict[str, Any]]:
    """operator_env's parts on a MinIO of the schedule's own (`held["minio"]`: a fault may
    stop it and start it again), plus `calm_minio`, the uninterrupted run's store (no fault
    touches it), with the model and data mirrored and its keys in Secret `s3-calm`."""
    (work / "minio").mkdir()
    (work / "minio-calm").mkdir()
    proc, minio = start_minio(work / "minio", work / "minio.log")
    held = {"minio": proc}
    try:
        held["calm"], calm = start_minio(work / "minio-calm", work / "minio-calm.log")
        with operator_env(kube_cluster, minio, work) as parts:
            mirror(minio, calm, ["models/", "data/"])
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


def store_outage(e: dict[str, Any], seconds: float) -> None:
    """The schedule's MinIO stopped for `seconds`, then started again at its address."""
    stop_minio(e["held"]["minio"])
    time.sleep(seconds)  # the outage itself
    e["held"]["minio"], _ = start_minio(
        e["work"] / "minio", e["work"] / "minio.log", again=e["minio"]
    )


def mirror(src: Any, dst: Any, prefixes: list[str]) -> None:
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
    pipeline: int | None = None
    """The pipeline of that stage, in a job of several."""
    at_step: int = 0
    """The step training broke at (the stages' logs; progress.json's when nothing broke)."""
    wall: float = 0.0
    """When it was injected (time.time(), to read the stages' logs by)."""
    restored: int | None = None
    """The commit the stages restored after it (their logs), if they rolled back."""
    recover_s: float = 0.0
    """Seconds from the injection until the job trained past `at_step` (or, in a job of
    several pipelines, until the pipeline it hit trained again)."""
    note: str = ""


class PodWatch:
    """Every event of the job's pods, from a watch: the most pods ever live at once for one
    stage (live: not being deleted, not Succeeded or Failed)."""

    def __init__(self, core: Any, ns: str, job: str) -> None:
        self.core, self.ns, self.job = core, ns, job
        self.live: dict[str, str] = {}  # pod uid -> its stage (pod name)
        self.most: Counter[str] = Counter()
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        version = None
        while not self._stop.is_set():
            w = watch.Watch()  # type: ignore[no-untyped-call]
            try:
                for event in w.stream(  # type: ignore[no-untyped-call]
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
        stage = str(pod.metadata.name)  # one name per stage: a replacement takes it over
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
    """progress.json of the job, read straight from MinIO (None while it cannot be read);
    `seen` keeps every step read, in order, and `read_at` when each was read; `failed`, when
    a read failed and why; `slow`, each read that took over a second (when it began, how
    long); `waits`, what each wait waited for and when it began."""

    SLOW = 1.0
    """Seconds a read may take before it is worth telling (they take milliseconds)."""
    TIMEOUT = 5.0
    """Seconds one read may take: a request stuck on a store that went away and came back
    (minio's default waits five minutes) fails, and the next poll asks again."""

    def __init__(self, minio: Any, key: str) -> None:
        self.minio, self.key = minio, key
        self.mc = minio.client(timeout=self.TIMEOUT)
        self.seen: list[int] = []
        self.read_at: list[float] = []
        self.failed: list[tuple[float, str]] = []
        self.slow: list[tuple[float, float]] = []
        self.waits: list[tuple[float, str]] = []

    def now(self) -> dict[str, Any] | None:
        began = time.time()
        try:
            doc: dict[str, Any] = stored_json(self.mc, self.minio.bucket, self.key)
        except Exception as exc:
            self.failed.append((time.time(), repr(exc)[:160]))
            return None
        finally:
            if time.time() - began > self.SLOW:
                self.slow.append((began, time.time() - began))
        self.seen.append(int(doc.get("step", 0)))
        self.read_at.append(time.time())
        return doc

    def before(self, target: int, what: str, timeout: float) -> dict[str, Any]:
        """Waits for the job to reach step `target`, where `what` (a fault, an event) is due,
        and returns the record read; fails when the job finished first, saying what the reads
        since the last wait but one began saw: in a schedule, the wait for the fault before
        this one, its injection and the wait for the job to recover from it."""
        since = self.waits[-2:][0][0] if self.waits else time.time()
        doc: dict[str, Any] = self.wait(
            f"step {target} before the {what}",
            lambda d: d["step"] >= target or bool(d.get("done")),
            timeout=timeout,
        )
        assert not doc.get("done"), (
            f"the job finished before the {what} (due at step {target}): {self.reads_since(since)}"
        )
        return doc

    def reads_since(self, t: float) -> str:
        """What the reads since `t` (time.time()) saw, for a failed wait's message: the waits
        begun, how many read and failed, the steps read last with when, the slow reads and
        the last failure. A job that finished unseen is told apart from a reader that could
        not read, was stuck in a read, or did not ask."""
        read = [(w, s) for s, w in zip(self.seen, self.read_at, strict=True) if w >= t]
        failed = [(w, why) for w, why in self.failed if w >= t]
        waits = "; ".join(f"+{w - t:.1f} s {what}" for w, what in self.waits if w >= t)
        last = ", ".join(f"step {s} at +{w - t:.1f} s" for w, s in read[-4:]) or "none"
        slow = ", ".join(f"{d:.1f} s at +{w - t:.1f} s" for w, d in self.slow if w >= t)
        why = f"; the last failure at +{failed[-1][0] - t:.1f} s: {failed[-1][1]}" if failed else ""
        return (
            f"since then (waits: {waits or 'none'}) {len(read)} read(s) and {len(failed)} "
            f"failed; the last: {last}; slow reads: {slow or 'none'}{why}"
        )

    def step_at(self, t: float) -> int:
        """The highest step read at or before `t` (time.time()); 0 before the first read."""
        return max((s for s, w in zip(self.seen, self.read_at, strict=True) if w <= t), default=0)

    def stepped_back(self, t0: float, t1: float) -> int:
        """How many steps the job's progress went back between `t0` and `t1` (time.time()):
        the highest step read before `t0` less the lowest read in between, 0 if none lower."""
        before = [s for s, t in zip(self.seen, self.read_at, strict=True) if t < t0]
        within = [s for s, t in zip(self.seen, self.read_at, strict=True) if t0 <= t < t1]
        return max(0, max(before) - min(within)) if before and within else 0

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

        self.waits.append((time.time(), what))
        return wait_for(what, ready, timeout=timeout, interval=interval)


_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ relaytrain\.stage: Stage (?:p(\d+)/s)?\d+ "
    r"(?:lost a link at step (\d+)|restored committed step (\d+)|rejoined at step (\d+))",
    re.MULTILINE,
)


@dataclass(frozen=True)
class _Line:
    when: float
    pipeline: int | None
    lost: int | None
    restored: int | None
    rejoined: int | None


class StageLogs:
    """What the job's stage processes logged (every container.log of every pod of theirs):
    the steps training broke at, the commits restored and the steps pipelines rejoined at,
    with when (their clock is ours) and, in a job of several pipelines, by which pipeline."""

    SLACK = 0.1
    """Seconds a line may read earlier than the fault it follows (the logs truncate to the
    millisecond). No more: the previous fault's restores can be logged well under a second
    before the next fault (a deleted node's stage stops a second or so late, that many steps
    nearer the next fault), and they are not the next fault's."""

    def __init__(self, pods_dir: Path, job: str) -> None:
        self.pods_dir, self.job = pods_dir, job

    def _lines(self) -> list[_Line]:
        out = []
        for path in self.pods_dir.glob(f"{self.job}-*/*/container.log"):
            for m in _LINE.finditer(path.read_text(errors="replace")):
                when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
                p, lost, restored, rejoined = (
                    None if g is None else int(g) for g in m.group(3, 4, 5, 6)
                )
                out.append(_Line(when + int(m.group(2)) / 1000, p, lost, restored, rejoined))
        return out

    def lost_after(self, t: float) -> int | None:
        """The highest step a stage lost a link at since `t` (None: none yet)."""
        t -= self.SLACK
        steps = [x.lost for x in self._lines() if x.when >= t and x.lost is not None]
        return max(steps) if steps else None

    def restored_between(
        self, t0: float, t1: float, pipelines: set[int] | None = None
    ) -> int | None:
        """The lowest commit a stage (of `pipelines`, when given) restored between `t0` and
        `t1`."""
        t0 -= self.SLACK
        steps = [
            x.restored
            for x in self._lines()
            if t0 <= x.when < t1
            and x.restored is not None
            and (pipelines is None or x.pipeline in pipelines)
        ]
        return min(steps) if steps else None

    def rejoined_after(self, t: float, pipeline: int) -> tuple[float, int] | None:
        """(when, step) pipeline `pipeline`'s first stage to rejoin since `t` did (None: not
        yet)."""
        t -= self.SLACK
        found = [
            (x.when, x.rejoined)
            for x in self._lines()
            if x.when >= t and x.rejoined is not None and x.pipeline == pipeline
        ]
        return min(found) if found else None


def job_status(e: dict[str, Any], name: str) -> dict[str, Any]:
    job = e["custom"].get_namespaced_custom_object(GROUP, VERSION, e["ns"], PLURAL, name)
    return job.get("status") or {}


def finished(e: dict[str, Any], name: str, timeout: float) -> dict[str, Any]:
    """The job's status once it Succeeded or Failed (fails with the diagnostics after
    `timeout` seconds)."""
    try:
        return wait_for(  # type: ignore[no-any-return]
            f"{name} to finish",
            lambda: (st := job_status(e, name)).get("phase") in ("Succeeded", "Failed") and st,
            timeout=timeout,
        )
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None


class Background:
    """A job created now and waited for in a thread of its own: its final status, the
    seconds from its creation until it was seen finished, and when that was (`ended`,
    time.time())."""

    def __init__(self, e: dict[str, Any], job: dict[str, Any]) -> None:
        self.status: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.ended = 0.0
        self._started = time.monotonic()
        e["custom"].create_namespaced_custom_object(GROUP, VERSION, e["ns"], PLURAL, job)
        name = job["metadata"]["name"]
        self._thread = threading.Thread(target=self._wait, args=(e, name), daemon=True)
        self._thread.start()

    def _wait(self, e: dict[str, Any], name: str) -> None:
        try:
            self.status = finished(e, name, 900)
        except BaseException as exc:  # re-raised by result()
            self.error = exc
        self.seconds = time.monotonic() - self._started
        self.ended = time.time()

    def result(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"no end of the job after {timeout:g} s"
        if self.error is not None:
            raise self.error
        assert self.status is not None
        return self.status


def final_loss(e: dict[str, Any], minio: Any, name: str) -> float:
    key = f"ckpt/{e['ns']}/{name}/loss-history.json"
    return float(stored_json(minio.client(), minio.bucket, key)[-1]["loss"])


def verify_commits(e: dict[str, Any], name: str, last: int) -> list[int]:
    """Every commit of the job, each verified file by file against its manifest; the last
    must be step `last`. Returns the steps."""
    from relaytrain_worker.state import checkpoint as ckpt
    from relaytrain_worker.state.store import open_store

    minio = e["minio"]
    store = open_store(f"s3://{minio.bucket}/ckpt", endpoint=minio.url,
                       access_key=minio.access_key, secret_key=minio.secret_key)  # fmt: skip
    prefix = f"{e['ns']}/{name}"
    commits: list[int] = ckpt.committed_steps(store, prefix)
    assert commits and commits[-1] == last, commits
    for step in commits:
        ckpt.verify_step(store, prefix, step)
    return commits


def node_ready(core: Any, name: str) -> bool:
    """Node `name` is Ready and without a node.kubernetes.io/ taint."""
    node = core.read_node(name)
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    taints = node.spec.taints or []
    return ready and not any(t.key.startswith("node.kubernetes.io/") for t in taints)


def live_pod(core: Any, ns: str, name: str) -> Any:
    """Pod `name` unless it is gone or being deleted (None then)."""
    try:
        pod = core.read_namespaced_pod(name, ns)
    except client.ApiException:
        return None
    return pod if pod.metadata.deletion_timestamp is None else None


def delete_nodes(core: Any, names: list[str]) -> None:
    for node in names:
        try:
            core.delete_node(node)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


# -- faults both schedules inject -------------------------------------------------------


def kill_then_operator(e: dict[str, Any], pod: str, pid: int) -> tuple[float, str]:
    """SIGKILL of stage pod `pod`'s process `pid`, then, as soon as its replacement pod is
    created, of the operator pod's process: the replacement is in flight. Returns when the
    stage was killed (time.monotonic()) and how far the replacement had got."""
    core, ns = e["core"], e["ns"]
    old = core.read_namespaced_pod(pod, ns).metadata.uid
    os.kill(pid, signal.SIGKILL)
    at = time.monotonic()

    def replacement_created() -> Any:
        now = live_pod(core, ns, pod)
        return now if now is not None and now.metadata.uid != old else None

    new = wait_for("the replacement pod", replacement_created, timeout=120, interval=0.02)
    release = e["release"]
    operator = release.operator_pod()
    local = release.runner.local_pod(release.namespace, operator.metadata.name)
    os.kill(local.process.pid, signal.SIGKILL)
    # In flight: created, and its stage not yet training (its process starting, or not even
    # started by the kubelet).
    started = e["runner"].local_pod(ns, pod)
    loading = started is not None and started.uid == new.metadata.uid
    return at, "operator killed; the replacement " + (
        "pod's process loading" if loading else "pod not yet started"
    )


def move_to_spare(
    e: dict[str, Any], pod: str, spare: dict[str, Any], created: list[str]
) -> tuple[float, str]:
    """The node under stage pod `pod` deleted once a node of pool `spare` is up (its name
    added to `created`), and the pod's replacement seen there. Returns when the node went
    (time.monotonic()) and what moved where."""
    core, ns = e["core"], e["ns"]
    before = core.read_namespaced_pod(pod, ns)
    node = kwok_nodes.node_manifest(spare, 0)
    kwok_nodes.create_nodes(core.api_client, [node])
    created.append(node["metadata"]["name"])
    # The spare GPU is up (Ready, its not-ready taint gone) before the node goes: a
    # replacement placed while none is free waits on its own pool (issue 23: a waiting stage
    # does not yet move to a GPU that joins later).
    wait_for("the spare node to be Ready", lambda: node_ready(core, node["metadata"]["name"]))
    core.delete_node(before.spec.node_name)
    at = time.monotonic()
    moved = wait_for(
        "the stage on the spare pool",
        lambda: (
            (p := live_pod(core, ns, pod)) is not None
            and p.spec.node_name == node["metadata"]["name"]
            and p
        ),
        timeout=120,
    )
    return at, f"{before.spec.node_name} deleted; moved to {moved.spec.node_name}"


def reset_connections(ports: Iterable[int], host: str = "127.0.0.1") -> int:
    """Every established TCP connection to `host` on `ports` reset (`ss -K`); how many."""
    reset = 0
    for port in ports:
        cut = subprocess.run(
            ["ss", "-K", "dst", host, "dport", "=", f":{port}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert cut.returncode == 0, (cut.stdout, cut.stderr)
        reset += cut.stdout.count("ESTAB")
    return reset


def kill_mid_commit(
    e: dict[str, Any],
    name: str,
    progress: Progress,
    every: int,
    committer: Callable[[], int],
    timeout: float,
) -> tuple[float, int, list[str]]:
    """Hold the committing stage (the process `committer()` names) with SIGSTOP as soon as
    the workers report a checkpoint step (a multiple of `every`) not yet committed; once
    stage 0's files of that step are in the store and its manifest is not, kill it. Tried
    at the next checkpoint step if the commit won. Returns when it was killed
    (time.monotonic()), the step, and the objects of the step in the store then."""
    mc, bucket = e["minio"].client(), e["minio"].bucket
    base = f"ckpt/{e['ns']}/{name}"
    for _ in range(10):
        doc = progress.wait(
            "a checkpoint step being committed",
            lambda d: d["step"] % every == 0 and (d.get("lastCommittedStep") or 0) < d["step"],
            timeout=timeout,
            interval=0.005,  # the window is a checkpoint's save: tens of milliseconds
        )
        step = int(doc["step"])
        pid = committer()
        os.kill(pid, signal.SIGSTOP)

        def objects(step: int = step) -> list[str]:
            return [o.object_name for o in mc.list_objects(bucket, f"{base}/step-{step}/",
                                                           recursive=True)]  # fmt: skip

        if any(n.endswith("manifest.json") for n in objects()):
            os.kill(pid, signal.SIGCONT)  # the commit won the race: try the next commit,
            progress.wait(  # once training is past this one
                f"training past step {step}",
                lambda d, s=step: d["step"] > s,  # type: ignore[misc]
                timeout=timeout,
            )
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
        return at, step, written
    raise AssertionError("every checkpoint was committed before the committer could be held")
