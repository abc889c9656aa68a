"""Packing without leaks: a packed row computes what its documents compute one by one.

Documents are packed by the worker's own data code (`data.build_rows`: positions restart at
each document, its first token is no target, padding at the row's end), run through the
slices of a 2-stage split — stage 1 gets only what crosses the link (hidden states,
attention mask, position ids, labels) — and each document's summed token loss and the
gradients of every decoder weight must be those of the unsplit model run on the document
alone. For every supported family: sliding windows (Mistral, Mixtral, Phi-3, Qwen2, Gemma 2
and 3, GPT-OSS, Qwen3-MoE) must stay inside a document too.

Then a real 2-stage pipeline over links trains packed steps with LoRA and must give the
step losses and LoRA gradients of the unsplit model trained on the same documents as
micro-batches of one.

Plain causal packing (the slices ignore where positions restart) must fail both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from relaytrain_contract import DatasetSpec
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES
from relaytrain_testkit.inputs import CLIPPED_TRAINING
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import run_pipeline_threads
from relaytrain_testkit.references import run_reference
from relaytrain_testkit.tiny_families import tiny_family_dir
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.model import families
from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model, load_config
from relaytrain_worker.pipeline.schedule import count_items
from relaytrain_worker.state.data import MicroBatch, build_rows
from relaytrain_worker.state.records import IGNORE, Example
from torch.nn import functional

pytestmark = pytest.mark.unit

ROW = 24
#: Three rows: documents longer than every family's sliding window (4 to 6 here), a row
#: with padding at its end, and one document alone.
LENGTHS = [9, 8, 6, 11, 7, 5, 13]


def _documents(vocab: int, lengths: list[int], seed: int = 5) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for line, n in enumerate(lengths, start=1):
        ids = torch.randint(1, vocab - 1, (n,), generator=gen).tolist()
        docs.append(Example(ids, list(ids), line))
    return docs


def _spec(length: int = ROW) -> DatasetSpec:
    return DatasetSpec(uri="docs.jsonl", format="text", textField="text", promptField="p",
                       completionField="c", messagesField="m", sequenceLength=length,
                       packing=True)  # fmt: skip


def _packed(docs: list[Example], pad: int) -> tuple[MicroBatch, list[list[tuple[int, int]]]]:
    """All rows as one micro-batch, and per row the (start, end) of each document in it."""
    rows = build_rows(docs, _spec(), pad)
    placed: list[list[tuple[int, int]]] = []
    for r in range(rows.input_ids.shape[0]):
        starts = [int(i) for i in torch.nonzero(rows.position_ids[r] == 0)]
        real = int(rows.attention_mask[r].sum())
        placed.append(list(zip(starts, [*starts[1:], real], strict=True)))
    mb = MicroBatch(rows.input_ids, rows.attention_mask, rows.position_ids, rows.labels)
    return mb, placed


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per position t, the loss of predicting label t+1 (0 where it is ignored)."""
    shifted = labels[:, 1:]
    out = functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), shifted, ignore_index=IGNORE, reduction="none"
    )
    return out


def _alone(model_dir: Path, docs: list[Example]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The unsplit model on each document alone: its summed loss, and the gradients of the
    summed losses of all documents."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=load_config(model_dir), dtype=torch.float32
    )
    model.train()
    losses = []
    for doc in docs:
        ids = torch.tensor([doc.ids])
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(len(doc.ids)).unsqueeze(0),
            use_cache=False,
        ).logits
        loss = _token_losses(logits, torch.tensor([doc.labels])).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters() if ".layers." in n}
    return losses, grads


def _packed_through_slices(
    model_dir: Path, docs: list[Example], pad: int
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The packed rows through a 2-stage split, stage 1 fed what crosses the link; each
    document's summed loss (in `docs` order) and the gradients of their sum."""
    layers = int(load_config(model_dir).num_hidden_layers)
    first = build_stage_model(model_dir, SliceSpec(0, layers // 2, True, False))
    last = build_stage_model(model_dir, SliceSpec(layers // 2, layers, False, True))
    for stage in (first, last):
        for name, param in stage.model.named_parameters():
            param.requires_grad_(".layers." in name)
    mb, placed = _packed(docs, pad)
    hidden = first(mb.input_ids, mb.attention_mask, mb.position_ids)
    received = hidden.detach().requires_grad_(True)
    logits = last(received, mb.attention_mask.clone(), mb.position_ids.clone())
    per_token = _token_losses(logits, mb.labels)
    by_first_token = {}
    for r, spans in enumerate(placed):
        for start, end in spans:
            # Positions start..end-2 predict the document's tokens start+1..end-1.
            by_first_token[tuple(mb.input_ids[r, start:end].tolist())] = per_token[
                r, start : end - 1
            ].sum()
    losses = [by_first_token[tuple(doc.ids)] for doc in docs]
    total = torch.stack(losses).sum()
    total.backward()  # type: ignore[no-untyped-call]
    hidden.backward(received.grad)  # type: ignore[no-untyped-call]
    grads = {}
    for stage in (first, last):
        grads.update({n: p.grad for n, p in stage.model.named_parameters() if p.requires_grad})
    return [loss.detach() for loss in losses], grads


def _compare(model_dir: Path, vocab: int) -> list[str]:
    """What differs (beyond fp32 rounding) between packed-through-slices and one by one."""
    docs = _documents(vocab, LENGTHS)
    want_losses, want_grads = _alone(model_dir, docs)
    got_losses, got_grads = _packed_through_slices(model_dir, docs, vocab - 1)
    out = []
    for i, (got, want) in enumerate(zip(got_losses, want_losses, strict=True)):
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            out.append(f"document {i}: loss {float(got):.6f} != {float(want):.6f} alone")
    assert set(got_grads) == set(want_grads)
    for name, want in want_grads.items():
        got = got_grads[name]
        if want is None or got is None:
            continue
        error = float((got - want).norm() / want.norm().clamp_min(1e-12))
        if error > 1e-4:
            out.append(f"gradient of {name}: relative error {error:.1e}")
    return out


_DIRS: dict[str, tuple[Path, int]] = {}


def _family_dir(model_type: str, factory: pytest.TempPathFactory) -> tuple[Path, int]:
    if model_type not in _DIRS:
        path = tiny_family_dir(factory.mktemp(model_type), model_type)
        _DIRS[model_type] = (path, int(load_config(path).vocab_size))
    return _DIRS[model_type]


def test_rows_hold_whole_documents_with_restarting_positions() -> None:
    docs = _documents(300, LENGTHS)
    mb, placed = _packed(docs, 299)
    assert mb.input_ids.shape == (3, ROW)
    assert sorted(end - start for spans in placed for start, end in spans) == sorted(LENGTHS)
    for r, spans in enumerate(placed):
        for start, end in spans:
            assert mb.position_ids[r, start:end].tolist() == list(range(end - start))
            assert mb.labels[r, start] == IGNORE  # nothing in the row predicts a first token
            assert (mb.labels[r, start + 1 : end] == mb.input_ids[r, start + 1 : end]).all()
        real = spans[-1][1]
        assert (mb.attention_mask[r, real:] == 0).all() and (mb.labels[r, real:] == IGNORE).all()
    # As many label tokens as the documents one by one.
    alone = [MicroBatch(*(torch.tensor([d.ids]),) * 2, torch.tensor([d.ids]),
                        torch.tensor([d.labels])) for d in docs]  # fmt: skip
    assert count_items([mb]) == count_items(alone)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_packed_documents_match_the_documents_alone_in_every_family(
    model_type: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir, vocab = _family_dir(model_type, tmp_path_factory)
    assert _compare(model_dir, vocab) == []


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma3_text"])
def test_plain_causal_packing_leaks_across_documents(
    model_type: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, vocab = _family_dir(model_type, tmp_path_factory)
    monkeypatch.setattr(families, "document_ids", lambda position_ids: None)
    found = _compare(model_dir, vocab)
    assert any(line.startswith("document 1:") for line in found), found


def _packed_steps(docs: list[Example], pad: int) -> list[list[MicroBatch]]:
    """Two steps of two micro-batches of one packed row (the rows of `docs`, repeated)."""
    mb, _ = _packed(docs, pad)
    rows = [MicroBatch(*(t[r : r + 1] for t in (mb.input_ids, mb.attention_mask,
                                                mb.position_ids, mb.labels)))
            for r in range(mb.input_ids.shape[0])]  # fmt: skip
    return [[rows[0], rows[1]], [rows[2], rows[0]]]


def _alone_steps(docs: list[Example], steps: list[list[MicroBatch]]) -> list[list[MicroBatch]]:
    """The same steps with every document of every packed row as its own micro-batch."""
    out = []
    for micros in steps:
        alone = []
        for mb in micros:
            starts = [int(i) for i in torch.nonzero(mb.position_ids[0] == 0)]
            ends = [*starts[1:], int(mb.attention_mask[0].sum())]
            for start, end in zip(starts, ends, strict=True):
                ids = mb.input_ids[:, start:end]
                labels = mb.labels[:, start:end].clone()
                pos = torch.arange(end - start).unsqueeze(0)
                alone.append(MicroBatch(ids, torch.ones_like(ids), pos, labels))
        out.append(alone)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("llama"), layers=4, tied=True)


def _pipeline_vs_alone(model_dir: Path) -> list[str]:
    vocab = int(load_config(model_dir).vocab_size)
    docs = _documents(vocab, LENGTHS)
    packed = _packed_steps(docs, vocab - 1)
    training = CLIPPED_TRAINING.model_copy(update={"steps": 2})
    ref = run_reference(model_dir, _alone_steps(docs, packed), training)
    run = run_pipeline_threads(model_dir, [(0, 2), (2, 4)], packed, training,
                               credentials=stage_credentials(2))  # fmt: skip
    out = []
    for step in range(2):
        if abs(run.losses[step] - ref.losses[step]) > 1e-5 * abs(ref.losses[step]):
            out.append(f"step {step} loss {run.losses[step]:.6f} != {ref.losses[step]:.6f}")
        for name, want in ref.grads[step].items():
            if not torch.allclose(run.grads[step][name], want, rtol=1e-4, atol=1e-7):
                out.append(f"step {step} gradient of {name}")
    return out


def test_a_packed_pipeline_trains_as_the_documents_one_by_one(llama: Path) -> None:
    assert _pipeline_vs_alone(llama) == []


def test_a_pipeline_with_plain_causal_packing_does_not(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(families, "document_ids", lambda position_ids: None)
    found = _pipeline_vs_alone(llama)
    assert any("loss" in line for line in found), found
