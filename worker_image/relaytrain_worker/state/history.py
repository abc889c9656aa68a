"""The loss history of a job: one record per optimizer step, each written once.

Layout under ``<job_prefix>`` in a Store::

    loss-history/<first>-<last>.jsonl   the records of steps first..last, one JSON object a
                                        line, written by the last stage when step <last> is
                                        committed (just before its manifest)
    loss-history.json                   every record as one JSON array, written once, when
                                        the job has finished (what `relaytrain run --local`
                                        plots and the tests read)

A record is ``{"step": N, "loss": L, "tokensPerSecond": R}``, plus ``"evalLoss": E`` when the
held-out loss was evaluated after step N (`append_eval`; step 0's record, the base model's
held-out loss, has loss null and tokensPerSecond 0). Records of steps after the
newest commit stay in memory until the next commit: a rollback drops them, and a rerun of
the same steps writes the same chunk names again (commits fall on the same steps).

Chunks are merged as a binary counter adds (`_compact`): after a write, while the
second-newest chunk spans no more steps than the newest, the two become one. So a job of C
commits keeps about log2(C) chunks (a month of commits every 10 steps at a step a second:
about 18, not 260,000), and each record is rewritten about log2(C) times: O(steps log
steps) bytes in all, where rewriting one JSON array after every step wrote O(steps²). A
merge writes the merged chunk before it deletes the two, and a chunk that another holds
whole (a merge a crash cut short, two writers around a change of writer) is deleted.

With several pipelines every pipeline's last stage keeps the records (each has the whole
step's loss), and the writer of the moment — the lowest pipeline training — writes them.
A last stage that becomes the writer (`adopt`) drops what the store already holds and
writes the rest with its next commit (looking at the store again then: the writer before
may have committed one more chunk meanwhile, as two pipelines cut apart do); one that is
not trims what the writer has surely written (`forget_through`); a rejoining last stage
takes the records of the peer whose state it takes (`take`), so whoever writes next has the
steps it was out for. A reader lists each step once even where chunks overlap.

`read_history` is the one reader of the chunks.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relaytrain_worker.state.store import ObjectNotFound, Store

HISTORY_DIR = "loss-history"
LOSSES = "loss-history.json"
_CHUNK = re.compile(r"^(\d+)-(\d+)\.jsonl$")
READ_TRIES = 5
"""Listings a reader makes while merges keep replacing the chunks it listed."""

Record = dict[str, Any]


def _key(job_prefix: str, name: str) -> str:
    prefix = job_prefix.strip("/")
    return f"{prefix}/{name}" if prefix else name


def _chunk_key(job_prefix: str, first: int, last: int) -> str:
    return _key(job_prefix, f"{HISTORY_DIR}/{first:09d}-{last:09d}.jsonl")


def _span(chunk: tuple[int, int, str]) -> int:
    return chunk[1] - chunk[0] + 1


def _chunks(store: Store, job_prefix: str) -> list[tuple[int, int, str]]:
    """(first step, last step, key) of every chunk, in step order."""
    base = _key(job_prefix, HISTORY_DIR) + "/"
    found = []
    for key in store.list(base):
        match = _CHUNK.match(key[len(base) :])
        if match:
            found.append((int(match.group(1)), int(match.group(2)), key))
    return sorted(found)


def read_history(store: Store, job_prefix: str, upto: int | None = None) -> list[Record]:
    """Every committed record (of steps up to `upto`, when given), in step order, each
    step once: where two chunks overlap (two writers around a change of writer), the
    chunk that starts first has it. A chunk that another writer's merge deleted between
    the listing and the read (its records are in the merged chunk, written first) makes
    the reader list again."""
    for _ in range(READ_TRIES - 1):
        try:
            return _read_history(store, job_prefix, upto)
        except ObjectNotFound:
            continue
    return _read_history(store, job_prefix, upto)


def _read_history(store: Store, job_prefix: str, upto: int | None) -> list[Record]:
    records: dict[int, Record] = {}
    for first, _, key in _chunks(store, job_prefix):
        if upto is not None and first > upto:
            break
        for line in store.get(key).decode().splitlines():
            if line.strip():
                record = json.loads(line)
                step = int(record["step"])
                if upto is None or step <= upto:
                    records.setdefault(step, record)
    return [records[step] for step in sorted(records)]


class LossHistory:
    """The last stage's loss records: appended per step, written per commit."""

    def __init__(self, store: Store, job_prefix: str) -> None:
        self.store = store
        self.prefix = job_prefix
        self.pending: list[Record] = []
        """Records of steps after the newest commit (not written yet)."""
        self.last: Record | None = None
        """The newest record (pending or written)."""
        self.last_eval: Record | None = None
        """The newest record with an `evalLoss` (pending or written)."""
        self._adopted = False
        """Became the writer since the last write: look at the store again before writing
        (the writer before may have committed a chunk after `adopt` read it)."""

    def resume(self, step: int | None) -> None:
        """Continue after committed `step` (None: from the start): the written records up
        to it are the history; anything later is forgotten."""
        self.pending = []
        if step is None:
            self.last = self.last_eval = None
            return
        records = read_history(self.store, self.prefix, upto=step)
        self.last = records[-1] if records else None
        self.last_eval = next((r for r in reversed(records) if "evalLoss" in r), None)

    def append(self, step: int, loss: float, tokens_per_second: float) -> None:
        record = {"step": step, "loss": loss, "tokensPerSecond": tokens_per_second}
        self.pending.append(record)
        self.last = record

    def append_eval(self, step: int, eval_loss: float) -> None:
        """The held-out loss after `step`: on that step's pending record, or (step 0, before
        any training) a record of its own."""
        record = self.last if self.last is not None and self.last["step"] == step else None
        if record is None or not any(r is record for r in self.pending):
            record = {"step": step, "loss": None, "tokensPerSecond": 0.0}
            self.pending.append(record)
            self.last = record
        record["evalLoss"] = eval_loss
        self.last_eval = record

    def write(self, step: int) -> None:
        """Write the records up to `step` (about to be committed) as one chunk."""
        if self._adopted:
            self._adopted = False
            stored = [last for _, last, _ in _chunks(self.store, self.prefix)]
            if stored:
                self.pending = [r for r in self.pending if r["step"] > max(stored)]
        due = [r for r in self.pending if r["step"] <= step]
        if not due:
            return
        first = due[0]["step"]
        lines = "".join(json.dumps(r) + "\n" for r in due)
        self.store.put(_chunk_key(self.prefix, first, step), lines.encode())
        self.pending = [r for r in self.pending if r["step"] > step]
        self._compact()

    def _compact(self) -> None:
        """Merge the newest chunks as a binary counter carries (see the module's doc)."""
        chunks = _chunks(self.store, self.prefix)
        kept = []
        for first, last, key in chunks:
            if any(a <= first and last <= b and (a, b) != (first, last) for a, b, _ in chunks):
                self.store.delete(key)  # another chunk holds all of it
            else:
                kept.append((first, last, key))
        while len(kept) >= 2 and _span(kept[-2]) <= _span(kept[-1]):
            (first, _, older), (_, last, newer) = kept[-2], kept[-1]
            try:
                data = self.store.get(older) + self.store.get(newer)
            except ObjectNotFound:
                return  # another writer is merging them (two writers around a change)
            merged = _chunk_key(self.prefix, first, last)
            self.store.put(merged, data)
            for key in (older, newer):
                if key != merged:
                    self.store.delete(key)
            kept[-2:] = [(first, last, merged)]

    def forget_through(self, step: int) -> None:
        """Drop the pending records up to `step` (a last stage that is not the writer, at a
        commit boundary: the writer has written them)."""
        self.pending = [r for r in self.pending if r["step"] > step]

    def take(self, records: list[Record]) -> None:
        """Hold `records` (a live peer's pending records) as this stage's own: a last stage
        rejoining takes the steps it was out for from the peer whose state it takes."""
        self.pending = [dict(r) for r in records]
        if self.pending:
            self.last = self.pending[-1]
        newest_eval = next((r for r in reversed(self.pending) if "evalLoss" in r), None)
        self.last_eval = newest_eval or self.last_eval

    def adopt(self) -> None:
        """This last stage becomes the writer (the pipelines below its own are out): the
        pending records the store already holds go, the rest are written with the next
        commit, and the newest held-out loss is the store's when none is pending."""
        stored = read_history(self.store, self.prefix)
        written = int(stored[-1]["step"]) if stored else -1
        self.pending = [r for r in self.pending if r["step"] > written]
        self._adopted = True
        held = [r for r in (*stored, *self.pending) if "evalLoss" in r]
        self.last_eval = held[-1] if held else None
        if self.last is None and stored:
            self.last = stored[-1]

    def discard_after(self, step: int | None) -> None:
        """Delete the records of steps after `step` (None: all), with the checkpoints the
        coordinator discards, so a rerun cannot meet stale records. A merged chunk that
        holds steps on both sides keeps those up to `step`, under its new span."""
        for first, last, key in _chunks(self.store, self.prefix):
            if step is not None and last <= step:
                continue
            if step is not None and first <= step:
                try:
                    data = self.store.get(key)
                except ObjectNotFound:
                    continue  # merged away meanwhile: the merged chunk holds its records
                lines = [
                    line
                    for line in data.decode().splitlines()
                    if line.strip() and int(json.loads(line)["step"]) <= step
                ]
                self.store.put(
                    _chunk_key(self.prefix, first, step),
                    "".join(line + "\n" for line in lines).encode(),
                )
            self.store.delete(key)

    def finish(self) -> list[Record]:
        """Write ``loss-history.json``, every record in one array, once; returns them."""
        records = read_history(self.store, self.prefix)
        self.store.put(_key(self.prefix, LOSSES), json.dumps(records).encode())
        return records
