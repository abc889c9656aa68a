"""The workers' progress record, folded into status.progress.

The last stage rewrites `<checkpoint.uri>/<namespace>/<job>/progress.json` after every
optimizer step (docs/stage-contract.md). The operator reads it on each periodic check
(observe.py) and reports step, total, loss, tokens/s, the last committed checkpoint and an
ETA, folded here (pure). A record that is missing (training not started yet) or
unreadable is no error: the progress simply stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from relaytrain_operator.spec import FineTuneJob
from relaytrain_operator.status import parse_time, rfc3339

JsonDict = dict[str, Any]
PROGRESS_FILE = "progress.json"


@dataclass(frozen=True)
class Progress:
    """What the operator learned from progress.json."""

    status: JsonDict
    """status.progress (camelCase)."""
    done: bool
    """The workers report the job finished."""
    output: str | None
    """Where the result was written, once done."""


def job_store_uri(job: FineTuneJob) -> str:
    """`<checkpoint.uri>/<namespace>/<job>`: where the workers keep this job's files."""
    base = job.spec.checkpoint.uri.rstrip("/")
    return f"{base}/{job.metadata.namespace}/{job.metadata.name}"


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _int(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


def fold(record: JsonDict, job: FineTuneJob, now: datetime) -> Progress:
    """Turn a progress.json record into status.progress (pure)."""
    step = _int(record.get("step")) or 0
    total = _int(record.get("totalSteps")) or job.spec.training.steps
    tokens_per_second = _number(record.get("tokensPerSecond"))
    status: JsonDict = {"step": step}
    if total is not None:
        status["totalSteps"] = total
        status["stepOfTotal"] = f"{step}/{total}"
    for key in ("loss", "tokensPerSecond"):
        value = _number(record.get(key))
        if value is not None:
            status[key] = round(value, 6)
    committed = _int(record.get("lastCommittedStep"))
    if committed is not None:
        status["lastCommittedStep"] = committed
    updated = parse_time(record.get("updatedAt"))
    if updated is not None:
        status["updatedAt"] = rfc3339(updated)
    done = bool(record.get("done"))
    step_seconds = _number(record.get("stepSeconds"))
    if total is not None and not done and (step_seconds or tokens_per_second):
        if step_seconds:
            remaining = max(0, total - step) * step_seconds
        else:
            # An older worker reports no step time: assume full rows (an upper bound when
            # the data is padded).
            training = job.spec.training
            tokens_per_step = (
                training.micro_batch_size
                * training.micro_batches
                * job.spec.dataset.sequence_length
            )
            remaining = max(0, total - step) * tokens_per_step / (tokens_per_second or 1.0)
        status["eta"] = rfc3339((updated or now) + timedelta(seconds=remaining))
    output = record.get("output") if isinstance(record.get("output"), str) else None
    return Progress(status=status, done=done, output=output)
