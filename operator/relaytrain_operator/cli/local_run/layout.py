"""What a local run trains where, and where it keeps its state.

The layout: every pipeline's even split of the decoder layers and its micro-batches of
each step (`local_layout`). The state directory: one per job (`default_workdir`), held by
a run lock for the supervisor's life (`lock_workdir`).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from relaytrain_operator.domain.planner import Lane, split_micro_batches
from relaytrain_operator.spec import FineTuneJob, SpecError

DEFAULT_STAGES = 2
DEFAULT_ROOT = Path("relaytrain-local")
"""Where a job's state directory goes without --workdir: DEFAULT_ROOT/<namespace>/<name>."""
LOCK_FILE = "run.lock"


class AlreadyRunning(Exception):  # noqa: N818 - reads as what happened
    """Another live `relaytrain run --local` holds the job's state directory."""


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
        shares = split_micro_batches(_beats(splits), micro)
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


def grown_layout(layout: Layout, micro: int) -> Layout:
    """`layout` with one more pipeline, split as its last one, and every pipeline's share
    planned again, at least one each (the added pipeline's stages are told theirs in their
    documents; those already training, in names.FLEET_FILE).
    ValueError saying why when the step has no micro-batch for it."""
    count = len(layout.splits) + 1
    if count > micro:
        raise ValueError(
            f"{count} pipelines need at least {count} micro-batches per step; "
            f"spec.training.microBatches is {micro}"
        )
    splits = [*layout.splits, list(layout.splits[-1])]
    shares = split_micro_batches(_beats(splits), micro)
    while min(shares) < 1:  # a pipeline is added to train: one from the largest share
        shares[shares.index(max(shares))] -= 1
        shares[shares.index(0)] += 1
    return Layout(splits, shares)


def _beats(splits: list[list[tuple[int, int]]]) -> list[Lane]:
    """Each pipeline's 1F1B over its stage count, its slowest stage's layers a beat: what its
    share goes by."""
    return [Lane.of_beats(len(split), float(max(e - s for s, e in split))) for split in splits]


def _refused(field: str, message: str) -> SpecError:
    return SpecError([(field, message)])


def even_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Half-open layer ranges, as even as possible, earlier stages never smaller."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(stages)]


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
