"""The progress record the operator reads: ``<job_prefix>/progress.json`` (docs/stage-contract.md).

The last stage rewrites it after every optimizer step (an atomic put, so the operator never
reads half of one). Field names are the contract's camelCase ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from relaytrain_worker.store import ObjectNotFound, Store

PROGRESS = "progress.json"


@dataclass(frozen=True)
class Progress:
    """Where a job stands."""

    step: int
    """Optimizer steps finished."""
    total_steps: int
    """Optimizer steps the job will run."""
    loss: float | None
    """Training loss of the last step (None before the first one, or if it was not finite)."""
    tokens_per_second: float
    """Training throughput of the pipeline over the last step(s)."""
    last_committed_step: int | None
    """Newest committed checkpoint step, None before the first commit."""
    updated_at: str = ""
    """UTC time of the write, RFC 3339 (filled in by ``write_progress`` when empty)."""
    done: bool = False
    """True once the job finished and its output is written."""
    output: str | None = None
    """Where the final adapter went (only when done)."""
    step_seconds: float | None = None
    """Wall seconds the last step took (what the operator's ETA is based on)."""

    def __post_init__(self) -> None:
        if self.step < 0 or self.total_steps < 0 or self.step > self.total_steps:
            raise ValueError(f"step {self.step} of {self.total_steps} is not a valid progress")

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "step": self.step,
            "totalSteps": self.total_steps,
            # JSON has no NaN/inf; a diverged loss is reported as null.
            "loss": self.loss if self.loss is not None and math.isfinite(self.loss) else None,
            "tokensPerSecond": round(self.tokens_per_second, 3),
            "lastCommittedStep": self.last_committed_step,
            "updatedAt": self.updated_at or _now(),
            "done": self.done,
        }
        if self.output is not None:
            doc["output"] = self.output
        if self.step_seconds is not None:
            doc["stepSeconds"] = round(self.step_seconds, 4)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Progress:
        return cls(
            step=int(doc["step"]),
            total_steps=int(doc["totalSteps"]),
            loss=None if doc.get("loss") is None else float(doc["loss"]),
            tokens_per_second=float(doc.get("tokensPerSecond", 0.0)),
            last_committed_step=doc.get("lastCommittedStep"),
            updated_at=str(doc.get("updatedAt", "")),
            done=bool(doc.get("done", False)),
            output=doc.get("output"),
            step_seconds=None if doc.get("stepSeconds") is None else float(doc["stepSeconds"]),
        )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def progress_key(job_prefix: str) -> str:
    return f"{job_prefix.strip('/')}/{PROGRESS}" if job_prefix.strip("/") else PROGRESS


def write_progress(store: Store, job_prefix: str, progress: Progress) -> None:
    """Write ``progress.json`` atomically."""
    store.put(progress_key(job_prefix), json.dumps(progress.to_json(), indent=1).encode())


def read_progress(store: Store, job_prefix: str) -> Progress | None:
    """The current progress, or None if none was written yet."""
    try:
        raw = store.get(progress_key(job_prefix))
    except ObjectNotFound:
        return None
    return Progress.from_json(json.loads(raw))
