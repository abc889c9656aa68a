"""The workers' progress record, folded into status.progress.

The last stage rewrites `<checkpoint.uri>/<namespace>/<job>/progress.json` after every
optimizer step; its shape is the stage contract's `relaytrain_contract.Progress`. The
operator reads it on each periodic check (observe.py) and reports step, total, loss,
tokens/s, the last committed checkpoint, an ETA, what the data loader kept (examples,
truncated, dropped) and the newest held-out loss (evalLoss at evalStep), folded here
(pure). A record that is missing (training not started yet) or unreadable is no error: the
progress simply stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from relaytrain_contract import Progress as Record
from relaytrain_contract.progress import DATA_FIELDS, SEEN_FIELDS

from relaytrain_operator.domain.status import rfc3339
from relaytrain_operator.spec import FineTuneJob

JsonDict = dict[str, Any]


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


def fold(record: Record, job: FineTuneJob, now: datetime) -> Progress:
    """Turn a progress.json record into status.progress (pure)."""
    step, total = record.step, record.total_steps
    status: JsonDict = {"step": step, "totalSteps": total, "stepOfTotal": f"{step}/{total}"}
    if record.loss is not None:
        status["loss"] = round(record.loss, 6)
    status["tokensPerSecond"] = round(record.tokens_per_second, 6)
    if record.last_committed_step is not None:
        status["lastCommittedStep"] = record.last_committed_step
    if record.updated_at is not None:
        status["updatedAt"] = rfc3339(record.updated_at)
    counts = (record.examples, record.examples_truncated, record.examples_dropped)
    for key, count in zip(DATA_FIELDS, counts, strict=True):
        if count is not None:
            status[key] = count
    if record.epoch is not None:
        status["epoch"] = round(record.epoch, 4)
    seen = (record.examples_seen, record.tokens_seen, record.tokens_trained)
    for key, count in zip(SEEN_FIELDS[1:], seen, strict=True):
        if count is not None:
            status[key] = count
    if record.eval_loss is not None and record.eval_step is not None:
        status["evalLoss"] = round(record.eval_loss, 6)
        status["evalStep"] = record.eval_step
    if not record.done and (record.step_seconds or record.tokens_per_second):
        if record.step_seconds:
            remaining = max(0, total - step) * record.step_seconds
        else:
            # An older worker reports no step time: assume full rows (an upper bound when
            # the data is padded).
            training = job.spec.training
            tokens_per_step = (
                training.micro_batch_size
                * training.micro_batches
                * job.spec.dataset.sequence_length
            )
            remaining = max(0, total - step) * tokens_per_step / record.tokens_per_second
        status["eta"] = rfc3339((record.updated_at or now) + timedelta(seconds=remaining))
    return Progress(status=status, done=record.done, output=record.output)
