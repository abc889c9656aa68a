"""The loss history: chunks per commit, merged so that a long job keeps about log2(commits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from relaytrain_worker.state.history import LOSSES, LossHistory, read_history
from relaytrain_worker.state.store import LocalStore

pytestmark = pytest.mark.unit

PREFIX = "default/job"


class CountingStore(LocalStore):
    """A LocalStore that counts the bytes `put` writes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.written = 0

    def put(self, key: str, data: bytes) -> None:
        self.written += len(data)
        super().put(key, data)


def _train(history: LossHistory, steps: range, every: int) -> None:
    """What the last stage does: a record per step, a chunk per commit."""
    for step in steps:
        history.append(step, 2.5, 1234.5)  # fixed widths: only step digits vary
        if step % every == 0:
            history.write(step)


def test_a_long_job_keeps_log2_chunks_and_writes_each_record_log2_times(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    history = LossHistory(store, PREFIX)
    every, commits = 5, 400  # 2,000 steps
    most = 0
    for start in range(1, every * commits + 1, every):
        _train(history, range(start, start + every), every)
        most = max(most, len(list((tmp_path / PREFIX / "loss-history").iterdir())))
    assert most <= 9  # log2(400) + 1
    # Chunks merge as a binary counter carries: 400 commits (0b110010000) leave 3 chunks,
    # never more than log2(commits) + 1 on the way (a chunk per commit left 400).
    names = sorted(p.name for p in (tmp_path / PREFIX / "loss-history").iterdir())
    assert names == ["000000001-000001280.jsonl", "000001281-000001920.jsonl",
                     "000001921-000002000.jsonl"]  # fmt: skip
    records = read_history(store, PREFIX)
    assert [r["step"] for r in records] == list(range(1, every * commits + 1))
    # Each record is rewritten once per merge it takes part in: at most log2(400) + 1 = 9
    # times (O(steps log steps) bytes in all; rewriting one array per step was O(steps²)).
    line_bytes = sum(len(json.dumps(r)) + 1 for r in records)
    assert line_bytes < store.written <= 9 * line_bytes
    # The consolidated array is written once, at the end.
    before = store.written
    assert history.finish() == records
    assert store.written - before == len(json.dumps(records))
    assert json.loads((tmp_path / PREFIX / LOSSES).read_text()) == records


def test_a_rollback_into_a_merged_chunk_keeps_the_steps_before_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    history = LossHistory(store, PREFIX)
    _train(history, range(1, 41), every=5)  # 8 commits: one chunk of steps 1-40
    # The newest commits turned out corrupt: the coordinator goes back to step 25, inside
    # the merged chunk. Steps 1-25 stay; 26-40 go, and a rerun writes them again.
    history.discard_after(25)
    history.resume(25)
    assert [r["step"] for r in read_history(store, PREFIX)] == list(range(1, 26))
    _train(history, range(26, 46), every=5)
    assert [r["step"] for r in read_history(store, PREFIX)] == list(range(1, 46))
    # A merge a crash cut short (the merged chunk written, its parts not yet deleted)
    # leaves parts the next write deletes.
    part = tmp_path / PREFIX / "loss-history" / "000000001-000000005.jsonl"
    part.write_text("".join(json.dumps({"step": s, "loss": 2.5}) + "\n" for s in range(1, 6)))
    _train(history, range(46, 51), every=5)
    assert not part.exists()
    assert [r["step"] for r in read_history(store, PREFIX)] == list(range(1, 51))


def test_a_rollback_drops_records_after_the_commit_and_a_rerun_replaces_them(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path)
    history = LossHistory(store, PREFIX)
    _train(history, range(1, 8), every=3)  # commits 3 and 6; step 7 pending
    assert history.last is not None and history.last["step"] == 7
    # Step 6's commit turned out corrupt: the coordinator goes back to 3.
    history.discard_after(3)
    history.resume(3)
    assert history.pending == [] and history.last is not None and history.last["step"] == 3
    assert [r["step"] for r in read_history(store, PREFIX)] == [1, 2, 3]
    _train(history, range(4, 10), every=3)
    assert [r["step"] for r in read_history(store, PREFIX)] == list(range(1, 10))
    # A fresh process restoring step 6 sees the history up to it.
    fresh = LossHistory(store, PREFIX)
    fresh.resume(6)
    assert fresh.last is not None and fresh.last["step"] == 6
    fresh.resume(None)
    assert fresh.last is None


def test_a_pipeline_taking_the_writing_over_writes_each_step_once(tmp_path: Path) -> None:
    """Pipeline 0's last stage writes up to the commit at 10 and is lost at step 13; pipeline
    1's last stage, which kept every record but trimmed what the writer surely wrote, adopts
    the history and writes from step 11 on; pipeline 0 rejoins at step 18 with pipeline 1's
    records and takes the writing back: every step is in the store exactly once, in order,
    with the held-out losses the writers evaluated."""
    store = LocalStore(tmp_path)
    p0, p1 = LossHistory(store, PREFIX), LossHistory(store, PREFIX)
    for step in range(1, 13):
        for h in (p0, p1):
            h.append(step, float(step), 100.0)
        if step == 5:
            p0.append_eval(5, 0.5)
        if step % 5 == 0:
            p0.write(step)
            p1.forget_through(step - 5)
    assert [r["step"] for r in p1.pending] == list(range(6, 13))
    p1.adopt()  # at step 13 pipeline 1 is the lowest left
    assert [r["step"] for r in p1.pending] == [11, 12]
    assert p1.last_eval is not None and p1.last_eval["evalLoss"] == 0.5
    for step in range(13, 18):
        p1.append(step, float(step), 100.0)
        if step == 15:
            p1.append_eval(15, 0.25)
            p1.write(15)
    rejoined = LossHistory(store, PREFIX)  # pipeline 0's replacement process
    rejoined.take(json.loads(json.dumps(p1.pending)))
    rejoined.adopt()
    for step in range(18, 21):
        rejoined.append(step, float(step), 100.0)
    rejoined.write(20)
    records = read_history(store, PREFIX)
    assert [r["step"] for r in records] == list(range(1, 21))
    assert [r["loss"] for r in records] == [float(s) for s in range(1, 21)]
    assert {r["step"]: r["evalLoss"] for r in records if "evalLoss" in r} == {5: 0.5, 15: 0.25}
    assert rejoined.last_eval is not None and rejoined.last_eval["step"] == 15


def test_a_writer_that_commits_after_the_other_adopted_is_not_written_twice(
    tmp_path: Path,
) -> None:
    """Two pipelines cut apart: pipeline 1 takes the writing over at step 6 (its `adopt`
    reads the store), and pipeline 0, not yet aware, still commits steps 4-6 after that.
    Pipeline 1's next chunk starts after what the store then holds, so the history has
    every step once (the live partition test found 4, 5, 6 twice); and a reader given
    overlapping chunks still lists each step once, from the chunk that starts first."""
    store = LocalStore(tmp_path)
    p0, p1 = LossHistory(store, PREFIX), LossHistory(store, PREFIX)
    for step in range(1, 7):
        for h in (p0, p1):
            h.append(step, float(step), 100.0)
        if step == 3:
            p0.write(3)
            p1.forget_through(0)
    p1.adopt()
    assert [r["step"] for r in p1.pending] == [4, 5, 6]
    p0.write(6)  # committed after pipeline 1 looked
    for step in range(7, 10):
        p1.append(step, float(step), 100.0)
    p1.write(9)
    chunks = sorted(p.name for p in (tmp_path / PREFIX / "loss-history").iterdir())
    # 1-3 and 4-6 merged as a binary counter carries (`_compact`).
    assert chunks == [f"{a:09d}-{b:09d}.jsonl" for a, b in ((1, 6), (7, 9))]
    assert [r["step"] for r in read_history(store, PREFIX)] == list(range(1, 10))
    overlapping = tmp_path / PREFIX / "loss-history" / "000000004-000000009.jsonl"
    overlapping.write_text(
        "".join(json.dumps({"step": s, "loss": -1.0}) + "\n" for s in range(4, 10))
    )
    records = read_history(store, PREFIX)
    assert [r["step"] for r in records] == list(range(1, 10))
    assert [r["loss"] for r in records[3:6]] == [4.0, 5.0, 6.0]  # chunk 4-6 starts first


class StaleListing(LocalStore):
    """A LocalStore whose next listing is one taken earlier (another writer merged since)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stale: list[str] | None = None

    def list(self, prefix: str) -> list[str]:
        if self.stale is not None:
            keys, self.stale = self.stale, None
            return keys
        return super().list(prefix)


def test_a_reader_whose_chunks_another_writer_merged_away_reads_the_merged_one(
    tmp_path: Path,
) -> None:
    # A rejoining last stage that takes the writing over (`adopt`) listed the chunks just
    # before the writer of the moment merged them (the two-pipeline e2e test met this: the
    # stage exited with "loss-history/000000161-000000168.jsonl not found").
    store = StaleListing(tmp_path)
    writer = LossHistory(store, PREFIX)
    _train(writer, range(1, 6), every=5)
    listed = store.list(f"{PREFIX}/loss-history/")
    _train(writer, range(6, 11), every=5)  # 1-5 and 6-10 merged into 1-10
    assert not (tmp_path / PREFIX / "loss-history" / "000000001-000000005.jsonl").exists()
    store.stale = listed
    taker = LossHistory(store, PREFIX)
    taker.adopt()
    assert taker.last is not None and taker.last["step"] == 10
    assert [r["step"] for r in read_history(store, PREFIX)] == list(range(1, 11))
