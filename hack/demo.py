"""`make demo`: a real fine-tune on the local cluster — two pipelines, one stage killed.

1. starts the local cluster (real control plane, kwok GPU pools) and a MinIO server;
2. uploads SmolLM2-135M-Instruct and a small data set to MinIO;
3. installs the chart (`helm install` of charts/relaytrain: the CRD, RBAC and the operator's
   Deployment, in namespaces that enforce the Pod Security Standard `restricted`), and
   starts the kwok process runner, which runs the operator pod (as the chart's
   ServiceAccount) and each stage pod's container as real local processes;
4. applies examples/demo/finetunejob-demo.yaml (two pipelines of two stages, sharing each
   step's micro-batches) and follows its status;
5. kills one stage's process of pipeline 1 mid-run (as a GPU dying would), and shows the
   operator replacing that pod alone while every other stage keeps its process, pipeline 0
   training on without a step back, and pipeline 1 rejoining;
6. leaves the loss curve (loss.png) and the per-step loss history (loss-history.json) in
   its working folder, prints where the adapter went, and stops everything it started.

Run from the repository root as a module (hack/demo.sh does): `python -m hack.demo --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hack import demo_data, toolpaths

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "testkit"))  # the test harness: kwok runner, MinIO, chart

from relaytrain_testkit.harness.chart_install import (  # noqa: E402
    ChartRelease,
    chart_values,
    restricted_namespace,
)
from relaytrain_testkit.harness.cluster import established_args  # noqa: E402
from relaytrain_testkit.harness.kwok_runner import KwokProcessRunner  # noqa: E402
from relaytrain_testkit.harness.minio_server import start_minio, stop_minio  # noqa: E402

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def upload_dir(mc: Any, bucket: str, prefix: str, folder: Path) -> int:
    count = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            mc.fput_object(bucket, f"{prefix}{path.relative_to(folder)}", str(path))
            count += 1
    return count


KEEP_RUNS = 4
"""Earlier runs' working folders `make demo` keeps (their logs, curves and adapter)."""


def prune_runs(root: Path, keep: int) -> list[Path]:
    """Remove all but the `keep` newest run folders under `root` (named by their start
    time, so by name is by age); returns what was removed, oldest first."""
    if keep < 0:
        raise ValueError(f"--keep-runs must be 0 or more, got {keep}")
    runs = sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []
    old = runs[: max(len(runs) - keep, 0)]
    for path in old:
        shutil.rmtree(path)
    return old


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-pipeline", type=int, default=1)
    parser.add_argument("--kill-stage", type=int, default=1, help="-1 kills none")
    parser.add_argument("--kill-at-step", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--keep", action="store_true", help="leave cluster and MinIO running")
    parser.add_argument(
        "--keep-runs",
        type=int,
        default=KEEP_RUNS,
        help=f"working folders of earlier runs to keep (default {KEEP_RUNS}; older ones go)",
    )
    args = parser.parse_args()
    # A SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so everything started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cache = toolpaths.cache_dir()
    model_dir = cache / "models" / "smollm2-135m-instruct"
    if not (model_dir / "config.json").exists():
        say(f"{model_dir} is missing: run `make deps` first")
        return 1
    for old in prune_runs(cache / "demo", args.keep_runs):
        say(f"Removed an earlier run's working folder: {old}")
    workdir = cache / "demo" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True)
    say(f"Working folder: {workdir}")
    stack: list[Any] = []
    try:
        return run(args, model_dir, workdir, stack)
    finally:
        if not args.keep:
            for undo in reversed(stack):
                undo()
            say("Stopped the operator, the stage processes, MinIO and the cluster.")


def run(args: argparse.Namespace, model_dir: Path, workdir: Path, stack: list[Any]) -> int:
    from kubernetes import client, config

    env = {**os.environ, "RELAYTRAIN_CLUSTER": "relaytrain-demo", "KWOK_WORKDIR": str(workdir)}
    t0 = time.monotonic()
    up = subprocess.run(
        ["bash", str(REPO / "hack" / "cluster.sh"), "up"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if up.returncode != 0:
        say(f"cluster start failed:\n{up.stderr}")
        return 1
    stack.append(
        lambda: subprocess.run(
            ["bash", str(REPO / "hack" / "cluster.sh"), "down"],
            env=env,
            capture_output=True,
            check=False,
        )
    )
    kubeconfig = up.stdout.strip().splitlines()[-1]
    say(f"Cluster up in {time.monotonic() - t0:.0f}s; KUBECONFIG={kubeconfig}")
    api = config.new_client_from_config(kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    (workdir / "minio").mkdir()
    # The store's data (the model, checkpoints: ~0.6 GB) goes once MinIO has stopped (the
    # stack unwinds last first); the adapter was copied into the working folder
    # (`try_adapter`), the logs and curves stay.
    stack.append(lambda: shutil.rmtree(workdir / "minio", ignore_errors=True))
    minio_proc, minio = start_minio(workdir / "minio", workdir / "minio.log")
    stack.append(lambda: stop_minio(minio_proc))
    mc = minio.client()
    mc.make_bucket("relaytrain")
    n = upload_dir(mc, "relaytrain", "models/smollm2-135m-instruct/", model_dir)
    data = demo_data.write(workdir / "reverse-words.jsonl")
    mc.fput_object("relaytrain", "datasets/reverse-words.jsonl", str(data))
    say(f"MinIO at {minio.url}: uploaded the model ({n} files) and the data set")

    job = yaml.safe_load((REPO / "examples" / "demo" / "finetunejob-demo.yaml").read_text())
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    job["spec"]["checkpoint"]["endpoint"] = minio.url
    job["spec"]["training"]["steps"] = args.steps
    restricted_namespace(core, ns)
    core.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": "s3-credentials"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": minio.access_key,
                "AWS_SECRET_ACCESS_KEY": minio.secret_key,
            },
        },
    )

    # The operator as users install it: the chart's Deployment, whose pod the runner starts
    # as the chart's ServiceAccount (a token bound to the pod; no kubeconfig).
    release = ChartRelease(
        "relaytrain",
        restricted_namespace(core, "relaytrain-system"),
        Path(kubeconfig),
        api,
        workdir,
    )
    release.start_kubelet()
    stack.append(release.stop_kubelet)
    release.install(chart_values(ns))
    pod, _ = release.ready_operator()
    kubectl = [str(toolpaths.binary("kubectl")), "--kubeconfig", kubeconfig]
    subprocess.run(
        [*kubectl, "wait", *established_args("finetunejobs.relaytrain.io")],
        check=True,
        capture_output=True,
    )
    runner = KwokProcessRunner(api, workdir / "pods", ns)
    runner.start()
    stack.append(runner.stop)
    say(
        f"Installed the chart (helm install relaytrain): the operator runs as pod "
        f"{release.namespace}/{pod.metadata.name}, ServiceAccount {pod.spec.service_account_name} "
        f"(log under {workdir / 'pods' / release.namespace}); stage pods run as local processes"
    )

    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
    pipeline = job["spec"]["pipeline"]
    say(
        f"Applied FineTuneJob {ns}/{name}: {args.steps} steps, {pipeline['replicas']} pipelines "
        f"of {pipeline['stages']} stages, int8 links"
    )
    return follow(args, custom, core, runner, ns, name, workdir, mc)


def follow(
    args: argparse.Namespace,
    custom: Any,
    core: Any,
    runner: KwokProcessRunner,
    ns: str,
    name: str,
    workdir: Path,
    mc: Any,
) -> int:
    deadline = time.monotonic() + args.timeout
    last_line, first_loss = "", None
    losses: dict[int, float] = {}
    eval_step: int | None = None
    survivors: dict[str, tuple[str, int]] = {}
    killed_at: float | None = None
    killed_step = 0
    after_kill: list[int] = []  # every step the job reported after the kill
    was_degraded = rejoined = False
    status: dict[str, Any] = {}
    phase = "Pending"
    while time.monotonic() < deadline:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        status = obj.get("status") or {}
        phase = status.get("phase", "Pending")
        prog = status.get("progress") or {}
        step, loss = prog.get("step"), prog.get("loss")
        if step is not None and loss is not None:
            losses[step] = loss
            first_loss = loss if first_loss is None else first_loss
        line = (
            f"phase={phase} pipelines={status.get('readyPipelines')} "
            f"step={step}/{prog.get('totalSteps')} loss={loss} "
            f"tokens/s={prog.get('tokensPerSecond')} checkpoint={prog.get('lastCommittedStep')}"
        )
        if line != last_line:
            say(line)
            last_line = line
        if prog.get("evalStep") is not None and prog["evalStep"] != eval_step:
            eval_step = prog["evalStep"]
            say(f"Held-out loss at step {eval_step}: {prog.get('evalLoss')}")
        degraded = next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {})
        if killed_at is not None:
            if step is not None:
                after_kill.append(step)
            if degraded.get("status") == "True" and not was_degraded:
                was_degraded = True
                say(f"Job Running but Degraded: {degraded.get('message')}")
            # Back means training again with every pipeline: a job that ends drops Degraded
            # too, replacement or not.
            if (
                was_degraded
                and degraded.get("status") == "False"
                and phase == "Running"
                and not rejoined
            ):
                rejoined = True
                say(
                    f"Pipeline {args.kill_pipeline} is back: its stage's pod was replaced "
                    f"{time.monotonic() - killed_at:.1f}s after it died (the new process "
                    f"rejoins at a step boundary); the other pipeline trained on meanwhile"
                )
        if (
            args.kill_stage >= 0
            and killed_at is None
            and step is not None
            and step >= args.kill_at_step
        ):
            killed_at = kill_stage(
                args.kill_pipeline, args.kill_stage, core, runner, ns, name, survivors
            )
            killed_step = step
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    else:
        say("Timed out waiting for the job")
        return 1
    stepped_back = after_kill != sorted(after_kill) or min(after_kill, default=killed_step) < (
        killed_step
    )
    if killed_at is not None and stepped_back:
        say(f"THE JOB STEPPED BACK after the kill: {after_kill}")
        return 1
    if was_degraded and not rejoined:
        say(
            f"The job ended before pipeline {args.kill_pipeline}'s replacement rejoined: the "
            f"other pipeline trained the remaining steps alone"
        )
    if killed_at is not None:
        say(
            f"After the kill at step {killed_step} the job went on to step "
            f"{max(after_kill, default=killed_step)} without a step back (no rollback)"
        )
    if killed_at is not None:
        # What the replacement's own log says: it rejoined from the live pipeline's state.
        victim = f"{name}-p{args.kill_pipeline}-s{args.kill_stage}"
        for log in sorted((workdir / "pods" / ns / victim).rglob("container.log")):
            for row in log.read_text(errors="replace").splitlines():
                if "rejoined at step" in row:
                    say(f"{victim}'s replacement: {row.split(': ', 1)[-1]}")
    records = loss_history(mc, ns, name)
    if records:
        path = workdir / "loss-history.json"
        path.write_text(json.dumps(records, indent=1) + "\n")
        say(f"Loss history (one record per step, held-out losses included): {path}")
    held_out = {r["step"]: r["evalLoss"] for r in records if r.get("evalLoss") is not None}
    return summarise(status, phase, runner, survivors, losses, first_loss, held_out, workdir, mc)


def loss_history(mc: Any, ns: str, name: str) -> list[dict[str, Any]]:
    """The whole run's loss history, one record per step (`step`, `loss`, `evalLoss` where
    the held-out loss was evaluated, ...): the workers' loss-history.json in MinIO (the job's
    status holds only the newest step)."""
    try:
        resp = mc.get_object("relaytrain", f"checkpoints/{ns}/{name}/loss-history.json")
        records: list[dict[str, Any]] = json.loads(resp.read())
        resp.close()
        resp.release_conn()
    except Exception:  # no history: the job did not get that far
        return []
    return records


def kill_stage(
    pipeline: int,
    index: int,
    core: Any,
    runner: KwokProcessRunner,
    ns: str,
    name: str,
    survivors: dict[str, tuple[str, int]],
) -> float | None:
    victim = f"{name}-p{pipeline}-s{index}"
    local = runner.local_pod(ns, victim)
    if local is None:
        return None
    for pod in core.list_namespaced_pod(ns, label_selector="relaytrain.io/job").items:
        lp = runner.local_pod(ns, pod.metadata.name)
        if pod.metadata.name != victim and lp:
            survivors[pod.metadata.name] = (pod.metadata.uid, lp.process.pid)
    os.kill(local.process.pid, signal.SIGKILL)
    say(f"Killed stage p{pipeline}/s{index}'s process (pid {local.process.pid}) with SIGKILL")
    return time.monotonic()


def summarise(
    status: dict[str, Any],
    phase: str,
    runner: KwokProcessRunner,
    survivors: dict[str, tuple[str, int]],
    losses: dict[int, float],
    first_loss: float | None,
    held_out: dict[int, float],
    workdir: Path,
    mc: Any,
) -> int:
    say(
        f"Job {phase}: "
        + "; ".join(
            f"{c['type']}={c['status']} ({c.get('reason')})" for c in status.get("conditions", [])
        )
    )
    for st in status.get("stages", []):
        say(
            f"  stage p{st.get('pipeline', 0)}/s{st.get('index')} on {st.get('pool')}: "
            f"restarts={st.get('restarts')}"
        )
    ok = phase == "Succeeded"
    for pname, (uid, pid) in survivors.items():
        starts = [(lp.uid, lp.process.pid) for lp in runner.history if lp.name == pname]
        same = starts == [(uid, pid)]
        ok = ok and same
        say(
            f"  {pname}: {'kept its pod and process' if same else 'WAS RESTARTED'} "
            f"(uid {uid[:8]}, pid {pid})"
        )
    if losses:
        plot = plot_losses(losses, workdir / "loss.png")
        say(f"Loss: step 1 {first_loss}, step {max(losses)} {losses[max(losses)]}; curve: {plot}")
    if held_out:
        first, last = min(held_out), max(held_out)
        falling = held_out[last] < held_out[first]
        ok = ok and falling
        points = ", ".join(f"step {k} {v:.4f}" for k, v in sorted(held_out.items()))
        say(f"Held-out loss: {points} ({'falling' if falling else 'NOT FALLING'})")
    else:
        ok = False
        say("No held-out loss was recorded")
    if phase != "Succeeded":
        say(f"See {workdir} for the operator's and each stage's log")
        return 1
    uri = (status.get("output") or {}).get("uri", "")
    say(f"Adapter: {uri}")
    try_adapter(mc, uri, workdir)
    return 0 if ok else 1


def plot_losses(losses: dict[int, float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [losses[s] for s in steps], marker="o")
    ax.set(
        xlabel="step",
        ylabel="training loss",
        title="smollm-demo (LoRA, 2 pipelines x 2 stages, int8 links)",
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def try_adapter(mc: Any, uri: str, workdir: Path) -> None:
    """Loads the adapter with PeftModel on the unsplit base model and answers a held-out prompt."""
    import logging
    import warnings

    # Quiet the libraries' own chatter (optional CPU kernels, deprecations, progress bars).
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    local = workdir / "adapter"
    for obj in mc.list_objects(bucket, prefix, recursive=True):
        mc.fget_object(bucket, obj.object_name, str(local / obj.object_name[len(prefix) :]))
    base_dir = toolpaths.cache_dir() / "models" / "smollm2-135m-instruct"
    tok = AutoTokenizer.from_pretrained(base_dir)
    held_out = demo_data.examples(1, seed=12345)[0]
    ids = tok(held_out["prompt"], return_tensors="pt").input_ids

    def answer(model: Any) -> str:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False)
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0]

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = answer(base)
    tuned = PeftModel.from_pretrained(base, local)
    say(f"Held-out prompt: {held_out['prompt']!r}, expected {held_out['completion']!r}")
    say(f"  base model:         {before!r}")
    say(f"  with the adapter:   {answer(tuned)!r}  (PeftModel.from_pretrained on the full model)")


if __name__ == "__main__":
    sys.exit(main())
