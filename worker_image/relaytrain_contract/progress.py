"""progress.json: where a job stands, written by its last stage, read by the operator and
by `relaytrain run --local` (docs/stage-contract.md).

The last stage rewrites `<checkpoint.uri>/<namespace>/<job>/progress.json` (names.PROGRESS_FILE)
after every optimizer step, atomically. The record's keys are camelCase and the attributes
snake_case (relaytrain_contract.camel, as in the stage document); records dump by alias.
Unknown fields are ignored, so a reader older than the writer still reports what it knows.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relaytrain_contract.camel import CAMEL_CASE
from relaytrain_contract.errors import field_error, parse_json

Steps = Annotated[int, Field(ge=0)]
DATA_FIELDS = ("examples", "examplesTruncated", "examplesDropped")
"""The keys of the dataset's example counts in a record (what stage 0 read, truncated and
dropped)."""
SEEN_FIELDS = ("epoch", "examplesSeen", "tokensSeen", "tokensTrained")
"""The keys of where training stands in the data (after `step` steps)."""


class Progress(BaseModel):
    """One progress record."""

    model_config = ConfigDict(
        **CAMEL_CASE, extra="ignore", strict=True, frozen=True, use_attribute_docstrings=True
    )

    step: Steps
    """Optimizer steps finished."""
    total_steps: Steps
    """Optimizer steps the job will run."""
    loss: float | None = None
    """Training loss of the last step (null before the first one, or when it was not finite:
    JSON has no NaN)."""
    tokens_per_second: Annotated[float, Field(ge=0.0)]
    """Non-padding input tokens per second of wall time over the last step."""
    last_committed_step: Steps | None = None
    """Newest committed checkpoint step; null before the first commit."""
    updated_at: datetime | None = None
    """When the record was written (UTC, RFC 3339); `stamped` fills it in."""
    done: bool = False
    """True once the job finished and its output is written."""
    output: str | None = None
    """Where the final adapter went (only when done)."""
    step_seconds: Annotated[float, Field(ge=0.0)] | None = None
    """Wall seconds the last step took (the operator's ETA is based on it; optional: an
    older worker does not write it)."""

    examples: Steps | None = None
    """Examples (records) in the dataset, as stage 0 read them (optional: unknown before
    stage 0 has read the data, and from an older worker)."""
    examples_truncated: Steps | None = None
    """Examples longer than dataset.sequenceLength that were cut to it
    (`dataset.truncation: truncate`; optional like `examples`)."""
    examples_dropped: Steps | None = None
    """Examples longer than dataset.sequenceLength that were left out
    (`dataset.truncation: drop`; optional like `examples`)."""
    epoch: Annotated[float, Field(ge=0.0)] | None = None
    """Passes over the training rows the `step` steps made (1.5: halfway through the
    second); optional like `examples`."""
    examples_seen: Steps | None = None
    """Examples the `step` steps trained on, each counted again in every pass that holds it
    (optional like `examples`)."""
    tokens_seen: Steps | None = None
    """Non-padding input tokens of those steps (optional like `examples`)."""
    tokens_trained: Steps | None = None
    """Of those, the tokens that had a loss (completion or assistant tokens; all but each
    example's first for `text`; optional like `examples`)."""
    eval_loss: float | None = None
    """Token-mean loss on the held-out data (`dataset.validation`) at `evalStep` (optional:
    absent before the first evaluation, without validation data, or when not finite)."""
    eval_step: Steps | None = None
    """Optimizer steps finished when `evalLoss` was evaluated (0: the base model)."""

    @field_validator("loss", "eval_loss", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    @model_validator(mode="after")
    def _step_of_total(self) -> Progress:
        if self.step > self.total_steps:
            raise field_error("step", f"step {self.step} of {self.total_steps} is past the end")
        if self.examples is not None:
            counts = (self.examples_truncated, self.examples_dropped)
            for key, count in zip(DATA_FIELDS[1:], counts, strict=True):
                if count is not None and count > self.examples:
                    raise field_error(key, f"{count} of {self.examples} examples is too many")
        return self

    def stamped(self, now: datetime | None = None) -> Progress:
        """This record with `updatedAt` set (to `now`, default the current time) if unset."""
        if self.updated_at is not None:
            return self
        moment = (now or datetime.now(UTC)).astimezone(UTC).replace(microsecond=0)
        return self.model_copy(update={"updated_at": moment})

    def to_json(self) -> bytes:
        """The record as written: `output`, `stepSeconds`, the example counts, where training
        stands in the data and the held-out loss only when known."""
        record = self.model_dump(mode="json")
        for key in ("output", "stepSeconds", *DATA_FIELDS, *SEEN_FIELDS, "evalLoss", "evalStep"):
            if record[key] is None:
                del record[key]
        return json.dumps(record, indent=1).encode()

    @classmethod
    def from_json(cls, data: str | bytes | dict[str, Any]) -> Progress:
        """Parse a record (JSON text, or a dict as parsed from it); ConfigError names the field."""
        return parse_json(cls, data, "progress.json")


__all__ = ["DATA_FIELDS", "Progress"]
