"""`relaytrain run --local JOB.yaml`: run a FineTuneJob as local stage processes.

The same manifest the operator takes; the same stage documents the operator builds
(`stage_config.build_stage_configs`); the same worker (`python -m relaytrain_worker`).
What the operator does with pods this does with processes: one per stage on loopback
ports, a fresh link CA and stage certificates (minted as the operator mints them, handed
to each process in its environment, never written to disk), a local checkpoint directory
unless the job names S3, and supervision — a stage process that dies is restarted alone,
after failurePolicy.backoffSeconds, up to failurePolicy.maxStageRestarts times (the
operator's own rule: `recovery.after_failure` and `recovery.backoff_left`); the survivors
roll back to the last committed checkpoint by themselves.

State: one directory per job, `./relaytrain-local/<namespace>/<name>` unless `--workdir`
says otherwise, holding the stage documents and logs, `state.json` and `run.lock`. The
lock (`fcntl.flock`, held for the supervisor's life) refuses a second run of the job in
the same directory while the first is alive, naming its PID.

Stopping: each stage runs in its own process group; SIGTERM or SIGINT to the supervisor
stops every group it started (SIGTERM, then SIGKILL after a grace period) and restarts
none, including a stage that was waiting out its back-off. A supervisor that cannot stop
them (SIGKILL, a crash) takes them along on Linux: each stage is started with
PR_SET_PDEATHSIG, so the kernel sends it SIGKILL when the supervisor dies
(`die_with_supervisor`).

Layer split: an even split of the decoder layers over `pipeline.stages` (default 2
for `auto`). The planner models GPU pools; local stages share this machine's CPU (or
GPU), so there is nothing for it to balance. Placement (`placement.py`: which nodes are
eligible, what is free on them, where a replacement goes) has nothing to decide either:
there is one machine, `spec.placement` speaks of Kubernetes nodes, and a restarted stage
keeps its document, layers included, as a replacement pod keeps `status.plan`'s.

Several pipelines (`spec.pipeline.replicas`, or `--replicas N`): each pipeline gets its own
stage count — `--stages 2,3` (one count per pipeline; one count alone applies to all, as
`pipeline.stages` does) — and its own even split of the layers, so pipelines of different
counts hold different splits. A step's micro-batches are shared by the planner's own rule
(`planner.split_micro_batches`) with every layer costing the same here, so a pipeline's
beat is its largest stage's layer count; `--shares 2,1` sets them instead. `auto` replicas
run as many pipelines as `--stages` lists (one without it): there are no GPUs to plan over.
Every stage of pipeline p is `p<p>-stage-<k>` (files, state.json, messages), holds the
certificate of `relaytrain://<ns>/<job>/p<p>/s<k>` from the run's one CA, and listens on a
free port for the stages of lower pipelines. A stage that fails is restarted alone, as with
one pipeline, and nothing else is: its pipeline's other stages close their links and wait
for it, the other pipelines train on without a rollback (taking over its micro-batches), and
the restarted pipeline rejoins them at a step boundary from their state (docs/worker.md,
"Several pipelines as processes").

This module never imports torch: it runs in the operator package.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from relaytrain_contract import (
    LINK_CA_ENV,
    LINK_CERT_ENV,
    LINK_KEY_ENV,
    PROGRESS_FILE,
    ConfigError,
    Progress,
)

from relaytrain_operator import cli
from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_operator.domain.planner import ModelShape, split_micro_batches
from relaytrain_operator.domain.recovery import after_failure, backoff_left
from relaytrain_operator.domain.stage_config import StageEndpoints, build_pipeline_configs
from relaytrain_operator.spec import FineTuneJob, SpecError, parse_job

DEFAULT_STAGES = 2
DEFAULT_ROOT = Path("relaytrain-local")
"""Where a job's state directory goes without --workdir: DEFAULT_ROOT/<namespace>/<name>."""
LOCK_FILE = "run.lock"
POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 15.0


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the kernel sends the caller when its parent dies (Linux)."""


def die_with_supervisor(supervisor: int) -> Callable[[], None] | None:
    """What a stage process runs between fork and exec so that it dies with `supervisor`
    (the PID of the process starting it): on Linux it asks the kernel for SIGKILL when its
    parent dies (PR_SET_PDEATHSIG, kept across exec), then checks that its parent is still
    `supervisor`; a supervisor that died before that (a restart racing the supervisor's
    death) gets the same SIGKILL from the stage itself. None elsewhere (nothing to ask for).

    The kernel's "parent" is the thread that forked: stages are started from the
    supervisor's main thread, which lives as long as the supervisor does.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cannot fail for a valid signal
        if os.getppid() != supervisor:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class AlreadyRunning(Exception):  # noqa: N818 - reads as what happened
    """Another live `relaytrain run --local` holds the job's state directory."""


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
        default=None,
        help="where stage configs, logs and (by default) checkpoints go "
        f"(default: ./{DEFAULT_ROOT}/<namespace>/<name>, one directory per job)",
    )
    parser.add_argument(
        "--stages",
        type=_counts,
        metavar="N[,N...]",
        help="override pipeline.stages: one count for every pipeline, or one per pipeline "
        "(2,3: pipeline 0 has two stages, pipeline 1 three)",
    )
    parser.add_argument(
        "--replicas",
        type=cli.positive_int,
        metavar="N",
        help="override pipeline.replicas: pipelines that train together on one global batch",
    )
    parser.add_argument(
        "--shares",
        type=_counts,
        metavar="N,N[,N...]",
        help="micro-batches of each step per pipeline (default: the planner's split, every "
        "layer costing the same)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_command)
    return parser


def _counts(raw: str) -> list[int]:
    """`2` or `2,3`: positive integers, comma-separated."""
    try:
        return [cli.positive_int(part) for part in raw.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be positive integers separated by commas, got {raw!r}"
        ) from None


@dataclass(frozen=True)
class Layout:
    """What a local run trains where: every pipeline's layer split and micro-batch share."""

    splits: list[list[tuple[int, int]]]
    """Per pipeline, [start, end) of each stage's layers."""
    shares: list[int]
    """Per pipeline, its micro-batches of each step."""


def local_layout(
    job: FineTuneJob,
    layers: int,
    stages: list[int] | None = None,
    replicas: int | None = None,
    shares: list[int] | None = None,
) -> Layout:
    """The pipelines of a local run of `job` on a model of `layers` decoder layers, from the
    job and the command line's overrides (`--stages`, `--replicas`, `--shares`).

    Raises SpecError naming the field (or flag) when they do not fit together.
    """
    wanted = job.spec.pipeline.replicas
    if replicas is not None:
        count = replicas
    elif wanted == "auto":
        count = len(stages) if stages else 1
    else:
        count = wanted
    if stages is None:
        per = job.spec.pipeline.stages
        stages = [DEFAULT_STAGES if per == "auto" else int(per)]
    if len(stages) == 1:
        stages = stages * count
    if len(stages) != count:
        raise _refused(
            "--stages",
            f"lists {len(stages)} stage counts for {count} pipeline(s) "
            "(spec.pipeline.replicas or --replicas says how many)",
        )
    micro = job.spec.training.micro_batches
    if count > micro:
        raise _refused(
            "spec.pipeline.replicas",
            f"{count} pipelines need at least {count} micro-batches per step; "
            f"spec.training.microBatches is {micro}",
        )
    splits = [even_split(layers, min(n, layers)) for n in stages]
    if shares is None:
        beats = [(len(split), float(max(e - s for s, e in split))) for split in splits]
        shares = split_micro_batches(beats, micro)
        if min(shares) < 1:
            raise _refused(
                "--stages",
                f"pipelines of {[len(s) for s in splits]} stages share {micro} micro-batches "
                f"as {shares}, leaving one without any; give --shares",
            )
    elif len(shares) != count or sum(shares) != micro:
        raise _refused(
            "--shares",
            f"must give each of the {count} pipeline(s) its micro-batches, adding up to "
            f"spec.training.microBatches ({micro}); got {shares}",
        )
    return Layout(splits, list(shares))


def _refused(field: str, message: str) -> SpecError:
    return SpecError([(field, message)])


def default_workdir(job: FineTuneJob) -> Path:
    """The job's own state directory when --workdir is not given."""
    return DEFAULT_ROOT / job.metadata.namespace / job.metadata.name


def lock_workdir(workdir: Path, job: FineTuneJob) -> int:
    """Take `workdir`'s run lock for this process's life; returns the open descriptor.

    Raises AlreadyRunning, naming the holder's PID, while another live run holds it. The
    kernel drops the lock when its holder exits however it exits, so a crashed run never
    leaves a stale lock behind.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        meta = job.metadata
        raise AlreadyRunning(
            f"job {meta.namespace}/{meta.name} is already running in {workdir} "
            f"(PID {holder}); stop that run first or give another --workdir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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
        data = _s3_read(job, uri, "config.json")
        if data is None:
            raise SpecError([("spec.model.uri", f"{uri.rstrip('/')}/config.json does not exist")])
    else:
        path = Path(uri.removeprefix("file://")) / "config.json"
        if not path.is_file():
            raise SpecError([("spec.model.uri", f"{path} does not exist")])
        data = path.read_bytes()
    try:  # the planner's reading: an unsupported model_type is refused before any stage
        return ModelShape.from_hf_config(json.loads(data)).num_layers
    except ValueError as err:  # a ModelShapeError, or not JSON
        raise SpecError([("spec.model.uri", f"{uri.rstrip('/')}/config.json: {err}")]) from None


def _s3_read(job: FineTuneJob, uri: str, name: str) -> bytes | None:
    """`<uri>/<name>` from the job's object store, reached as its stages reach it: the
    contract's endpoint rule and AWS's standard credential chain (the operator's own reader,
    `objectstore`). None: no such object. Raises OSError when the store cannot be read."""
    # The minio client comes with the operator extra: imported only for a job on S3.
    from minio.error import MinioException

    from relaytrain_operator.store.objectstore import StoreAccess, StoreError, read_object

    access = StoreAccess.from_environ(job.spec.checkpoint.endpoint)
    try:
        return read_object(uri, name, access)
    except StoreError as err:
        raise OSError(str(err)) from err
    except MinioException as err:  # an answer, but not S3's
        raise OSError(f"reading {name} under {uri}: {err}") from err


@dataclass
class StageProc:
    """One supervised stage process."""

    index: int
    config_path: Path
    log_path: Path
    pipeline: int = 0
    name: str = ""
    """How messages name it: `stage K`, or `stage pP/sK` with several pipelines."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    failed_at: datetime | None = None
    """When its last failure was counted, while its successor waits out the back-off."""
    link_env: dict[str, str] = field(default_factory=dict)
    """This stage's link certificate, key and the job's CA, by env var name."""


class LocalRun:
    """Starts, watches, restarts and stops the stage processes of one job.

    `prepare` reads what the run needs (the model's layer count, free ports) and mints the
    link credentials; `write_stage_files` writes the stage documents (after the caller holds
    the state directory's lock); `supervise` runs the stages.
    """

    def __init__(
        self,
        job: FineTuneJob,
        workdir: Path,
        layout: Layout,
        documents: list[dict[str, Any]],
        link_envs: list[dict[str, str]],
    ) -> None:
        """`documents` and `link_envs`: one per stage, pipeline after pipeline."""
        self.job = job
        self.workdir = workdir.resolve()
        self.layout = layout
        self.documents = documents
        self.env = self._env(len(documents))
        stages_dir = self.workdir / "stages"
        several = len(layout.splits) > 1
        places = [(p, k) for p, split in enumerate(layout.splits) for k in range(len(split))]
        self.stages = []
        for (p, k), env in zip(places, link_envs, strict=True):
            base = f"p{p}-stage-{k}" if several else f"stage-{k}"
            self.stages.append(
                StageProc(
                    k,
                    stages_dir / f"{base}.json",
                    stages_dir / f"{base}.log",
                    pipeline=p,
                    name=f"stage p{p}/s{k}" if several else f"stage {k}",
                    link_env=env,
                )
            )
        ckpt = job.spec.checkpoint.uri
        self.job_dir = f"{ckpt.rstrip('/')}/{job.metadata.namespace}/{job.metadata.name}"
        self.output = self.documents[0]["output"]["uri"]
        self.stopping = False
        self.stop_signal: int | None = None

    @classmethod
    def prepare(
        cls,
        job: FineTuneJob,
        workdir: Path,
        stages: list[int] | None = None,
        *,
        replicas: int | None = None,
        shares: list[int] | None = None,
    ) -> LocalRun:
        """Split the model (`local_layout`), pick free loopback ports, build the stage
        documents and mint the link credentials (nothing is written)."""
        layout = local_layout(job, _model_layers(job), stages, replicas, shares)
        if stages is not None:
            # The command line chose the stage counts; the documents follow it.
            pipeline = job.spec.pipeline.model_copy(update={"stages": "auto"})
            spec = job.spec.model_copy(update={"pipeline": pipeline})
            job = job.model_copy(update={"spec": spec})
        counts = [len(split) for split in layout.splits]
        # Free ports, three a stage (any fixed port may be taken): its pipeline listener,
        # /metrics, and its listener for the stages of lower pipelines.
        ports = iter(_free_ports(3 * sum(counts)))
        endpoints = []
        for p, count in enumerate(counts):
            listen = [f"127.0.0.1:{next(ports)}" for _ in range(count)]
            replica = [f"127.0.0.1:{next(ports)}" if p > 0 else None for _ in range(count)]
            endpoints.append(
                [
                    StageEndpoints(
                        listen=None if k == 0 else listen[k],
                        next=None if k == count - 1 else listen[k + 1],
                        metrics_port=next(ports),
                        replica_listen=replica[k],
                        replica_address=replica[k],
                    )
                    for k in range(count)
                ]
            )
        configs = build_pipeline_configs(job, layout.splits, endpoints, layout.shares)
        meta = job.metadata
        pki = mint_link_credentials(meta.namespace, meta.name, counts, now=datetime.now(UTC))
        link_envs = []
        for p, count in enumerate(counts):
            for k in range(count):
                cert, key, ca = stage_pem(pki, p, k)
                link_envs.append({LINK_CERT_ENV: cert, LINK_KEY_ENV: key, LINK_CA_ENV: ca})
        documents = [doc for pipeline_docs in configs for doc in pipeline_docs]
        return cls(job, workdir, layout, documents, link_envs)

    def write_stage_files(self) -> None:
        """Write each stage's document (never its key: that goes in its environment)."""
        for stage, doc in zip(self.stages, self.documents, strict=True):
            stage.config_path.parent.mkdir(parents=True, exist_ok=True)
            stage.config_path.write_text(json.dumps(doc, indent=2))

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
        """Start (or restart) `stage` as the leader of a process group of its own, which
        `stop` signals whole. Nothing starts once a stop has begun."""
        if self.stopping or self.stop_signal is not None:
            return
        with stage.log_path.open("ab") as log:
            stage.proc = subprocess.Popen(
                [sys.executable, "-m", "relaytrain_worker", "--config", str(stage.config_path)],
                env={**self.env, **stage.link_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own group: a Ctrl-C in the terminal reaches only us, and stop() can
                # signal the stage and anything it started at once.
                start_new_session=True,
                # And it dies with us however we die (SIGKILL included), on Linux. The
                # function only calls prctl, getppid and at most kill, so the one other
                # thread we may run (tqdm's monitor) holds no lock it could wait for.
                preexec_fn=die_with_supervisor(os.getpid()),  # noqa: PLW1509
            )
        stage.pids.append(stage.proc.pid)
        stage.failed_at = None
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "stages": [
                {
                    "index": s.index,
                    "pipeline": s.pipeline,
                    "pid": s.proc.pid if s.proc else None,
                    "pids": s.pids,
                    "restarts": s.restarts,
                    "layers": list(self.layout.splits[s.pipeline][s.index]),
                }
                for s in self.stages
            ],
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))

    def read_json(self, name: str) -> Any:
        """`name` in the job's checkpoint directory, parsed (None: none yet, or unreadable
        this poll: the next one tries again)."""
        try:
            if self.job_dir.startswith("s3://"):
                data = _s3_read(self.job, self.job_dir, name)
            else:
                path = Path(self.job_dir.removeprefix("file://")) / name
                data = path.read_bytes() if path.is_file() else None
            return json.loads(data) if data is not None else None
        except (OSError, ValueError):
            return None
        except Exception:  # anything else from the S3 client: a read must not end the run
            return None

    def read_progress(self) -> Progress | None:
        """The job's progress.json (None: none yet, or unreadable this poll)."""
        record = self.read_json(PROGRESS_FILE)
        try:
            return Progress.from_json(record) if isinstance(record, dict) else None
        except ConfigError:
            return None

    def stop(self) -> None:
        """Stop every stage: SIGTERM to each stage's process group, SIGKILL to what is left
        after a grace period. No stage is (re)started afterwards."""
        self.stopping = True
        # Only stages not yet reaped: until it is waited for, a stage's PID (its group's
        # ID) cannot be reused by another process, so the signal cannot go astray.
        live = [s.proc for s in self.stages if s.proc is not None and s.proc.returncode is None]
        for proc in live:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        stuck = []
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stuck.append(proc)
        for proc in stuck:  # ignored SIGTERM for the whole grace period
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only a flag: raising here could land between a Popen and its bookkeeping and lose
        # track of a process. The loop notices within one poll.
        self.stop_signal = signum

    def supervise(self, show_progress: bool) -> int:
        """Run until every stage exits 0 (0), a stage fails more often than the failure
        policy allows (1), or SIGINT/SIGTERM stops the run (130/143). Every stage process is
        gone when this returns."""
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        bar = _progress_bar(show_progress)
        try:
            return self._supervise(bar)
        finally:
            self.stop()  # after a success nothing is left; after anything else, no orphans
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if bar is not None:
                bar.close()

    def _supervise(self, bar: Any) -> int:
        policy = self.job.spec.failure_policy
        backoff = timedelta(seconds=policy.backoff_seconds)
        # progress.json of an earlier run of the same job may say done; only this run's counts.
        started = datetime.now(UTC).replace(microsecond=0)
        for stage in self.stages:
            self.start(stage)
        while self.stop_signal is None:
            time.sleep(POLL_SECONDS)
            if self.stop_signal is not None:
                break
            progress = self.read_progress()
            if bar is not None and progress is not None:
                bar.total = progress.totalSteps
                bar.n = progress.step
                loss = progress.loss
                bar.set_postfix(
                    loss=f"{loss:.4f}" if loss is not None else "-",
                    tok_s=f"{progress.tokensPerSecond:.0f}",
                    ckpt=progress.lastCommittedStep,
                    **(
                        {"eval": f"{progress.evalLoss:.4f}"}
                        if progress.evalLoss is not None
                        else {}
                    ),
                )
                bar.refresh()
            finished = 0
            now = datetime.now(UTC)
            for stage in self.stages:
                assert stage.proc is not None
                code = stage.proc.poll()
                if code is None:
                    continue
                done_at = progress.updatedAt if progress is not None and progress.done else None
                if code == 0 or (done_at is not None and done_at >= started):
                    # A stage that dies after the job finished (its output written) is
                    # not restarted: its peers are gone and nothing is left to do.
                    finished += 1
                    continue
                if stage.failed_at is None:
                    counted = after_failure(stage.restarts, policy.max_stage_restarts)
                    if counted is None:
                        print(
                            f"{stage.name} failed (exit {code}) after "
                            f"{stage.restarts} restarts; see {stage.log_path}",
                            file=sys.stderr,
                        )
                        return 1
                    stage.restarts = counted
                    stage.failed_at = now
                    print(
                        f"{stage.name} exited with {code}; restarting it "
                        f"({stage.restarts}/{policy.max_stage_restarts})",
                        file=sys.stderr,
                    )
                    self._write_state()
                if not backoff_left(stage.restarts, stage.failed_at, now, backoff):
                    self.start(stage)
            if finished == len(self.stages):
                return 0
        print("\nstopping every stage…", file=sys.stderr)
        return 128 + self.stop_signal


def _signal_group(pgid: int, sig: int) -> None:
    """Signal a stage's process group; one that is gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


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
    trained = [e for e in losses if e.get("loss") is not None]
    ax.plot([e["step"] for e in trained], [e["loss"] for e in trained], marker=".",
            label="training")  # fmt: skip
    held = [e for e in losses if e.get("evalLoss") is not None]
    if held:  # the held-out loss (dataset.validation), step 0 being the base model's
        ax.plot([e["step"] for e in held], [e["evalLoss"] for e in held], marker="o",
                label="held-out")  # fmt: skip
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def run_local(
    job: FineTuneJob,
    workdir: Path,
    stages: list[int] | None,
    progress: bool,
    *,
    replicas: int | None = None,
    shares: list[int] | None = None,
) -> int:
    """Run `job` locally; returns the exit code."""
    started = time.monotonic()
    run = LocalRun.prepare(job, workdir, stages, replicas=replicas, shares=shares)
    lock = lock_workdir(run.workdir, job)  # before anything in the directory is written
    try:
        return _run_locked(run, progress, started)
    finally:
        os.close(lock)


def _run_locked(run: LocalRun, progress: bool, started: float) -> int:
    job = run.job
    run.write_stage_files()
    print(
        f"relaytrain: {job.metadata.name}: {_describe(run.layout)}, "
        f"checkpoints in {run.job_dir}, logs in {run.workdir / 'stages'}"
    )
    code = run.supervise(progress)
    if code != 0:
        return code
    losses = run.read_json("loss-history.json") or []
    png = run.workdir / "loss.png"
    have_png = bool(losses) and _loss_png(losses, png)
    final = run.read_progress()
    held = [e["evalLoss"] for e in losses if e.get("evalLoss") is not None]
    summary = {
        "job": job.metadata.name,
        "stages": len(run.stages),
        "pipelines": [
            {"stages": len(split), "layers": [list(r) for r in split], "microBatches": share}
            for split, share in zip(run.layout.splits, run.layout.shares, strict=True)
        ],
        "steps": final.step if final else None,
        "finalLoss": final.loss if final else None,
        "firstLoss": next((e["loss"] for e in losses if e.get("loss") is not None), None),
        **({"firstEvalLoss": held[0], "evalLoss": held[-1]} if held else {}),
        "tokensPerSecond": final.tokensPerSecond if final else None,
        "restarts": {
            (s.index if len(run.layout.splits) == 1 else f"p{s.pipeline}/s{s.index}"): s.restarts
            for s in run.stages
            if s.restarts
        },
        "output": (final.output if final else None) or run.output,
        "lossCurve": str(png) if have_png else None,
        "wallSeconds": round(time.monotonic() - started, 1),
    }
    (run.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("relaytrain: done")
    for key, value in summary.items():
        print(f"  {key:16} {value}")
    return 0


def _describe(layout: Layout) -> str:
    """`2 stages (layers 0-1, 2-3)`, or per pipeline with its micro-batches."""

    def one(split: list[tuple[int, int]]) -> str:
        return f"{len(split)} stages (layers {', '.join(f'{a}-{b - 1}' for a, b in split)})"

    if len(layout.splits) == 1:
        return one(layout.splits[0])
    return f"{len(layout.splits)} pipelines: " + "; ".join(
        f"p{p} {one(split)} x {share} micro-batch{'' if share == 1 else 'es'}"
        for p, (split, share) in enumerate(zip(layout.splits, layout.shares, strict=True))
    )


def run_command(args: argparse.Namespace) -> int:
    """Entry point of `relaytrain run --local`."""
    try:
        manifest = yaml.safe_load(args.job.read_text())
        # The default state directory is named after the job, so read its name first.
        workdir = args.workdir or default_workdir(parse_job(manifest, default_checkpoint_uri="."))
        default_ckpt = str((workdir / "checkpoints").resolve())
        job = parse_job(manifest, default_checkpoint_uri=default_ckpt)
        return run_local(
            job,
            workdir,
            args.stages,
            not args.no_progress,
            replicas=args.replicas,
            shares=args.shares,
        )
    except (OSError, yaml.YAMLError, SpecError, ValueError, AlreadyRunning) as exc:
        print(f"relaytrain run: {exc}", file=sys.stderr)
        return 2
