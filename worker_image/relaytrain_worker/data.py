"""Training data for stage 0: JSONL → token sequences → the micro-batches of each step.

Three formats: `text` (every token is learned), `prompt-completion` (prompt tokens get
label -100, so only the completion is learned) and `chat` (the tokenizer's chat
template; only the assistant turns are learned). Sequences are packed (examples
concatenated, EOS between them, cut into full-length rows) or padded (one example per
row, right-padded, the padding masked from attention and loss).

Which rows form step s is a pure function of (seed, s): row i of the run is row
perm_e[i mod N] of epoch e = i // N, with perm_e a seeded permutation. Restoring the
data position after a rollback is therefore just "continue at step s".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from relaytrain_contract import DatasetSpec

from relaytrain_worker.schedule import MicroBatch

log = logging.getLogger("relaytrain.data")

IGNORE = -100


class DataError(ValueError):
    """The dataset cannot be used as configured; the message names the field or value."""


def read_jsonl(uri: str, opener: Any = None) -> list[dict[str, Any]]:
    """Records of a JSONL file at a local path, file:// or s3:// (via `opener(prefix)`)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if opener is None:
            raise DataError(f"dataset.uri {uri!r}: s3:// needs the checkpoint endpoint")
        prefix, _, name = uri.rpartition("/")
        raw = opener(prefix).get(name)
    else:
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.is_file():
            raise DataError(f"dataset.uri {uri!r}: no such file")
        raw = path.read_bytes()
    records = []
    for number, line in enumerate(raw.decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"dataset.uri {uri!r}: line {number} is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise DataError(f"dataset.uri {uri!r}: line {number} is not a JSON object")
        records.append(record)
    if not records:
        raise DataError(f"dataset.uri {uri!r}: no records")
    return records


def _field(record: dict[str, Any], key: str, setting: str, number: int) -> Any:
    if key not in record:
        raise DataError(
            f"dataset.{setting}: field {key!r} does not exist in record {number} "
            f"(its fields: {', '.join(sorted(record)) or 'none'})"
        )
    return record[key]


def tokenize(
    records: list[dict[str, Any]], tokenizer: Any, spec: DatasetSpec
) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per record; labels are -100 where no loss is taken."""
    eos = tokenizer.eos_token_id
    out = []
    for number, record in enumerate(records, start=1):
        if spec.format == "text":
            text = _field(record, spec.textField, "textField", number)
            ids = tokenizer(str(text), add_special_tokens=False)["input_ids"] + [eos]
            out.append((ids, list(ids)))
        elif spec.format == "prompt-completion":
            prompt = _field(record, spec.promptField, "promptField", number)
            completion = _field(record, spec.completionField, "completionField", number)
            p = tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
            c = tokenizer(str(completion), add_special_tokens=False)["input_ids"] + [eos]
            out.append((p + c, [IGNORE] * len(p) + c))
        else:
            messages = _field(record, spec.messagesField, "messagesField", number)
            out.append(_chat(tokenizer, messages, number))
    return out


def _chat(tokenizer: Any, messages: Any, number: int) -> tuple[list[int], list[int]]:
    """Template the conversation; learn only the assistant turns (prefix-diff method)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise DataError(
            f"dataset.messagesField: record {number} is not a list of {{role, content}}"
        )

    def encode(msgs: list[dict[str, Any]], prompt: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=prompt, return_dict=False
        )
        return list(ids)

    ids = encode(messages, False)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(encode(messages[:i], True))
        end = len(encode(messages[: i + 1], False))
        labels[start:end] = ids[start:end]
    return ids, labels


@dataclass
class Rows:
    """All training rows of a job, each exactly `sequenceLength` tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor


def build_rows(examples: list[tuple[list[int], list[int]]], spec: DatasetSpec, pad_id: int) -> Rows:
    """Pack or pad the examples into rows of `sequenceLength`."""
    length = spec.sequenceLength
    if spec.packing:
        stream_ids = [t for ids, _ in examples for t in ids]
        stream_labels = [t for _, labels in examples for t in labels]
        n = len(stream_ids) // length
        if n == 0:
            raise DataError(
                f"dataset.sequenceLength {length}: the whole dataset has only "
                f"{len(stream_ids)} tokens, not enough for one packed row"
            )
        ids = torch.tensor(stream_ids[: n * length]).view(n, length)
        labels = torch.tensor(stream_labels[: n * length]).view(n, length)
        return Rows(ids, labels, torch.ones_like(ids))
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    truncated = 0
    for row, (e_ids, e_labels) in enumerate(examples):
        if len(e_ids) > length:
            truncated += 1
        n = min(len(e_ids), length)
        ids[row, :n] = torch.tensor(e_ids[:n])
        labels[row, :n] = torch.tensor(e_labels[:n])
        mask[row, :n] = 1
    if truncated:
        log.warning("Truncated %d of %d examples to %d tokens", truncated, len(examples), length)
    return Rows(ids, labels, mask)


class StepData:
    """The micro-batches of every step, reproducible from (seed, step)."""

    def __init__(self, rows: Rows, micro_batch_size: int, micro_batches: int, seed: int) -> None:
        self.rows = rows
        self.mbs = micro_batch_size
        self.m = micro_batches
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _row(self, i: int) -> int:
        n = self.rows.input_ids.shape[0]
        epoch, pos = divmod(i, n)
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perms = {epoch: torch.randperm(n, generator=gen)}
        return int(self._perms[epoch][pos])

    def steps_for_epochs(self, epochs: int) -> int:
        """Optimizer steps that cover `epochs` passes over the rows (the last one partial)."""
        rows = int(self.rows.input_ids.shape[0])
        return max(1, -(-epochs * rows // (self.mbs * self.m)))

    def step(self, step: int) -> list[MicroBatch]:
        """The M micro-batches of optimizer step `step` (0-based)."""
        per_step = self.mbs * self.m
        out = []
        for m in range(self.m):
            base = step * per_step + m * self.mbs
            idx = torch.tensor([self._row(base + r) for r in range(self.mbs)])
            ids = self.rows.input_ids[idx]
            mask = self.rows.attention_mask[idx]
            labels = self.rows.labels[idx].clone()
            labels[mask == 0] = IGNORE
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1).contiguous()
            out.append(MicroBatch(ids, mask, pos, labels))
        return out


def check_length(spec: DatasetSpec, max_positions: int | None) -> None:
    """A sequence longer than the model's context is an error, named by its setting."""
    if max_positions is not None and spec.sequenceLength > max_positions:
        raise DataError(
            f"dataset.sequenceLength {spec.sequenceLength} is longer than the model allows "
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
    examples = tokenize(records, tokenizer, spec)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = build_rows(examples, spec, int(pad))
    return StepData(rows, micro_batch_size, micro_batches, seed)
