"""Stage 0's data: formats, loss masks, packing, errors that name the field, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from relaytrain_contract import DatasetSpec
from relaytrain_testkit.tiny_models import save_tokenizer
from relaytrain_worker.state.data import load_step_data
from relaytrain_worker.state.records import IGNORE, DataError
from transformers import AutoTokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def _spec(path: Path, fmt: str = "prompt-completion", length: int = 24, packing: bool = False,
          **fields: str) -> DatasetSpec:  # fmt: skip
    names = {"textField": "text", "promptField": "prompt", "completionField": "completion",
             "messagesField": "messages"}  # fmt: skip
    names.update(fields)
    return DatasetSpec(uri=str(path), format=fmt, sequenceLength=length, packing=packing, **names)  # type: ignore[arg-type]


def _write(tmp_path: Path, records: list[dict[str, object]]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(spec: DatasetSpec, tok: object, mbs: int = 2, m: int = 2, max_pos: int = 128) -> object:
    return load_step_data(
        spec, tok, max_positions=max_pos, micro_batch_size=mbs, micro_batches=m, seed=7
    )


def test_prompt_tokens_are_masked_from_the_loss(tmp_path: Path, tokenizer: object) -> None:
    path = _write(tmp_path, [{"prompt": "the quick brown", "completion": "fox jumps"}] * 4)
    data = _load(_spec(path), tokenizer)
    mb = data.step(0)[0]  # type: ignore[attr-defined]
    n_prompt = len(tokenizer("the quick brown", add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    n_completion = len(tokenizer("fox jumps", add_special_tokens=False)["input_ids"]) + 1  # type: ignore[operator]
    row = mb.labels[0]
    assert (row[:n_prompt] == IGNORE).all()
    assert (
        row[n_prompt : n_prompt + n_completion]
        == mb.input_ids[0, n_prompt : n_prompt + n_completion]
    ).all()
    # Padding is masked from attention and loss.
    assert (mb.attention_mask[0, n_prompt + n_completion :] == 0).all()
    assert (row[n_prompt + n_completion :] == IGNORE).all()


def test_chat_learns_only_the_assistant_turns(tmp_path: Path, tokenizer: object) -> None:
    messages = [{"role": "user", "content": "a stage"}, {"role": "assistant", "content": "a slice"}]
    path = _write(tmp_path, [{"messages": messages}] * 4)
    data = _load(_spec(path, fmt="chat", length=40), tokenizer)
    mb = data.step(0)[0]  # type: ignore[attr-defined]
    learned = mb.input_ids[0][mb.labels[0] != IGNORE]
    text = tokenizer.decode(learned)  # type: ignore[attr-defined]
    assert "a slice" in text and "a stage" not in text and "user" not in text


def test_packing_fills_every_row(tmp_path: Path, tokenizer: object) -> None:
    path = _write(tmp_path, [{"text": "low rank adapters train few parameters"}] * 20)
    data = _load(_spec(path, fmt="text", length=16, packing=True), tokenizer)
    for mb in data.step(0):  # type: ignore[attr-defined]
        assert mb.input_ids.shape == (2, 16)
        assert bool(mb.attention_mask.all())


def test_step_data_is_a_function_of_seed_and_step(tmp_path: Path, tokenizer: object) -> None:
    path = _write(tmp_path, [{"text": f"record {i} of the lazy dog"} for i in range(10)])
    a = _load(_spec(path, fmt="text"), tokenizer)
    b = _load(_spec(path, fmt="text"), tokenizer)
    for step in (0, 3, 7):  # epochs wrap after 10 rows
        for x, y in zip(a.step(step), b.step(step), strict=True):  # type: ignore[attr-defined]
            assert torch.equal(x.input_ids, y.input_ids)
    assert a.steps_for_epochs(2) == 5  # type: ignore[attr-defined]


def test_a_field_that_does_not_exist_is_named(tmp_path: Path, tokenizer: object) -> None:
    path = _write(tmp_path, [{"question": "q", "answer": "a"}])
    with pytest.raises(
        DataError,
        match=r"dataset.promptField: field 'prompt' does not exist in record 1.*answer, question",
    ):
        _load(_spec(path), tokenizer)


def test_a_sequence_longer_than_the_model_allows_is_refused(
    tmp_path: Path, tokenizer: object
) -> None:
    path = _write(tmp_path, [{"prompt": "p", "completion": "c"}])
    with pytest.raises(
        DataError,
        match=r"dataset.sequenceLength 4096 is longer than the model allows "
        r"\(max_position_embeddings 128\)",
    ):
        _load(_spec(path, length=4096), tokenizer)


def test_a_missing_file_is_named(tmp_path: Path, tokenizer: object) -> None:
    with pytest.raises(DataError, match="no such file"):
        _load(_spec(tmp_path / "nope.jsonl"), tokenizer)


def test_an_object_the_store_has_not_and_bytes_that_are_not_text_are_bad_input(
    tmp_path: Path,
) -> None:
    # The store answers "no such key" (an answer a restart would get again), not an outage.
    from relaytrain_worker.state.records import read_jsonl
    from relaytrain_worker.state.store import LocalStore

    store = LocalStore(tmp_path)
    store.put("latin1.jsonl", '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"^dataset.uri 's3://b/data/gone.jsonl': no such object$"):
        read_jsonl("s3://b/data/gone.jsonl", lambda prefix: store)  # a store at the prefix
    with pytest.raises(DataError, match=r"^dataset.uri 's3://b/data/latin1.jsonl': not UTF-8 text"):
        read_jsonl("s3://b/data/latin1.jsonl", lambda prefix: store)
