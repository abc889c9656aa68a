"""Examples longer than sequenceLength: truncated or dropped as the spec says, counted, and
the counts in progress.json, where the operator reads them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from relaytrain_contract import ConfigError, DatasetSpec, Progress
from relaytrain_testkit.tiny_models import save_tokenizer
from relaytrain_worker.pipeline.stage import StageRuntime
from relaytrain_worker.state.data import DataReport, load_step_data, write_report
from relaytrain_worker.state.progress import read_progress
from relaytrain_worker.state.records import DataError
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
    assert data.report == DataReport(examples=5, truncated=3, dropped=0, rows=5)
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
        last_committed=None, step_seconds=0.5,
        cfg=SimpleNamespace(output=SimpleNamespace(uri="out")),
    )  # fmt: skip
    StageRuntime._publish(runtime)  # type: ignore[arg-type]
    before = read_progress(store, "ns/job")
    assert before is not None and before.examples is None  # stage 0 has not reported yet
    write_report(store, "ns/job", DataReport(examples=9, truncated=4, dropped=1, rows=8))
    StageRuntime._publish(runtime)  # type: ignore[arg-type]
    after = read_progress(store, "ns/job")
    assert after is not None
    assert (after.examples, after.examples_truncated, after.examples_dropped) == (9, 4, 1)
