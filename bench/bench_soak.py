"""A soak (issue 25 item 7): one long job of real stage processes, checkpointing often,
its stages SIGKILLed on a seeded schedule, watched for what must stay flat.

Run: .venv/bin/python bench/bench_soak.py [--quick] [--json OUT] [--kubeconfig PATH]

One tiny-Llama job (3 stages of real worker processes, the e2e tests' job) trains thousands
of steps (8,000; 1,000 with --quick) under the chart-installed operator on the real control
plane (a local cluster of its own unless --kubeconfig names one), with a MinIO of its own,
a commit every --every steps and --keep of them kept. Every ~--kill-every steps (seeded
offsets) a seeded stage is SIGKILLed; the bench waits until the job trains past the step
it broke at.

It samples, at the start (a window of --window seconds after the first commit) and at the
end (a window of the same length just before the last step):
- the objects under the job's prefix in the store: all, those in `step-N/` checkpoint
  folders and the folders (the most folders ever sampled must stay within keep + 1, one
  being written), and the loss-history chunks (a chunk per commit, merged as a binary
  counter carries: about log2(commits) of them, `state/history.py`);
- the operator process's resident memory (VmRSS of its pod's process);
- the operator's API requests per reconcile pass: its ServiceAccount's requests in the API
  server's audit log (hack/audit-policy.yaml logs every ServiceAccount's), over the passes
  its /metrics counted in the window; beside it the API server's own
  apiserver_request_total for the resources the operator touches, which counts every
  client's (the test kubelet, kwok, the scheduler too): read that one start against end;
- the job's Events (objects and their counts), and the most Events the operator posted in
  any 10 s (its ServiceAccount's creates and patches of events, from the audit log).
It prints a markdown table (start, end, end/start) and the kills; --json OUT writes it all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SEED = 20260525
RESOURCES = ("finetunejobs", "pods", "services", "secrets", "events", "leases", "nodes")
"""What the operator reads and writes (apiserver_request_total's `resource` label)."""
BURST_SECONDS = 10.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short soak (~1.5 minutes)")
    parser.add_argument("--steps", type=int, help="training steps (default 8000; quick 1000)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint.everySteps")
    parser.add_argument("--keep", type=int, default=2, help="checkpoint.keep")
    parser.add_argument(
        "--kill-every", type=int, help="steps between stage kills (default 300; quick 200)"
    )
    parser.add_argument("--window", type=float, help="seconds of each sample window")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--kubeconfig", help="a running local cluster (default: start one)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the figures here")
    args = parser.parse_args()
    args.steps = args.steps or (1000 if args.quick else 8000)
    args.kill_every = args.kill_every or (200 if args.quick else 300)
    args.window = args.window or (10.0 if args.quick else 30.0)
    return args


# --- the cluster ------------------------------------------------------------------------
class OwnCluster:
    """hack/cluster.sh up under a unique name and a state folder of its own; down on exit."""

    def __init__(self, workdir: Path) -> None:
        self.name = f"rt-soak-{uuid.uuid4().hex[:6]}"
        self.env = {
            **os.environ,
            "RELAYTRAIN_CLUSTER": self.name,
            "KWOK_WORKDIR": str(workdir / "kwok"),
            "RELAYTRAIN_POOLS": os.environ.get(
                "RELAYTRAIN_POOLS", str(REPO / "hack" / "pools.yaml")
            ),
        }

    def up(self) -> Path:
        proc = subprocess.run(
            ["bash", str(REPO / "hack" / "cluster.sh"), "up"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"hack/cluster.sh up failed:\n{proc.stdout}\n{proc.stderr}")
        return Path(proc.stdout.strip().splitlines()[-1])

    def down(self) -> None:
        subprocess.run(
            ["bash", str(REPO / "hack" / "cluster.sh"), "down"],
            env=self.env,
            capture_output=True,
            timeout=120,
            check=False,
        )


# --- what is sampled --------------------------------------------------------------------
def prom_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def operator_metrics(port: int) -> dict[str, float]:
    """The operator's counters summed over their labels (passes, errors, restarts)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, _, value in prom_samples(text):
        if name in (
            "relaytrain_reconcile_passes_total",
            "relaytrain_reconcile_errors_total",
            "relaytrain_stage_restarts_total",
        ):
            out[name] = out.get(name, 0.0) + value
    return out


def apiserver_requests(api: Any) -> float:
    """apiserver_request_total summed over the resources in RESOURCES (every client's)."""
    method, url, headers, _, _ = api.param_serialize(
        "GET", "/metrics", auth_settings=["BearerToken"]
    )
    resp = api.call_api(method, url, header_params=headers, _request_timeout=30)
    resp.read()
    text = resp.data.decode()
    return sum(
        value
        for name, labels, value in prom_samples(text)
        if name == "apiserver_request_total" and labels.get("resource") in RESOURCES
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def store_objects(mc: Any, bucket: str, prefix: str) -> dict[str, Any]:
    """The objects under the job's prefix: all, those of checkpoints (`step-N/...`), their
    `step-N/` folders and committed ones (with a manifest), and the loss-history chunks."""
    rel = [o.object_name[len(prefix) :] for o in mc.list_objects(bucket, prefix, recursive=True)]
    in_steps = [n for n in rel if n.startswith("step-")]
    steps = {n.split("/")[0] for n in in_steps}
    committed = {n.split("/")[0] for n in in_steps if n.endswith("/manifest.json")}
    return {
        "objects": len(rel),
        "checkpoint_objects": len(in_steps),
        "step_folders": len(steps),
        "committed": len(committed),
        "history_chunks": sum(1 for n in rel if n.startswith("loss-history/")),
    }


def job_events(core: Any, ns: str, name: str) -> tuple[int, int]:
    """(Event objects on the FineTuneJob, the sum of their counts)."""
    items = core.list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name},involvedObject.kind=FineTuneJob"
    ).items
    return len(items), sum(e.count or 1 for e in items)


class Sampler:
    """Every `interval` s: wall time, the workers' progress, the operator's counters and
    RSS, and the store's objects; keeps them all, and the most step folders ever seen."""

    def __init__(self, e: dict[str, Any], name: str, interval: float = 2.0) -> None:
        from relaytrain_testkit.harness.operator_env import stored_json

        self.e, self.name, self.interval = e, name, interval
        self.stored_json = stored_json
        self.mc = e["minio"].client()
        self.bucket = e["minio"].bucket
        self.prefix = f"ckpt/{e['ns']}/{name}/"
        self.port = int(e["values"]["metrics"]["port"])
        self.rows: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.most_step_folders = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def progress(self) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = self.stored_json(
                self.mc, self.bucket, self.prefix + "progress.json"
            )
        except Exception:
            return {}
        return doc

    def operator_pid(self) -> int:
        release = self.e["release"]
        pod = release.operator_pod()
        local = release.runner.local_pod(release.namespace, pod.metadata.name)
        return int(local.process.pid)

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t": time.time()}
        row["step"] = int(self.progress().get("step", 0))
        row.update(operator_metrics(self.port))
        pid = self.operator_pid()
        row["operator_pid"] = pid
        row["rss_mib"] = rss_mib(pid)
        row.update(store_objects(self.mc, self.bucket, self.prefix))
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                row = self.sample()
            except Exception as exc:  # a listing cut by a kill, a scrape mid-restart
                self.errors.append(f"{time.time():.0f}: {exc!r}"[:300])
                continue
            with self.lock:
                self.rows.append(row)
                self.most_step_folders = max(self.most_step_folders, row["step_folders"])

    def latest(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.rows[-1]) if self.rows else {}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# --- the audit log ----------------------------------------------------------------------
def audited_requests(log: Path, user_prefix: str) -> list[tuple[float, str, str, str]]:
    """(received at, verb, resource, namespace) of every request of the users whose name
    starts with `user_prefix`, once each (a watch is logged when it starts and ends)."""
    seen: dict[str, tuple[float, str, str, str]] = {}
    with log.open(errors="replace") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line, half written
            if not ev.get("user", {}).get("username", "").startswith(user_prefix):
                continue
            ref = ev.get("objectRef") or {}
            when = datetime.fromisoformat(ev["requestReceivedTimestamp"]).timestamp()
            seen.setdefault(
                ev["auditID"],
                (when, ev.get("verb", ""), ref.get("resource", ""), ref.get("namespace", "")),
            )
    return sorted(seen.values())


def most_in(times: list[float], seconds: float) -> int:
    """The most of `times` (sorted) in any window of `seconds`."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > seconds:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


# --- the soak ---------------------------------------------------------------------------
def stage_pid(e: dict[str, Any], name: str, k: int) -> int | None:
    local = e["runner"].local_pod(e["ns"], f"{name}-stage-{k}")
    return None if local is None else int(local.process.pid)


def wait(what: str, until: Any, timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = until()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"no {what} after {timeout:.0f} s")


def job_status(e: dict[str, Any], name: str) -> dict[str, Any]:
    from relaytrain_testkit.harness.operator_env import GROUP, PLURAL, VERSION

    doc = e["custom"].get_namespaced_custom_object(GROUP, VERSION, e["ns"], PLURAL, name)
    return doc.get("status") or {}


class Window:
    """Figures at both ends of a window of time."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = self.t1 = 0.0
        self.api0 = self.api1 = 0.0
        self.ev0: tuple[int, int] = (0, 0)
        self.ev1: tuple[int, int] = (0, 0)

    def open(self, api: Any, core: Any, e: dict[str, Any], name: str) -> None:
        self.t0, self.api0 = time.time(), apiserver_requests(api)
        self.ev0 = job_events(core, e["ns"], name)

    def close(self, api: Any, core: Any, e: dict[str, Any], name: str) -> None:
        self.t1, self.api1 = time.time(), apiserver_requests(api)
        self.ev1 = job_events(core, e["ns"], name)


def run_soak(args: argparse.Namespace, e: dict[str, Any], kubeconfig: Path) -> dict[str, Any]:
    from kubernetes import client
    from relaytrain_testkit.harness import kwok_nodes
    from relaytrain_testkit.harness.operator_env import GROUP, PLURAL, VERSION, tiny_job

    core, custom, ns = e["core"], e["custom"], e["ns"]
    api = core.api_client
    rng = random.Random(args.seed)
    tag = uuid.uuid4().hex[:5]
    pool = {
        "name": f"soak{tag}", "product": "NVIDIA-GeForce-RTX-4090", "gpuMemoryMiB": 24564,
        "cpu": "16", "memory": "64Gi", "linkBandwidthMbps": 500, "linkLatencyMs": 30,
    }  # fmt: skip
    nodes = [kwok_nodes.node_manifest(pool, i) for i in range(3)]
    kwok_nodes.create_nodes(api, nodes)
    name = "soak"
    job = (
        tiny_job(name, e["minio"])
        .training(steps=args.steps)
        .checkpoint(every_steps=args.every, keep=args.keep)
        .failure_policy(max_stage_restarts=1000, backoff_seconds=0)
        .placement(pools=[pool["name"]])
        .build()
    )
    sampler: Sampler | None = None
    try:
        started = time.monotonic()
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
        sampler = Sampler(e, name)
        first = wait(
            "first commit",
            lambda: (sampler.progress().get("lastCommittedStep") or 0) > 0 and sampler.progress(),
            timeout=600,
            interval=0.5,
        )
        print(f"first commit (step {first.get('lastCommittedStep')}) after "
              f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
        start = Window("start")
        start.open(api, core, e, name)
        s0 = sampler.sample()
        time.sleep(args.window)
        start.close(api, core, e, name)
        s1 = sampler.sample()
        rate = max((s1["step"] - s0["step"]) / (s1["t"] - s0["t"]), 0.1)
        # The end window is the last `window` seconds before the last step (with some room),
        # and the last kill well before it (its recovery is out of the window).
        tail = int(rate * (args.window + 20)) + args.every
        tail = min(tail, (args.steps - s1["step"]) // 2)  # a short run: the second half
        last_kill = args.steps - tail - args.kill_every // 2
        targets = []
        k = args.kill_every
        while k <= last_kill:
            targets.append(k + rng.randrange(0, max(args.kill_every // 3, 1)))
            k += args.kill_every
        targets = [t for t in targets if t <= last_kill and t > s1["step"]]
        print(f"{rate:.1f} steps/s; kills due at steps {targets}; end window from step "
              f"{args.steps - tail}", flush=True)  # fmt: skip
        kills: list[dict[str, Any]] = []
        for target in targets:
            wait(f"step {target}", lambda t=target: sampler.progress().get("step", 0) >= t,
                 timeout=600)  # fmt: skip
            stage = rng.randrange(3)
            pid = stage_pid(e, name, stage)
            at = int(sampler.progress().get("step", 0))
            t_kill = time.monotonic()
            assert pid is not None, f"stage {stage} runs no process"
            os.kill(pid, signal.SIGKILL)
            # Recovered: a new process for the stage, and training 3 steps past the step of
            # the kill (the pipeline cannot get further than one step without the stage).
            wait(
                "the stage's recovery",
                lambda s=stage, p=pid, a=at: (
                    stage_pid(e, name, s) not in (None, p)
                    and sampler.progress().get("step", 0) >= a + 3
                ),
                timeout=600,
            )
            kills.append({"target": target, "stage": stage, "step": at,
                          "recover_s": round(time.monotonic() - t_kill, 1)})  # fmt: skip
            print(f"killed stage {stage} at step {at}: trained past it again in "
                  f"{kills[-1]['recover_s']} s", flush=True)  # fmt: skip
        wait("the end window", lambda: sampler.progress().get("step", 0) >= args.steps - tail,
             timeout=900)  # fmt: skip
        end = Window("end")
        end.open(api, core, e, name)
        e0 = sampler.sample()
        # The end window closes early if the job is about to finish: it measures a job that
        # trains (a finished job is not reconciled as often).
        wait(
            "the end window's end",
            lambda: (
                sampler.progress().get("step", 0) >= args.steps - args.every
                or time.time() - end.t0 >= args.window
            ),
            timeout=args.window + 60,
            interval=0.2,
        )
        end.close(api, core, e, name)
        e1 = sampler.sample()
        done = bool(sampler.progress().get("done"))
        final = wait(
            "the job's end",
            lambda: (st := job_status(e, name)).get("phase") in ("Succeeded", "Failed") and st,
            timeout=900,
            interval=1,
        )
        wall = time.monotonic() - started
        time.sleep(3)
        last = sampler.sample()
    finally:
        if sampler is not None:
            sampler.stop()
        for node in nodes:
            with contextlib.suppress(client.ApiException):
                core.delete_node(node["metadata"]["name"])

    # The operator's requests, from the audit log (its ServiceAccount's, in the system
    # namespace of the release).
    audit = kubeconfig.parent / "logs" / "audit.log"
    user = f"system:serviceaccount:{e['release'].namespace}:"
    reqs = audited_requests(audit, user) if audit.exists() else []

    def operator_calls(w: Window) -> int:
        return sum(1 for t, *_ in reqs if w.t0 <= t < w.t1)

    event_posts = sorted(
        t for t, verb, res, rns in reqs if res == "events" and rns == ns
        and verb in ("create", "patch", "update")
    )  # fmt: skip
    during = [t for t in event_posts if start.t0 <= t]

    def passes(a: dict[str, Any], b: dict[str, Any]) -> float:
        return b.get("relaytrain_reconcile_passes_total", 0) - a.get(
            "relaytrain_reconcile_passes_total", 0
        )

    def figures(w: Window, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        p = passes(a, b)
        calls = operator_calls(w) if reqs else None
        return {
            "step": b["step"],
            "store_objects": b["objects"],
            "store_step_folders": b["step_folders"],
            "store_checkpoint_objects": b["checkpoint_objects"],
            "store_history_chunks": b["history_chunks"],
            "operator_rss_mib": round(b["rss_mib"], 1),
            "passes_in_window": p,
            "passes_per_s": round(p / (w.t1 - w.t0), 2),
            "operator_requests_in_window": calls,
            "operator_requests_per_pass": round(calls / p, 2) if calls is not None and p else None,
            "all_clients_requests_per_pass": round((w.api1 - w.api0) / p, 2) if p else None,
            "job_events": w.ev1[0],
            "job_event_counts": w.ev1[1],
            "events_posted_in_window": sum(1 for t in event_posts if w.t0 <= t < w.t1),
            "seconds": round(w.t1 - w.t0, 1),
        }

    result = {
        "config": {
            "steps": args.steps,
            "every": args.every,
            "keep": args.keep,
            "kill_every": args.kill_every,
            "window_s": args.window,
            "seed": args.seed,
            "stages": 3,
        },
        "phase": final.get("phase"),
        "done_when_end_window_closed": done,
        "wall_s": round(wall, 1),
        "kills": kills,
        "status_restarts": final.get("restarts"),
        "start": figures(start, s0, s1),
        "end": figures(end, e0, e1),
        "after": {
            "store_objects": last["objects"],
            "store_step_folders": last["step_folders"],
            "store_checkpoint_objects": last["checkpoint_objects"],
            "store_history_chunks": last["history_chunks"],
            "operator_rss_mib": round(last["rss_mib"], 1),
            "reconcile_passes": last.get("relaytrain_reconcile_passes_total"),
            "reconcile_errors": last.get("relaytrain_reconcile_errors_total", 0.0),
            "stage_restarts_metric": last.get("relaytrain_stage_restarts_total"),
        },
        "most_step_folders_seen": sampler.most_step_folders,
        "max_rss_mib_seen": round(max(r["rss_mib"] for r in sampler.rows), 1),
        "operator_pids_seen": sorted({r["operator_pid"] for r in sampler.rows}),
        "samples": len(sampler.rows),
        "sampler_errors": sampler.errors[:10],
        "events_posted_by_operator": len(event_posts),
        "most_events_posted_in_10s": most_in(during, BURST_SECONDS),
        "audit_log": str(audit) if reqs else f"not found or empty: {audit}",
        "series": [
            {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
            for r in sampler.rows
        ],
    }
    return result


def print_table(r: dict[str, Any]) -> None:
    s, e = r["start"], r["end"]
    c = r["config"]

    def ratio(a: Any, b: Any) -> str:
        return f"{b / a:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and a \
            else "-"  # fmt: skip

    rows = [
        ("step (at the window's end)", s["step"], e["step"]),
        ("store objects under the job's prefix", s["store_objects"], e["store_objects"]),
        ("store step-N/ folders", s["store_step_folders"], e["store_step_folders"]),
        (
            "store objects in step-N/ folders",
            s["store_checkpoint_objects"],
            e["store_checkpoint_objects"],
        ),
        ("store loss-history/ chunks", s["store_history_chunks"], e["store_history_chunks"]),
        ("operator RSS (MiB)", s["operator_rss_mib"], e["operator_rss_mib"]),
        ("reconcile passes in the window", s["passes_in_window"], e["passes_in_window"]),
        (
            "operator API requests in the window",
            s["operator_requests_in_window"],
            e["operator_requests_in_window"],
        ),
        (
            "operator API requests per pass (audit log)",
            s["operator_requests_per_pass"],
            e["operator_requests_per_pass"],
        ),
        (
            "all clients' requests per pass (apiserver_request_total)*",
            s["all_clients_requests_per_pass"],
            e["all_clients_requests_per_pass"],
        ),
        ("Events on the job (objects)", s["job_events"], e["job_events"]),
        ("Events on the job (sum of counts)", s["job_event_counts"], e["job_event_counts"]),
        (
            "Events posted by the operator in the window",
            s["events_posted_in_window"],
            e["events_posted_in_window"],
        ),
    ]
    print(f"\nSoak: {c['steps']} steps, a commit every {c['every']} (keep {c['keep']}), "
          f"{len(r['kills'])} stage kills, windows of {s['seconds']} s / {e['seconds']} s; "
          f"job {r['phase']} in {r['wall_s']} s\n")  # fmt: skip
    if r["done_when_end_window_closed"]:
        print("NOTE: the job had finished when the end window closed: its end figures are a "
              "finishing job's, not a training one's.\n")  # fmt: skip
    print("| figure | start | end | end/start |")
    print("|---|---|---|---|")
    for label, a, b in rows:
        print(f"| {label} | {a} | {b} | {ratio(a, b)} |")
    a = r["after"]
    print(f"\nafter the job: {a['store_objects']} objects ({a['store_checkpoint_objects']} in "
          f"{a['store_step_folders']} step-N/ folders, {a['store_history_chunks']} loss-history "
          f"chunks); the most step-N/ folders ever sampled: {r['most_step_folders_seen']} "
          f"(keep {c['keep']}, +1 while one is written); operator RSS {a['operator_rss_mib']} "
          f"MiB (most sampled {r['max_rss_mib_seen']}); {a['reconcile_passes']:.0f} passes, "
          f"{a['reconcile_errors']:.0f} reconcile errors; operator process(es) "
          f"{r['operator_pids_seen']}")  # fmt: skip
    print(f"Events the operator posted in all: {r['events_posted_by_operator']}; the most in "
          f"any {BURST_SECONDS:.0f} s: {r['most_events_posted_in_10s']}")  # fmt: skip
    print("kills: " + ", ".join(
        f"stage {k['stage']} at step {k['step']} (back in {k['recover_s']} s)" for k in r["kills"]
    ) + f"; status.restarts {r['status_restarts']}, relaytrain_stage_restarts_total "
        f"{a['stage_restarts_metric']}")  # fmt: skip
    print(
        "* apiserver_request_total counts every client's requests in "
        f"{', '.join(RESOURCES)} (the test kubelet, kwok, the scheduler, this bench too): "
        "read it start against end, flat or not; the audit-log row is the operator's alone."
    )


def main() -> int:
    args = parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "operator"), str(REPO / "testkit")]
    from relaytrain_testkit.harness.cluster import KubeCluster
    from relaytrain_testkit.harness.minio_server import start_minio, stop_minio
    from relaytrain_testkit.harness.operator_env import operator_env

    work = Path(tempfile.mkdtemp(prefix="rtsoak-"))
    own = None if args.kubeconfig else OwnCluster(work)
    t0 = time.monotonic()
    try:
        kubeconfig = Path(args.kubeconfig) if args.kubeconfig else own.up()  # type: ignore[union-attr]
        print(f"cluster up in {time.monotonic() - t0:.0f} s ({kubeconfig})", flush=True)
        cluster = KubeCluster(name="soak", kubeconfig=kubeconfig, pools=[], workdir=work)
        (work / "minio").mkdir()
        proc, minio = start_minio(work / "minio", work / "minio.log")
        try:
            with operator_env(cluster, minio, work) as e:
                print(f"operator ready after {time.monotonic() - t0:.0f} s", flush=True)
                result = run_soak(args, e, kubeconfig)
        finally:
            stop_minio(proc)
    finally:
        if own is not None:
            own.down()
    result["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print_table(result)
    print(f"bench wall time {result['bench_wall_s']} s; work folder {work}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["phase"] == "Succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
