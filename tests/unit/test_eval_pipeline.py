"""Held-out evaluation: the pipelined pass gives the unsplit model's loss, and a held-out
share of the training file is never trained on."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from relaytrain_contract import DatasetSpec, Progress
from relaytrain_contract.stage import ValidationSpec
from relaytrain_operator.domain.progress import fold
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.tiny_models import CORPUS, tiny_model_dir
from relaytrain_worker.model.methods import apply_lora, lora_config
from relaytrain_worker.model.model_slice import (
    BUILD_LOCK,
    SliceSpec,
    build_stage_model,
    load_config,
)
from relaytrain_worker.pipeline.evaluation import evaluate, load_eval_batches
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.schedule import token_loss_sum
from relaytrain_worker.pipeline.transport import Link, connect, listen
from relaytrain_worker.state.data import MicroBatch, load_step_data
from relaytrain_worker.state.records import DataError, read_jsonl, split_records

pytestmark = pytest.mark.unit

TARGETS = ["q_proj", "v_proj"]
LORA = lora_config(4, 8.0, 0.5, TARGETS)  # dropout 0.5: evaluation must switch it off


def _spec(uri: Path, validation: ValidationSpec | None, *, packing: bool = False) -> DatasetSpec:
    return DatasetSpec(uri=str(uri), format="prompt-completion", textField="text",
                       promptField="prompt", completionField="completion",
                       messagesField="messages", sequenceLength=48, packing=packing,
                       validation=validation)  # fmt: skip


def _write(path: Path, n: int, offset: int = 0) -> Path:
    with path.open("w") as f:
        for i in range(offset, offset + n):
            # Prompts and completions of different lengths: rows hold different label counts.
            record = {
                "prompt": f"q{i}: {CORPUS[i % 5][: 4 + i % 9]}",
                "completion": CORPUS[i % 3][: 6 + i % 7],
            }
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("llama"), layers=4)


def _randomise(trainable: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Non-zero LoRA weights, the same by name everywhere (a fresh adapter's B is zero,
    which would hide the adapter and its dropout)."""
    with torch.no_grad():
        for name, param in trainable:
            gen = torch.Generator().manual_seed(sum(map(ord, name)))
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))


def _unsplit_loss(model_dir: Path, batches: list[MicroBatch]) -> float:
    from transformers import AutoModelForCausalLM

    config = load_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    _randomise(apply_lora(model, LORA, seed=0))
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for mb in batches:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                           position_ids=mb.position_ids, use_cache=False).logits  # fmt: skip
            total += token_loss_sum(logits, mb.labels).double()
            tokens += int((mb.labels[:, 1:] != -100).sum())
    return float(total / tokens)


def _pipelined(model_dir: Path, batches: list[MicroBatch], splits: list[tuple[int, int]],
               passes: int = 2) -> tuple[list[float], list[bool]]:  # fmt: skip
    """Every pass's loss on the last stage, and whether each stage was back in training
    mode afterwards."""
    creds = stage_credentials(len(splits))
    listeners = [None] + [
        listen("127.0.0.1:0", credentials=creds[k], expect=creds[k - 1].identity)
        for k in range(1, len(splits))
    ]
    losses: list[float] = []
    modes: list[bool] = [False] * len(splits)
    errors: list[BaseException] = []

    def stage_main(k: int) -> None:
        prev: Link | None = None
        nxt: Link | None = None
        try:
            count = len(splits)
            spec = SliceSpec(splits[k][0], splits[k][1], k == 0, k == count - 1)
            stage = build_stage_model(model_dir, spec)
            with BUILD_LOCK:
                _randomise(apply_lora(stage.model, LORA, seed=0))
            if k + 1 < count:
                address = f"127.0.0.1:{listeners[k + 1].address[1]}"  # type: ignore[union-attr]
                nxt = connect(address, credentials=creds[k], expect=creds[k + 1].identity)
            listener = listeners[k]
            if listener is not None:
                prev = listener.accept(timeout=60)
            peers = Peers(prev, nxt)
            for step in range(passes):
                loss = evaluate(stage, peers, step, batches if k == 0 else None,
                                first=k == 0, last=k == count - 1)  # fmt: skip
                if loss is not None:
                    losses.append(loss)
            modes[k] = all(m.training for m in stage.modules())
            if peers.next is not None:
                peers.next.flush()
        except BaseException as exc:
            errors.append(exc)
            for link in (prev, nxt):
                if link is not None:
                    link.close()

    threads = [threading.Thread(target=stage_main, args=(k,)) for k in range(len(splits))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for lst in listeners:
        if lst is not None:
            lst.close()
    if errors:
        raise errors[0]
    return losses, modes


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_pipelined_held_out_loss_is_the_unsplit_models(
    model_dir: Path, tmp_path: Path, packing: bool
) -> None:
    from transformers import AutoTokenizer

    held = _write(tmp_path / "held.jsonl", 7)
    spec = _spec(_write(tmp_path / "train.jsonl", 4), ValidationSpec(uri=str(held)),
                 packing=packing)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    batches = load_eval_batches(spec, tokenizer, max_positions=128, micro_batch_size=2, seed=0)
    # The reference: the unsplit model on one example per row (packed rows give the same
    # per-example losses, as no token attends across examples). Uneven micro-batches (the
    # last one short), so a mean of per-batch means would differ from the token-weighted
    # mean over the whole set.
    padded = spec.model_copy(update={"packing": False})
    one_each = load_eval_batches(padded, tokenizer, max_positions=128, micro_batch_size=2, seed=0)
    assert len(one_each) == 4 and one_each[-1].input_ids.shape[0] == 1
    if packing:
        assert len(batches) < len(one_each)
    want = _unsplit_loss(model_dir, one_each)
    losses, modes = _pipelined(model_dir, batches, [(0, 2), (2, 4)])
    assert losses[0] == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert losses[1] == losses[0]  # no dropout, nothing moved: the same bits twice
    assert modes == [True, True]  # training goes on with dropout where it was


def test_a_held_out_share_is_never_trained_on_and_the_same_every_run(tmp_path: Path) -> None:
    records = read_jsonl(str(_write(tmp_path / "all.jsonl", 40)))
    train, held = split_records(records, 0.25, seed=7)
    assert len(held) == 10 and len(train) == 30
    assert {r.line for r in train}.isdisjoint({r.line for r in held})
    assert sorted(r.line for r in train + held) == list(range(1, 41))
    again_train, again = split_records(records, 0.25, seed=7)
    assert [r.line for r in again] == [r.line for r in held]
    assert [r.line for r in again_train] == [r.line for r in train]
    assert [r.line for r in split_records(records, 0.25, seed=8)[1]] != [r.line for r in held]
    # Even a tiny fraction holds one record out; one that leaves nothing to train is refused.
    assert len(split_records(records, 0.001, seed=7)[1]) == 1
    with pytest.raises(DataError, match=r"dataset.validation.fraction 0.99 of 40 records"):
        split_records(records, 0.99, seed=7)


def test_the_training_rows_leave_out_the_held_out_records(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    path = tmp_path / "all.jsonl"
    with path.open("w") as f:  # every record a different single-token completion
        for i in range(20):
            f.write(json.dumps({"prompt": "x", "completion": chr(ord("a") + i)}) + "\n")
    spec = _spec(path, ValidationSpec(fraction=0.2))
    data = load_step_data(spec, tokenizer, max_positions=128, micro_batch_size=1,
                          micro_batches=1, seed=5)  # fmt: skip
    held = load_eval_batches(spec, tokenizer, max_positions=128, micro_batch_size=1, seed=5)

    def completions(ids: torch.Tensor) -> set[str]:
        return {tokenizer.decode(row).split("x", 1)[1][:1] for row in ids}

    trained = completions(data.rows.input_ids)
    evaluated = completions(torch.cat([b.input_ids for b in held]))
    assert len(trained) == 16 and len(evaluated) == 4
    assert trained.isdisjoint(evaluated)
    assert data.report.examples == 16


def test_a_missing_validation_file_is_named(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    spec = _spec(_write(tmp_path / "train.jsonl", 4), ValidationSpec(uri="/nope/held.jsonl"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with pytest.raises(DataError, match=r"^dataset.validation.uri '/nope/held.jsonl': no such"):
        load_eval_batches(spec, tokenizer, max_positions=128, micro_batch_size=2, seed=0)


def test_the_job_status_shows_the_held_out_loss() -> None:
    manifest = (
        Job("j")
        .model("s3://models/m/")
        .dataset("s3://data/t.jsonl")
        .validation(fraction=0.1)
        .training(steps=10, eval_every_steps=5)
        .checkpoint("s3://ckpt/c")
    )
    job = parse_job(manifest.build())
    record = Progress(step=6, totalSteps=10, loss=1.5, tokensPerSecond=10.0,
                      evalLoss=1.2345678, evalStep=5)  # fmt: skip
    status = fold(record, job, datetime.now(UTC)).status
    assert (status["evalLoss"], status["evalStep"]) == (1.234568, 5)
    written: dict[str, Any] = json.loads(record.to_json())
    assert (written["evalLoss"], written["evalStep"]) == (1.2345678, 5)
    none = Progress(step=1, totalSteps=10, tokensPerSecond=1.0)
    assert "evalLoss" not in json.loads(none.to_json())
    assert "evalLoss" not in fold(none, job, datetime.now(UTC)).status


def test_the_loss_history_keeps_the_held_out_losses_across_a_restart(tmp_path: Path) -> None:
    from relaytrain_worker.state.history import LossHistory
    from relaytrain_worker.state.store import LocalStore

    store = LocalStore(tmp_path)
    history = LossHistory(store, "default/job")
    history.append_eval(0, 3.0)  # the base model, before step 1
    history.append(1, 2.9, 10.0)
    history.append(2, 2.5, 10.0)
    history.append_eval(2, 2.7)
    history.write(2)
    history.append(3, 2.2, 10.0)
    history.append_eval(3, 2.6)  # never committed: a rollback to step 2 forgets it
    again = LossHistory(store, "default/job")
    again.resume(2)
    assert again.last_eval == {"step": 2, "loss": 2.5, "tokensPerSecond": 10.0, "evalLoss": 2.7}
    records = again.finish()
    assert [(r["step"], r.get("evalLoss")) for r in records] == [(0, 3.0), (1, None), (2, 2.7)]
    assert records[0]["loss"] is None
