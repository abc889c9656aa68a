"""`relaytrain run --local JOB.yaml`: run a FineTuneJob as local stage processes.

The same manifest the operator takes; the same stage documents the operator builds
(`stage_config.build_stage_configs`); the same worker (`python -m relaytrain_worker`).
What the operator does with pods this does with processes: one per stage on loopback
ports, a fresh link CA and stage certificates (minted as the operator mints them, handed
to each process in its environment, never written to disk), a local checkpoint directory
unless the job names S3, and supervision — a stage process that dies is restarted alone,
after failurePolicy.backoffSeconds, up to failurePolicy.maxStageRestarts times; the
survivors roll back to the last committed checkpoint by themselves.

Layer split: an even split of the decoder layers over `pipeline.stages` (default 2
for `auto`). The planner models GPU pools; local stages share this machine's CPU (or
GPU), so there is nothing for it to balance.

This module never imports torch: it runs in the operator package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from relaytrain_operator.linkcerts import mint_link_credentials, stage_pem
from relaytrain_operator.spec import FineTuneJob, SpecError, parse_job
from relaytrain_operator.stage_config import (
    ACCESS_KEY_ENV,
    LINK_CA_ENV,
    LINK_CERT_ENV,
    LINK_KEY_ENV,
    SECRET_KEY_ENV,
    build_stage_configs,
    local_endpoints,
)

DEFAULT_STAGES = 2
POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 15.0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `run` on the `relaytrain` subcommand parsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="run a FineTuneJob as local stage processes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("job", type=Path, help="FineTuneJob manifest (YAML)")
    parser.add_argument("--local", action="store_true", required=True, help="run locally")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("relaytrain-local"),
        help="where stage configs, logs and (by default) checkpoints go",
    )
    parser.add_argument("--stages", type=int, help="override pipeline.stages")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_command)
    return parser


def even_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Half-open layer ranges, as even as possible, earlier stages never smaller."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(stages)]


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _model_layers(job: FineTuneJob) -> int:
    uri = job.spec.model.uri
    if uri.startswith("s3://"):
        data = _s3_get(job, uri.rstrip("/") + "/config.json")
    else:
        path = Path(uri.removeprefix("file://")) / "config.json"
        if not path.is_file():
            raise SpecError([("spec.model.uri", f"{path} does not exist")])
        data = path.read_bytes()
    return int(json.loads(data)["num_hidden_layers"])


def _s3_get(job: FineTuneJob, uri: str) -> bytes:
    from urllib.parse import urlparse

    from minio import Minio

    endpoint = urlparse(job.spec.checkpoint.endpoint or "https://s3.amazonaws.com")
    client = Minio(
        endpoint.netloc,
        access_key=os.environ.get(ACCESS_KEY_ENV),
        secret_key=os.environ.get(SECRET_KEY_ENV),
        secure=endpoint.scheme == "https",
    )
    parsed = urlparse(uri)
    response = client.get_object(parsed.netloc, parsed.path.lstrip("/"))
    try:
        return bytes(response.read())
    finally:
        response.close()
        response.release_conn()


@dataclass
class StageProc:
    """One supervised stage process."""

    index: int
    config_path: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    restart_at: float | None = None
    link_env: dict[str, str] = field(default_factory=dict)
    """This stage's link certificate, key and the job's CA, by env var name."""


class LocalRun:
    """Starts, watches and restarts the stage processes of one job."""

    def __init__(self, job: FineTuneJob, workdir: Path, stages: int | None) -> None:
        self.job = job
        self.workdir = workdir.resolve()
        layers = _model_layers(job)
        wanted = job.spec.pipeline.stages
        count = stages or (DEFAULT_STAGES if wanted == "auto" else int(wanted))
        count = min(count, layers)
        ranges = even_split(layers, count)
        ports = _free_ports(2 * count)
        endpoints = local_endpoints(count, 0, 0)
        # Replace the contiguous base ports with free ones (any port may be taken).
        endpoints = [
            type(e)(
                listen=None if k == 0 else f"127.0.0.1:{ports[k]}",
                next=None if k == count - 1 else f"127.0.0.1:{ports[k + 1]}",
                metrics_port=ports[count + k],
            )
            for k, e in enumerate(endpoints)
        ]
        self.documents = build_stage_configs(job, ranges, endpoints)
        self.ranges = ranges
        self.env = self._env(count)
        (self.workdir / "stages").mkdir(parents=True, exist_ok=True)
        meta = job.metadata
        pki = mint_link_credentials(meta.namespace, meta.name, [count], now=datetime.now(UTC))
        self.stages = []
        for k, doc in enumerate(self.documents):
            path = self.workdir / "stages" / f"stage-{k}.json"
            path.write_text(json.dumps(doc, indent=2))
            cert, key, ca = stage_pem(pki, 0, k)
            link_env = {LINK_CERT_ENV: cert, LINK_KEY_ENV: key, LINK_CA_ENV: ca}
            stage = StageProc(
                k, path, self.workdir / "stages" / f"stage-{k}.log", link_env=link_env
            )
            self.stages.append(stage)
        ckpt = job.spec.checkpoint.uri
        self.job_dir = f"{ckpt.rstrip('/')}/{job.metadata.namespace}/{job.metadata.name}"
        self.output = self.documents[0]["output"]["uri"]

    def _env(self, count: int) -> dict[str, str]:
        env = dict(os.environ)
        # The stages share this machine's cores: without a cap each one starts a thread per
        # core and they spin against each other (several times slower on a small machine).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
        spec = importlib.util.find_spec("relaytrain_worker")
        if spec is not None and spec.submodule_search_locations:
            root = str(Path(next(iter(spec.submodule_search_locations))).parent)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env

    def start(self, stage: StageProc) -> None:
        with stage.log_path.open("ab") as log:
            stage.proc = subprocess.Popen(
                [sys.executable, "-m", "relaytrain_worker", "--config", str(stage.config_path)],
                env={**self.env, **stage.link_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us; we stop the stages ourselves
            )
        stage.pids.append(stage.proc.pid)
        stage.restart_at = None
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "stages": [
                {
                    "index": s.index,
                    "pid": s.proc.pid if s.proc else None,
                    "pids": s.pids,
                    "restarts": s.restarts,
                    "layers": list(self.ranges[s.index]),
                }
                for s in self.stages
            ]
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))

    def read_json(self, name: str) -> Any:
        uri = f"{self.job_dir}/{name}"
        try:
            if uri.startswith("s3://"):
                return json.loads(_s3_get(self.job, uri))
            path = Path(uri.removeprefix("file://"))
            return json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            return None
        except Exception:  # S3 not ready yet: try again next poll
            return None

    def stop(self) -> None:
        """SIGTERM every live stage, then SIGKILL what is left after a grace period."""
        live = [s.proc for s in self.stages if s.proc is not None and s.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def supervise(self, show_progress: bool) -> int:
        """Run until every stage exits 0 (0), or a stage fails too often (1)."""
        policy = self.job.spec.failure_policy
        # progress.json of an earlier run of the same job may say done; only this run's counts.
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for stage in self.stages:
            self.start(stage)
        bar = _progress_bar(show_progress)
        try:
            while True:
                time.sleep(POLL_SECONDS)
                progress = self.read_json("progress.json")
                if bar is not None and progress:
                    bar.total = progress["totalSteps"]
                    bar.n = progress["step"]
                    loss = progress.get("loss")
                    bar.set_postfix(
                        loss=f"{loss:.4f}" if loss is not None else "-",
                        tok_s=f"{progress.get('tokensPerSecond', 0):.0f}",
                        ckpt=progress.get("lastCommittedStep"),
                    )
                    bar.refresh()
                finished = 0
                for stage in self.stages:
                    assert stage.proc is not None
                    code = stage.proc.poll()
                    if code is None:
                        continue
                    done = bool(progress and progress.get("done"))
                    if code == 0 or (done and str(progress.get("updatedAt", "")) >= started):
                        # A stage that dies after the job finished (its output written) is
                        # not restarted: its peers are gone and nothing is left to do.
                        finished += 1
                        continue
                    if stage.restart_at is None:
                        if stage.restarts >= policy.max_stage_restarts:
                            print(
                                f"stage {stage.index} failed (exit {code}) after "
                                f"{stage.restarts} restarts; see {stage.log_path}",
                                file=sys.stderr,
                            )
                            self.stop()
                            return 1
                        stage.restarts += 1
                        stage.restart_at = time.monotonic() + policy.backoff_seconds
                        print(
                            f"stage {stage.index} exited with {code}; restarting it "
                            f"({stage.restarts}/{policy.max_stage_restarts})",
                            file=sys.stderr,
                        )
                    elif time.monotonic() >= stage.restart_at:
                        self.start(stage)
                if finished == len(self.stages):
                    return 0
        except KeyboardInterrupt:
            print("\nstopping every stage…", file=sys.stderr)
            self.stop()
            return 130
        finally:
            if bar is not None:
                bar.close()


def _progress_bar(show: bool) -> Any:
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=None, unit="step", dynamic_ncols=True)


def _loss_png(losses: list[dict[str, Any]], out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["step"] for e in losses], [e["loss"] for e in losses], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def run_local(job: FineTuneJob, workdir: Path, stages: int | None, progress: bool) -> int:
    """Run `job` locally; returns the exit code."""
    started = time.monotonic()
    run = LocalRun(job, workdir, stages)
    print(
        f"relaytrain: {job.metadata.name}: {len(run.stages)} stages "
        f"(layers {', '.join(f'{a}-{b - 1}' for a, b in run.ranges)}), "
        f"checkpoints in {run.job_dir}, logs in {run.workdir / 'stages'}"
    )
    code = run.supervise(progress)
    if code != 0:
        return code
    losses = run.read_json("loss-history.json") or []
    png = run.workdir / "loss.png"
    have_png = bool(losses) and _loss_png(losses, png)
    final = run.read_json("progress.json") or {}
    summary = {
        "job": job.metadata.name,
        "stages": len(run.stages),
        "steps": final.get("step"),
        "finalLoss": final.get("loss"),
        "firstLoss": losses[0]["loss"] if losses else None,
        "tokensPerSecond": final.get("tokensPerSecond"),
        "restarts": {s.index: s.restarts for s in run.stages if s.restarts},
        "output": final.get("output", run.output),
        "lossCurve": str(png) if have_png else None,
        "wallSeconds": round(time.monotonic() - started, 1),
    }
    (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("relaytrain: done")
    for key, value in summary.items():
        print(f"  {key:16} {value}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    """Entry point of `relaytrain run --local`."""
    try:
        manifest = yaml.safe_load(args.job.read_text())
        default_ckpt = str((args.workdir / "checkpoints").resolve())
        job = parse_job(manifest, default_checkpoint_uri=default_ckpt)
        return run_local(job, args.workdir, args.stages, not args.no_progress)
    except (OSError, yaml.YAMLError, SpecError, ValueError) as exc:
        print(f"relaytrain run: {exc}", file=sys.stderr)
        return 2
