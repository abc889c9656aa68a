"""Examples longer than sequenceLength: truncated or dropped as the spec says, counted, and
the counts in progress.json, where the operator reads them; and where training stands in
the data (epoch, examplesSeen, tokensSeen, tokensTrained): a pure function of the step,
equal to counting the rows every step trained."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from relaytrain_contract import ConfigError, DatasetSpec, Progress
from relaytrain_testkit.tiny_models import save_tokenizer
from relaytrain_worker.pipeline.stage import StageRuntime
from relaytrain_worker.state.data import (
    DataReport,
    Rows,
    StepData,
    load_step_data,
    row_counts,
    write_report,
)
from relaytrain_worker.state.metrics import StageMetrics
from relaytrain_worker.state.progress import read_progress
from relaytrain_worker.state.records import IGNORE, DataError
from relaytrain_worker.state.store import LocalStore
from transformers import AutoTokenizer

pytestmark = pytest.mark.unit

SHORT = "low rank adapters"
LONG = "the quick brown fox jumps over the lazy dog " * 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def _load(tmp_path: Path, tokenizer: Any, texts: list[str], **spec: Any) -> Any:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    fields = {"uri": str(path), "format": "text", "textField": "text", "promptField": "p",
              "completionField": "c", "messagesField": "m", "sequenceLength": 12,
              "packing": False, **spec}  # fmt: skip
    return load_step_data(DatasetSpec(**fields), tokenizer, max_positions=128,
                          micro_batch_size=1, micro_batches=1, seed=0)  # fmt: skip


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def test_truncation_is_the_default_and_is_counted(tmp_path: Path, tokenizer: Any) -> None:
    assert len(_tokens(tokenizer, LONG)) > 12 >= len(_tokens(tokenizer, SHORT))
    data = _load(tmp_path, tokenizer, [SHORT, LONG, SHORT, LONG, LONG])
    report = data.report
    assert (report.examples, report.truncated, report.dropped, report.rows) == (5, 3, 0, 5)
    # One example a row (no packing), its tokens, and those with a loss (all but the first).
    lengths = [len(_tokens(tokenizer, t)[:12]) for t in [SHORT, LONG, SHORT, LONG, LONG]]
    assert report.row_counts == tuple((1, n, n - 1) for n in lengths)
    rows = data.rows.input_ids.tolist()
    assert rows.count(_tokens(tokenizer, LONG)[:12]) == 3  # cut to the first 12 tokens


@pytest.mark.parametrize("packing", [False, True])
def test_drop_leaves_long_examples_out_and_counts_them(
    tmp_path: Path, tokenizer: Any, packing: bool
) -> None:
    data = _load(tmp_path, tokenizer, [SHORT, LONG, SHORT, LONG, LONG], truncation="drop",
                 packing=packing)  # fmt: skip
    assert (data.report.examples, data.report.truncated, data.report.dropped) == (5, 0, 3)
    short = _tokens(tokenizer, SHORT)
    kept = data.rows.input_ids[data.rows.attention_mask == 1].tolist()
    assert kept == short * 2  # the two short examples, nothing of the long ones


def test_dropping_every_example_is_an_error(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(DataError, match=r"all 2 examples .* longer than dataset.sequenceLength 12"):
        _load(tmp_path, tokenizer, [LONG, LONG], truncation="drop")


def test_an_unknown_truncation_is_refused() -> None:
    with pytest.raises(ValueError, match="truncation"):
        DatasetSpec(uri="x", format="text", textField="t", promptField="p", completionField="c",
                    messagesField="m", sequenceLength=8, packing=False, truncation="cut")  # type: ignore[arg-type]  # fmt: skip


def test_progress_carries_the_counts_only_when_known() -> None:
    bare = json.loads(Progress(step=1, totalSteps=2, tokensPerSecond=1.0).to_json())
    assert not {"examples", "examplesTruncated", "examplesDropped"} & set(bare)
    full = Progress(step=1, totalSteps=2, tokensPerSecond=1.0, examples=10,
                    examplesTruncated=2, examplesDropped=0)  # fmt: skip
    again = Progress.from_json(full.to_json())
    assert (again.examples, again.examples_truncated, again.examples_dropped) == (10, 2, 0)
    with pytest.raises(ConfigError, match="examplesDropped"):
        Progress.from_json({**json.loads(full.to_json()), "examplesDropped": 11})


def test_the_last_stage_reports_what_stage_zero_counted(tmp_path: Path) -> None:
    """Stage 0 leaves its counts in the store; the last stage puts them in progress.json."""
    store = LocalStore(tmp_path)
    runtime = SimpleNamespace(
        history=SimpleNamespace(last={"loss": 2.5, "tokensPerSecond": 10.0}, last_eval=None),
        data_report=None, store=store, prefix="ns/job", step=1, total_steps=4,
        last_committed=None, step_seconds=0.5, metrics=StageMetrics("job", 1),
        replication=SimpleNamespace(unsure_writer=False),
        cfg=SimpleNamespace(output=SimpleNamespace(uri="out"),
                            training=SimpleNamespace(micro_batch_size=1, micro_batches=2, seed=3)),
    )  # fmt: skip
    StageRuntime._publish(runtime)  # type: ignore[arg-type]
    before = read_progress(store, "ns/job")
    assert before is not None and before.examples is None  # stage 0 has not reported yet
    counts = ((1, 5, 4), (2, 8, 6)) * 4
    report = DataReport(examples=9, truncated=4, dropped=1, rows=8, row_counts=counts)
    write_report(store, "ns/job", report)
    StageRuntime._publish(runtime)  # type: ignore[arg-type]
    after = read_progress(store, "ns/job")
    assert after is not None
    assert (after.examples, after.examples_truncated, after.examples_dropped) == (9, 4, 1)
    seen = report.seen(1, 2, 3)  # step 1 of 2 rows, seed 3
    assert seen is not None and after.epoch == 2 / 8
    exported = runtime.metrics.exposition().decode()
    assert 'relaytrain_epoch{job="job",stage="1"} 0.25' in exported
    assert f'relaytrain_tokens_trained{{job="job",stage="1"}} {float(seen.trained)}' in exported
    assert (after.examples_seen, after.tokens_seen, after.tokens_trained) == (
        seen.examples,
        seen.tokens,
        seen.trained,
    )


def _rows(n: int, length: int = 8) -> Rows:
    """`n` packed rows of one to three examples each, some padding, prompts unlearned."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(5, 100, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    pos = torch.zeros(n, length, dtype=torch.long)
    labels = ids.clone()
    for r in range(n):
        cuts = sorted(torch.randperm(length - 2, generator=gen)[: r % 3].add(1).tolist())
        starts = [0, *cuts]
        for a, b in zip(starts, [*cuts, length], strict=True):
            pos[r, a:b] = torch.arange(b - a)
            labels[r, a] = IGNORE  # an example's first token is never a target
            labels[r, a + 1 : a + 1 + (r % 2)] = IGNORE  # a prompt token
        pad = r % 4
        if pad:
            mask[r, -pad:] = 0
            labels[r, -pad:] = IGNORE
    return Rows(ids, labels, mask, pos)


@pytest.mark.parametrize(("n", "mbs", "m"), [(7, 1, 2), (10, 2, 3), (4, 3, 2)])
def test_the_counts_are_those_of_the_rows_the_steps_trained(n: int, mbs: int, m: int) -> None:
    rows = _rows(n)
    report = DataReport(n, 0, 0, n, row_counts(rows))
    data = StepData(rows, mbs, m, seed=5, report=report)
    examples = tokens = trained = 0
    for step in range(1, 4 * n):  # several passes, most ending inside a step
        for mb in data.step(step - 1):
            real = mb.attention_mask.bool()
            examples += int(((mb.position_ids == 0) & real).sum())
            tokens += int(real.sum())
            trained += int(((mb.labels != IGNORE) & real).sum())
        seen = report.seen(step, mbs * m, seed=5)
        assert seen is not None
        assert (seen.examples, seen.tokens, seen.trained) == (examples, tokens, trained), step
        assert seen.epoch == step * mbs * m / n
    # It survives the trip through data-report.json, and an older stage 0's report (no
    # per-row counts) reports nothing rather than something wrong.
    assert DataReport.from_json(report.to_json()).seen(3, mbs * m, 5) == report.seen(3, mbs * m, 5)
    assert DataReport(n, 0, 0, n).seen(3, mbs * m, 5) is None


def test_progress_records_where_training_stands_only_when_known() -> None:
    base = {"step": 4, "totalSteps": 10, "tokensPerSecond": 1.0}
    bare = Progress.from_json(base).to_json().decode()
    assert "epoch" not in bare and "tokensSeen" not in bare
    seen = {"epoch": 1.5, "examplesSeen": 30, "tokensSeen": 400, "tokensTrained": 120}
    record = Progress.from_json({**base, **seen})
    assert (record.epoch, record.examples_seen, record.tokens_seen, record.tokens_trained) == (
        1.5,
        30,
        400,
        120,
    )
    assert Progress.from_json(record.to_json()) == record
