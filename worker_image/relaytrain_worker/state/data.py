"""Training data for stage 0: JSONL → token sequences → the micro-batches of each step.

Three formats: `text` (every token is learned), `prompt-completion` (prompt tokens get
label -100, so only the completion is learned) and `chat` (the tokenizer's chat
template; only the assistant turns are learned). An example longer than `sequenceLength`
is truncated to it or dropped (`truncation`); both are counted (`DataReport`), and the
last stage reports the counts in progress.json.

Rows are packed (whole examples placed into rows of `sequenceLength` by best-fit
decreasing, the rest of a row padded) or padded (one example per row). Positions restart
at 0 at every example, and the first token of every example is never a target, so no
token predicts or attends across examples: the mask functions of the slices
(`families.masks`) read the example boundaries from where positions restart, in every
stage, since position ids travel down the pipeline with the activations. Padding continues
the positions of the row's last example, is masked from attention and loss.

Reading the records (and holding some out for evaluation) is `records.py`; chat rendering
is `chat.py`.

Which rows form step s is a pure function of (seed, s): row i of the run is row
perm_e[i mod N] of epoch e = i // N, with perm_e a seeded permutation. Restoring the
data position after a rollback is therefore just "continue at step s".
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from relaytrain_contract import DatasetSpec

from relaytrain_worker.state.chat import assistant_spans
from relaytrain_worker.state.records import (
    IGNORE,
    DataError,
    Example,
    Record,
    read_jsonl,
    split_records,
)
from relaytrain_worker.state.store import ObjectNotFound, Store

log = logging.getLogger("relaytrain.data")

DATA_REPORT = "data-report.json"
"""Object under the job prefix where stage 0 leaves its `DataReport` for the last stage."""


@dataclass
class MicroBatch:
    """One micro-batch as stage 0 feeds it; later stages get the same fields by link."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    rows: torch.Tensor | None = None
    """Each sequence's index among the job's rows (training or held-out): the key the
    ``delta`` compression caches a sequence's boundary activation under."""


@dataclass(frozen=True)
class DataReport:
    """What stage 0 made of the dataset: what progress.json reports."""

    examples: int
    """Records read (and tokenized)."""
    truncated: int
    """Examples longer than sequenceLength cut to it (`truncation: truncate`)."""
    dropped: int
    """Examples longer than sequenceLength left out (`truncation: drop`)."""
    rows: int
    """Rows of sequenceLength tokens the kept examples fill (packed or padded)."""
    row_counts: tuple[tuple[int, int, int], ...] = ()
    """Per row: (examples, non-padding tokens, tokens with a loss); empty from an older
    stage 0."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DataReport:
        doc = json.loads(data)
        doc["row_counts"] = tuple(tuple(c) for c in doc.get("row_counts", ()))
        return cls(**doc)

    def seen(self, steps: int, rows_per_step: int, seed: int) -> DataSeen | None:
        """Where `steps` optimizer steps of `rows_per_step` rows stand in the data: a pure
        function of the step (as the rows of each step are), so a replaced, re-joined or
        resumed stage reports the same. None without the per-row counts."""
        n = self.rows
        if not self.row_counts or n == 0:
            return None
        counts = torch.tensor(self.row_counts, dtype=torch.int64)
        used = steps * rows_per_step
        passes, rest = divmod(used, n)
        total = counts.sum(dim=0) * passes + counts[row_order(seed, passes, n)[:rest]].sum(dim=0)
        examples, tokens, trained = (int(v) for v in total)
        return DataSeen(used / n, examples, tokens, trained)


@dataclass(frozen=True)
class DataSeen:
    """Where training stands in the data (progress.json's `epoch` ... `tokensTrained`)."""

    epoch: float
    examples: int
    tokens: int
    trained: int


def row_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of the `n` rows in pass `epoch` (0-based) of a run seeded `seed`."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def row_counts(rows: Rows) -> tuple[tuple[int, int, int], ...]:
    """Per row: examples (where positions restart at 0 inside the row's tokens), non-padding
    tokens, and tokens with a loss."""
    real = rows.attention_mask.bool()
    starts = ((rows.position_ids == 0) & real).sum(dim=1)
    tokens = real.sum(dim=1)
    trained = ((rows.labels != IGNORE) & real).sum(dim=1)
    return tuple(zip(starts.tolist(), tokens.tolist(), trained.tolist(), strict=True))


def report_key(job_prefix: str) -> str:
    prefix = job_prefix.strip("/")
    return f"{prefix}/{DATA_REPORT}" if prefix else DATA_REPORT


def write_report(store: Store, job_prefix: str, report: DataReport) -> None:
    """Stage 0, once it has read the data: leave the counts for the last stage."""
    store.put(report_key(job_prefix), report.to_json())


def read_report(store: Store, job_prefix: str) -> DataReport | None:
    """What stage 0 left (None before it has, or when an older stage 0 left nothing)."""
    try:
        return DataReport.from_json(store.get(report_key(job_prefix)))
    except ObjectNotFound:
        return None


def _field(record: Record, key: str, setting: str, number: int, uri: str) -> Any:
    if key not in record.fields:
        raise DataError(
            f"dataset.{setting}: field {key!r} does not exist in record {number} "
            f"(line {record.line} of {uri}; its fields: "
            f"{', '.join(sorted(record.fields)) or 'none'})"
        )
    return record.fields[key]


def tokenize(records: list[Record], tokenizer: Any, spec: DatasetSpec) -> list[Example]:
    """One Example per record; DataError naming the line (and file) of a record that
    cannot be used."""
    eos = tokenizer.eos_token_id
    if spec.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"dataset.format chat: the model's tokenizer has no chat template "
            f"(tokenizer_config.json or chat_template.jinja), needed to render {spec.uri}"
        )
    out = []
    for number, record in enumerate(records, start=1):
        if spec.format == "text":
            text = _field(record, spec.text_field, "textField", number, spec.uri)
            ids = tokenizer(str(text), add_special_tokens=False)["input_ids"] + [eos]
            out.append(Example(ids, list(ids), record.line))
        elif spec.format == "prompt-completion":
            prompt = _field(record, spec.prompt_field, "promptField", number, spec.uri)
            completion = _field(record, spec.completion_field, "completionField", number,
                                spec.uri)  # fmt: skip
            p = tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
            c = tokenizer(str(completion), add_special_tokens=False)["input_ids"] + [eos]
            out.append(Example(p + c, [IGNORE] * len(p) + c, record.line))
        else:
            messages = _field(record, spec.messages_field, "messagesField", number, spec.uri)
            where = f"line {record.line} of {spec.uri}"
            ids, labels = assistant_spans(tokenizer, messages, where)
            out.append(Example(ids, labels, record.line))
    return out


def fit(examples: list[Example], spec: DatasetSpec) -> tuple[list[Example], int, int]:
    """Examples no longer than `sequenceLength`: longer ones truncated or dropped, as
    `truncation` says; returns (examples kept, truncated, dropped)."""
    length = spec.sequence_length
    kept: list[Example] = []
    truncated = dropped = 0
    for ex in examples:
        if len(ex.ids) <= length:
            kept.append(ex)
        elif spec.truncation == "drop":
            dropped += 1
        else:
            truncated += 1
            kept.append(Example(ex.ids[:length], ex.labels[:length], ex.line))
    if not kept:
        raise DataError(
            f"dataset.truncation drop: all {len(examples)} examples of {spec.uri} are longer "
            f"than dataset.sequenceLength {length}, so none is left to train on"
        )
    if truncated:
        log.warning("Truncated %d of %d examples to %d tokens", truncated, len(examples), length)
    if dropped:
        log.warning(
            "Dropped %d of %d examples longer than %d tokens", dropped, len(examples), length
        )
    return kept, truncated, dropped


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices of the items each row holds (rows of `capacity`).

    Items go longest first (ties in order) into the fullest row they fit, else a new row;
    within a row they keep their original order. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    rows: list[list[int]] = []
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (capacity - lengths[i], len(rows) - 1))
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            bisect.insort(free, (room - lengths[i], row))
    return [sorted(row) for row in rows]


@dataclass
class Rows:
    """All training rows of a job, each exactly `sequenceLength` tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    """Restart at 0 at every example; padding continues the row's last example."""


def build_rows(examples: list[Example], spec: DatasetSpec, pad_id: int) -> Rows:
    """Pack or pad the examples (none longer than `sequenceLength`) into rows."""
    length = spec.sequence_length
    layout = (
        pack([len(ex.ids) for ex in examples], length)
        if spec.packing
        else [[i] for i in range(len(examples))]
    )
    n = len(layout)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    labels = torch.full((n, length), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    pos = torch.zeros((n, length), dtype=torch.long)
    for row, members in enumerate(layout):
        at = 0
        for i in members:
            ex = examples[i]
            size = len(ex.ids)
            ids[row, at : at + size] = torch.tensor(ex.ids)
            labels[row, at : at + size] = torch.tensor(ex.labels)
            labels[row, at] = IGNORE  # nothing before it in its example predicts it
            mask[row, at : at + size] = 1
            pos[row, at : at + size] = torch.arange(size)
            at += size
        last = len(examples[members[-1]].ids)
        pos[row, at:] = torch.arange(last, last + length - at)
    return Rows(ids, labels, mask, pos)


class StepData:
    """The micro-batches of every step, reproducible from (seed, step)."""

    def __init__(
        self,
        rows: Rows,
        micro_batch_size: int,
        micro_batches: int,
        seed: int,
        report: DataReport,
    ) -> None:
        self.rows = rows
        self.mbs = micro_batch_size
        self.m = micro_batches
        self.seed = seed
        self.report = report
        """What was read, truncated and dropped."""
        self._perms: dict[int, torch.Tensor] = {}

    def _row(self, i: int) -> int:
        n = self.rows.input_ids.shape[0]
        epoch, pos = divmod(i, n)
        if epoch not in self._perms:
            self._perms = {epoch: row_order(self.seed, epoch, n)}
        return int(self._perms[epoch][pos])

    def steps_for_epochs(self, epochs: int) -> int:
        """Optimizer steps that cover `epochs` passes over the rows (the last one partial)."""
        rows = int(self.rows.input_ids.shape[0])
        return max(1, -(-epochs * rows // (self.mbs * self.m)))

    def step(self, step: int) -> list[MicroBatch]:
        """The M micro-batches of optimizer step `step` (0-based)."""
        per_step = self.mbs * self.m
        out = []
        if log.isEnabledFor(logging.DEBUG):  # which rows, for a test (or a person) to list
            rows = [self._row(step * per_step + r) for r in range(per_step)]
            log.debug("Step %d trains rows %s", step + 1, rows)
        for m in range(self.m):
            base = step * per_step + m * self.mbs
            idx = torch.tensor([self._row(base + r) for r in range(self.mbs)])
            ids = self.rows.input_ids[idx]
            mask = self.rows.attention_mask[idx]
            labels = self.rows.labels[idx].clone()
            labels[mask == 0] = IGNORE
            pos = self.rows.position_ids[idx].contiguous()
            out.append(MicroBatch(ids, mask, pos, labels, idx))
        return out


def check_length(spec: DatasetSpec, max_positions: int | None) -> None:
    """A sequence longer than the model's context is an error, named by its setting."""
    if max_positions is not None and spec.sequence_length > max_positions:
        raise DataError(
            f"dataset.sequenceLength {spec.sequence_length} is longer than the model allows "
            f"(max_position_embeddings {max_positions})"
        )


def load_step_data(
    spec: DatasetSpec,
    tokenizer: Any,
    *,
    max_positions: int | None,
    micro_batch_size: int,
    micro_batches: int,
    seed: int,
    opener: Any = None,
) -> StepData:
    """Read, tokenize and shape the dataset for stage 0."""
    check_length(spec, max_positions)
    records = read_jsonl(spec.uri, opener)
    if spec.validation is not None and spec.validation.fraction is not None:
        records = split_records(records, spec.validation.fraction, seed)[0]  # held out
    examples = tokenize(records, tokenizer, spec)
    kept, truncated, dropped = fit(examples, spec)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = build_rows(kept, spec, int(pad))
    report = DataReport(
        len(examples), truncated, dropped, int(rows.input_ids.shape[0]), row_counts(rows)
    )
    return StepData(rows, micro_batch_size, micro_batches, seed, report)
