"""`relaytrain run --local JOB.yaml`: run a FineTuneJob as local stage processes.

The same manifest the operator takes; the same stage documents the operator builds
(`stage_config.build_stage_configs`); the same worker (`python -m relaytrain_worker`).
What the operator does with pods this does with processes: one per stage on loopback
ports, a fresh link CA and stage certificates (minted as the operator mints them; each
stage's are written into a private folder its document names, as a pod's Secret volume
is: in memory where the OS offers one, never in the run's directory, removed when the run
ends), a local checkpoint directory unless the job names S3, and supervision — a stage
process that dies is restarted alone, after failurePolicy.backoffSeconds, up to
failurePolicy.maxStageRestarts times (the operator's own rule: `recovery.after_failure` and
`recovery.backoff_left`); the survivors roll back to the last committed checkpoint by
themselves.

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
"Several pipelines as processes"). The fleet may change while the run goes on:
`kill -USR1 <pid>` (the supervisor's, in state.json) takes the highest pipeline training
out — its stages leave at their next step boundary and are not restarted, and the store
names it out, as the operator does for a node that announces its end — and `kill -USR2
<pid>` brings the lowest one out back, its stages rejoining at a step boundary, or, with
none out, adds a pipeline the run did not have (`grow`: the stages training learn of it from
fleet.json in the store and admit it at a step boundary; a run of one pipeline restarts as
pipeline 0 beside it, every stage from the last commit); the summary lists each change
(`pipelineChanges`).

The package, by concern: `layout` (the pipelines' layer splits and shares, the state
directory and its lock), `storage` (config.json, progress.json and the loss history, on
disk or S3), `stages` (stage documents, ports, link credentials, environment), `grow` (a
pipeline added while the run goes on), `supervisor` (`LocalRun`: starting, restarting and
stopping the stage processes) and `report` (the progress bar, the loss plot and the
summary). This module holds the command.

This package never imports torch: it runs in the operator package.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from relaytrain_operator import cli
from relaytrain_operator.cli.local_run.layout import (
    DEFAULT_ROOT,
    DEFAULT_STAGES,
    LOCK_FILE,
    AlreadyRunning,
    Layout,
    default_workdir,
    even_split,
    local_layout,
    lock_workdir,
)
from relaytrain_operator.cli.local_run.report import describe, finish, on_gpus
from relaytrain_operator.cli.local_run.stages import (
    PR_SET_PDEATHSIG,
    PREFORK_ENV,
    StageProc,
    die_with_supervisor,
)
from relaytrain_operator.cli.local_run.storage import model_layers
from relaytrain_operator.cli.local_run.supervisor import (
    POLL_SECONDS,
    STOP_GRACE_SECONDS,
    LocalRun,
)
from relaytrain_operator.spec import FineTuneJob, SpecError, parse_job

__all__ = [
    "DEFAULT_ROOT",
    "DEFAULT_STAGES",
    "LOCK_FILE",
    "POLL_SECONDS",
    "PREFORK_ENV",
    "PR_SET_PDEATHSIG",
    "STOP_GRACE_SECONDS",
    "AlreadyRunning",
    "Layout",
    "LocalRun",
    "StageProc",
    "add_parser",
    "default_workdir",
    "die_with_supervisor",
    "even_split",
    "local_layout",
    "lock_workdir",
    "model_layers",
    "run_command",
    "run_local",
]

_model_layers = model_layers  # its name before the split (tests/unit/test_store_credentials.py)


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
    try:
        run.write_stage_files()
        print(
            f"relaytrain: {run.job.metadata.name}: {describe(run.layout)}, "
            f"checkpoints in {run.job_dir}, logs in {run.workdir / 'stages'}" + on_gpus(run.stages)
        )
        code = run.supervise(progress)
    finally:
        run.remove_credentials()  # supervise did; this covers a failure before it ran
    if code != 0:
        return code
    finish(run, started)
    return 0


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
