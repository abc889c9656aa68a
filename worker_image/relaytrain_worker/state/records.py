"""A dataset's records: JSONL read from a local path, file:// or s3://, some held out for
evaluation, and what can go wrong with them (`DataError`, naming the field, line and file).

`data.py` tokenizes the records into the rows and micro-batches of each step; `chat.py`
renders chat records. Both take their records, labels and errors from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

IGNORE = -100
"""The label of a token no loss is taken on (prompt, padding, non-assistant turns)."""


class DataError(ValueError):
    """The dataset cannot be used as configured; the message names the field or value."""


@dataclass(frozen=True)
class Record:
    """One JSON object of the dataset and where it is."""

    line: int
    """1-based line of the file."""
    fields: dict[str, Any]
    """The object."""


@dataclass(frozen=True)
class Example:
    """A tokenized record."""

    ids: list[int]
    labels: list[int]
    """-100 where no loss is taken."""
    line: int
    """The record's line in the file."""


def read_jsonl(uri: str, opener: Any = None) -> list[Record]:
    """Records of a JSONL file at a local path, file:// or s3:// (via `opener(prefix)`)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if opener is None:
            raise DataError(f"dataset.uri {uri!r}: s3:// needs the checkpoint endpoint")
        prefix, _, name = uri.rpartition("/")
        try:
            raw = opener(prefix).get(name)
        except KeyError:  # the store's ObjectNotFound: an answer, not an outage to retry
            raise DataError(f"dataset.uri {uri!r}: no such object") from None
    else:
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.is_file():
            raise DataError(f"dataset.uri {uri!r}: no such file")
        raw = path.read_bytes()
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise DataError(f"dataset.uri {uri!r}: not UTF-8 text ({exc})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"dataset.uri {uri!r}: line {number} is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise DataError(f"dataset.uri {uri!r}: line {number} is not a JSON object")
        records.append(Record(number, record))
    if not records:
        raise DataError(f"dataset.uri {uri!r}: no records")
    return records


def split_records(
    records: list[Record], fraction: float, seed: int
) -> tuple[list[Record], list[Record]]:
    """(training, held-out) records for `dataset.validation.fraction`: round(N * fraction)
    records, at least one, chosen by a permutation seeded from `seed` (the same every run
    and on every stage); each record goes to exactly one side, both in file order."""
    n = len(records)
    held = max(1, round(n * fraction))
    if held >= n:
        raise DataError(
            f"dataset.validation.fraction {fraction} of {n} records holds out {held}, "
            "leaving none to train on"
        )
    gen = torch.Generator().manual_seed(seed * 104729 + 1)
    out = set(torch.randperm(n, generator=gen)[:held].tolist())
    train = [r for i, r in enumerate(records) if i not in out]
    return train, [r for i, r in enumerate(records) if i in out]
