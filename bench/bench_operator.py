"""Operator at scale: N FineTuneJobs x S stages on M kwok GPU nodes (default 100 x 8 on 1,000).

Given a running cluster (its kubeconfig), the script adds the kwok nodes, installs the CRD,
starts the operator as users do (`python -m relaytrain_operator`), creates every job at
once, and reports:
- the time from the first create until every stage pod exists, and until every pod runs;
- reconcile errors (from the operator's own /metrics; must be 0);
- the operator's peak memory (VmHWM of its process) and its CPU time.
Everything it created (namespace, nodes) is removed afterwards.

    .venv/bin/python bench/bench_operator.py --kubeconfig "$(make -s kubeconfig)"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "operator"), str(REPO / "testkit")]

from kubernetes import client, config  # noqa: E402
from relaytrain_testkit.harness import kwok_nodes  # noqa: E402
from relaytrain_testkit.harness.operator_process import OperatorProcess  # noqa: E402
from relaytrain_testkit.jobs import Job  # noqa: E402
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG as MODEL_CONFIG  # noqa: E402

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"
# Three GPU types sharing the fleet: 30% H100, 30% A100, 40% RTX 4090 (all do bf16).
FLEET = [
    ("bench-h100", "NVIDIA-H100-80GB-HBM3", 81559, 0.3, 1000, 10),
    ("bench-a100", "NVIDIA-A100-SXM4-40GB", 40960, 0.3, 1000, 20),
    ("bench-rtx4090", "NVIDIA-GeForce-RTX-4090", 24564, 0.4, 500, 30),
]


def pools(nodes: int) -> list[dict[str, Any]]:
    counts = [int(nodes * share) for *_, share, _, _ in FLEET]
    counts[-1] += nodes - sum(counts)
    return [
        {
            "name": name,
            "product": product,
            "nodes": count,
            "gpusPerNode": 1,
            "gpuMemoryMiB": memory,
            "cpu": "32",
            "memory": "256Gi",
            "linkBandwidthMbps": bandwidth,
            "linkLatencyMs": latency,
        }
        for (name, product, memory, _, bandwidth, latency), count in zip(FLEET, counts, strict=True)
    ]


def job(name: str, model: Path, stages: int) -> dict[str, Any]:
    return (
        Job(name)
        .model(str(model))
        .dataset("s3://data/train.jsonl", sequence_length=256)
        .training(steps=1000, micro_batches=8)
        .pipeline(stages=stages)
        .placement(pools=[p[0] for p in FLEET])
        .checkpoint("/var/tmp/relaytrain-bench")
        .build()
    )


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count_pods(core: client.CoreV1Api, ns: str) -> tuple[int, int]:
    """(pods that exist, pods Running), from one paged listing."""
    exist = running = 0
    token = None
    while True:
        page = core.list_namespaced_pod(ns, limit=500, _continue=token)
        for pod in page.items:
            exist += 1
            running += pod.status.phase == "Running"
        token = page.metadata._continue
        if not token:
            return exist, running


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--keep", action="store_true", help="leave nodes and jobs behind")
    args = parser.parse_args()
    if not args.kubeconfig:
        parser.error("--kubeconfig (or KUBECONFIG) is required")

    api = config.new_client_from_config(config_file=args.kubeconfig)
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    kubectl = os.environ.get("KUBECTL", "kubectl")
    try:
        from hack import toolpaths

        kubectl = str(toolpaths.binary("kubectl"))
    except Exception:  # any kubectl on PATH will do
        pass
    subprocess.run(
        [
            kubectl,
            "--kubeconfig",
            args.kubeconfig,
            "apply",
            "--server-side",
            "-f",
            str(REPO / "crds"),
        ],
        check=True,
        capture_output=True,
    )

    fleet = pools(args.nodes)
    nodes = kwok_nodes.node_manifests(fleet)
    start = time.monotonic()
    kwok_nodes.create_nodes(api, nodes)
    names = {n["metadata"]["name"] for n in nodes}
    while True:
        ready = sum(
            1
            for n in core.list_node(label_selector="relaytrain.io/pool").items
            if n.metadata.name in names
            and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
        )
        if ready == len(names):
            break
        if time.monotonic() - start > args.timeout:
            raise SystemExit(f"only {ready} of {len(names)} nodes became Ready")
        time.sleep(1)
    print(f"{len(names)} kwok nodes Ready in {time.monotonic() - start:.1f}s")

    ns = f"rtbench-{os.getpid()}"
    core.create_namespace({"metadata": {"name": ns}})
    workdir = Path(tempfile.mkdtemp(prefix="rtbench-"))
    (workdir / "config.json").write_text(json.dumps(MODEL_CONFIG))
    log = workdir / "operator.log"
    operator = OperatorProcess(args.kubeconfig, log, "--namespace", ns, "--resync-seconds", "10")
    try:
        operator.start(timeout=args.timeout)
        want = args.jobs * args.stages
        t0 = time.monotonic()
        for i in range(args.jobs):
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, job(f"job-{i:03d}", workdir, args.stages)
            )
        created_s = time.monotonic() - t0
        all_exist = all_running = None
        while time.monotonic() - t0 < args.timeout:
            exist, running = count_pods(core, ns)
            now = time.monotonic() - t0
            if all_exist is None and exist >= want:
                all_exist = now
            if running >= want:
                all_running = now
                break
            time.sleep(0.5)
        # A periodic check of every job over the whole fleet, to count its errors and
        # memory too.
        jobs = [f"job-{i:03d}" for i in range(args.jobs)]
        operator.wait_for_passes(ns, *jobs, more=1, timeout=args.timeout)
        exist, running = count_pods(core, ns)
        result = {
            "jobs": args.jobs,
            "stages": args.stages,
            "nodes": args.nodes,
            "jobs_created_s": round(created_s, 2),
            "all_pods_exist_s": round(all_exist, 2) if all_exist is not None else None,
            "all_pods_running_s": round(all_running, 2) if all_running is not None else None,
            "pods": exist,
            "pods_running": running,
            "jobs_running": operator.metric("relaytrain_jobs", phase="Running") or 0.0,
            "reconcile_errors": operator.metric("relaytrain_reconcile_errors_total") or 0.0,
            "reconciles": operator.metric("relaytrain_reconcile_duration_seconds_count") or 0.0,
            "operator_peak_rss_mib": round(peak_rss_mib(operator.pid), 1),
            "operator_cpu_s": round(cpu_seconds(operator.pid), 1),
        }
        print(json.dumps(result, indent=2))
        ok = result["reconcile_errors"] == 0 and all_exist is not None
        return 0 if ok else 1
    finally:
        operator.stop()
        print(f"operator log: {log}")
        if not args.keep:
            # Jobs carry the operator's finalizer; with the operator gone, remove it so
            # the namespace can go.
            for item in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
                custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    ns,
                    PLURAL,
                    item["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                )
            core.delete_namespace(ns)
            for name in sorted(names):
                try:
                    core.delete_node(name)
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise


if __name__ == "__main__":
    sys.exit(main())
