"""Pipelined training reproduces single-process training (tiny models, CPU, real links)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from relaytrain_contract.order import one_f_one_b
from relaytrain_testkit.inputs import CLIPPED_TRAINING, even_splits
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import run_pipeline_threads
from relaytrain_testkit.references import run_reference
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model
from relaytrain_worker.state.data import MicroBatch

pytestmark = pytest.mark.unit

TRAINING = CLIPPED_TRAINING


def _steps(vocab: int, n_steps: int = 3, n_micro: int = 3) -> list[list[MicroBatch]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_steps):
        micros = []
        for _ in range(n_micro):
            ids = torch.randint(0, vocab, (2, 12), generator=gen)
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[1, 9:] = 0  # right padding on one row
            labels = ids.clone()
            labels[mask == 0] = -100
            labels[0, :3] = -100  # a masked prompt
            pos = torch.arange(12).expand(2, -1).contiguous()
            micros.append(MicroBatch(ids, mask, pos, labels))
        out.append(micros)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("llama"), layers=4)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> object:
    return run_reference(llama_dir, _steps(300), TRAINING)


@pytest.mark.parametrize(("stages", "ahead"), [(2, 0), (3, 0), (4, 0), (3, 2)])
def test_lora_pipeline_equals_single_process_bit_for_bit(
    llama_dir: Path, reference: object, stages: int, ahead: int
) -> None:
    # With forwards ahead of 1F1B (spec.pipeline.forwardsAhead) too: backwards keep
    # micro-batch order, so the gradients accumulate in the same order.
    ref = reference
    run = run_pipeline_threads(
        llama_dir, even_splits(4, stages), _steps(300), TRAINING,
        credentials=stage_credentials(stages), ahead=ahead,
    )  # fmt: skip
    assert run.losses == ref.losses  # type: ignore[attr-defined]
    for step in range(3):
        assert set(run.grads[step]) == set(ref.grads[step])  # type: ignore[attr-defined]
        for name, grad in ref.grads[step].items():  # type: ignore[attr-defined]
            assert torch.equal(run.grads[step][name], grad), (step, name)
    for name, value in ref.params.items():  # type: ignore[attr-defined]
        assert torch.equal(run.params[name], value), name


def test_int8_links_stay_within_tolerance(llama_dir: Path, reference: object) -> None:
    # int8 blockwise absmax has a per-value error <= absmax/254 of its 64-value block,
    # i.e. < 0.4% of the block's largest activation. Through 2 layers and the head this
    # moves the token-mean loss by well under 1e-3 relative; gradients (also int8 on the
    # way back) stay within 5% in norm.
    ref = reference
    run = run_pipeline_threads(
        llama_dir, even_splits(4, 2), _steps(300), TRAINING,
        credentials=stage_credentials(2), compression="int8",
    )  # fmt: skip
    for got, want in zip(run.losses, ref.losses, strict=True):  # type: ignore[attr-defined]
        assert abs(got - want) / want < 1e-3
    assert run.losses != ref.losses  # compression really happened
    for name, grad in ref.grads[0].items():  # type: ignore[attr-defined]
        err = torch.linalg.vector_norm(run.grads[0][name] - grad)
        assert err <= 0.05 * torch.linalg.vector_norm(grad) + 1e-12, name


def test_full_training_with_tied_embeddings_updates_the_shared_weight_identically(
    llama_dir: Path,
) -> None:
    steps = _steps(300, n_steps=2)
    ref = run_reference(llama_dir, steps, TRAINING, method="full")
    run = run_pipeline_threads(
        llama_dir, even_splits(4, 3), steps, TRAINING,
        credentials=stage_credentials(3), method="full",
    )  # fmt: skip
    tied = "model.embed_tokens.weight"
    # Stage 0 (embedding) and the last stage (head) hold the very same weight afterwards.
    assert torch.equal(run.stage_params[0][tied], run.stage_params[2][tied])
    assert run.losses[0] == ref.losses[0]
    # The summed gradient is added in another order than autograd's (per step, not per
    # micro-batch), so the match is to float32 rounding, not bit for bit.
    for name, value in ref.params.items():
        assert torch.allclose(run.params[name], value, rtol=0, atol=1e-6), name
    assert set(run.params) == set(ref.params)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_forward_of_slices_equals_the_unsplit_model(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(tmp_path, arch=arch, layers=3, tied=False)  # type: ignore[arg-type]
    ids = torch.randint(0, 300, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0
    pos = torch.arange(10).expand(2, -1)
    full = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    full.config._attn_implementation = "sdpa"
    want = full(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    hidden = ids
    for k, (start, end) in enumerate(even_splits(3, 3)):
        stage = build_stage_model(model_dir, SliceSpec(start, end, k == 0, k == 2))
        hidden = stage(hidden, mask, pos)
    assert torch.equal(hidden, want)


@pytest.mark.parametrize("ahead", [0, 2])
def test_one_f_one_b_order_bounds_activations_in_flight(ahead: int) -> None:
    from relaytrain_contract.order import in_flight

    for stages in (1, 2, 4):
        for k in range(stages):
            order = one_f_one_b(k, stages, 6, ahead)
            assert sorted(m for kind, m in order if kind == "F") == list(range(6))
            assert [m for kind, m in order if kind == "B"] == list(range(6))
            live = peak = 0
            for kind, _ in order:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            # Forwards ahead on every stage but the last (whose backward needs nothing
            # from later): what the planner counts in each stage's memory.
            assert peak == min(stages - k + (ahead if k < stages - 1 else 0), 6)
            assert peak == in_flight(k, stages, 6, ahead)


def test_qlora_trains_adapters_on_a_4bit_base(llama_dir: Path) -> None:
    import bitsandbytes as bnb
    from relaytrain_worker.model.quant import quantize_slice

    stage = build_stage_model(llama_dir, SliceSpec(0, 2, True, False))
    assert quantize_slice(stage) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(
        isinstance(m, bnb.nn.Linear4bit) for _, layer in stage.layer_items()
        for m in layer.modules() if isinstance(m, torch.nn.Linear)
    )  # fmt: skip
    steps = _steps(300, n_steps=3)
    run = run_pipeline_threads(
        llama_dir, even_splits(4, 2), steps, TRAINING,
        credentials=stage_credentials(2), method="qlora",
    )  # fmt: skip
    ref = run_reference(llama_dir, steps, TRAINING)
    # Gradients reach lora_A once lora_B has moved off zero (after the warm-up step; they
    # stop silently on CPU unless the avx512-bf16 path is switched off).
    assert all(float(g.abs().sum()) > 0 for n, g in run.grads[2].items() if "lora_A" in n)
    # NF4 quantisation error of random weights moves the loss by well under 1%.
    for got, want in zip(run.losses, ref.losses, strict=True):
        assert abs(got - want) / want < 0.01


def test_tokens_per_second_counts_non_padding_input_tokens(llama_dir: Path) -> None:
    # progress.json's tokensPerSecond is the last stage's count over the step's wall time;
    # it must count what the pipeline processes (every non-padding input token), not only
    # the tokens the loss is taken over (masked prompts and the shifted first position).
    steps = _steps(300, n_steps=1)
    run = run_pipeline_threads(
        llama_dir, even_splits(4, 2), steps, TRAINING, credentials=stage_credentials(2)
    )
    padded = sum(mb.input_ids.numel() for mb in steps[0])
    real = sum(int(mb.attention_mask.sum()) for mb in steps[0])
    label = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in steps[0])
    assert label < real < padded  # the data has prompts and padding
    assert run.input_tokens == [real]


def _epochs(vocab: int, epochs: int) -> list[list[MicroBatch]]:
    """Six fixed rows, one step of three micro-batches per epoch, in another order each epoch."""
    rows = _steps(vocab, n_steps=1)[0]
    ids = torch.cat([mb.input_ids for mb in rows])
    mask, pos = (
        torch.cat([mb.attention_mask for mb in rows]),
        torch.cat([mb.position_ids for mb in rows]),
    )
    labels = torch.cat([mb.labels for mb in rows])
    out = []
    for epoch in range(epochs):
        order = torch.randperm(6, generator=torch.Generator().manual_seed(epoch))
        out.append([
            MicroBatch(ids[i], mask[i], pos[i], labels[i], rows=i)
            for i in order.reshape(3, 2)
        ])  # fmt: skip
    return out


def test_delta_links_send_later_epochs_as_changes_and_train_close_to_exact(
    tmp_path: Path,
) -> None:
    # Wide enough that a row's codes, not its few bytes of header, are what a frame carries.
    llama_dir = tiny_model_dir(tmp_path / "wide", layers=4, hidden=256)
    steps = _epochs(300, 3)
    ref = run_reference(llama_dir, steps, TRAINING)
    runs = {}
    for epochs in (1, 3):
        runs[epochs] = run_pipeline_threads(
            llama_dir, even_splits(4, 2), steps[:epochs], TRAINING,
            credentials=stage_credentials(2), compression="delta",
        )  # fmt: skip
    # Without the rows' keys nothing is cached: every epoch is a full code again.
    keyless = [[MicroBatch(mb.input_ids, mb.attention_mask, mb.position_ids, mb.labels)
                for mb in step] for step in steps]  # fmt: skip
    alone = run_pipeline_threads(
        llama_dir, even_splits(4, 2), keyless, TRAINING,
        credentials=stage_credentials(2), compression="delta",
    )  # fmt: skip
    # Epochs 2 and 3 send each row's change, held to a quarter of its first code's error:
    # together at least 1.5 bits a value fewer than full codes of 4.30 (the integer tensors,
    # the step-end frames and the headers are the same in both runs).
    hidden = json.loads((llama_dir / "config.json").read_text())["hidden_size"]
    saved = alone.boundary_bytes[0][0] - runs[3].boundary_bytes[0][0]
    assert saved > 2 * 6 * 12 * hidden * 1.5 / 8, (saved, hidden)
    assert runs[1].boundary_bytes[0][0] < runs[3].boundary_bytes[0][0]
    # A 4-bit first code, then changes, forward; 2-bit gradients back: the loss stays within
    # a few percent of exact training, and the codes really were lossy.
    for got, want in zip(runs[3].losses, ref.losses, strict=True):
        assert abs(got - want) / want < 0.03, (runs[3].losses, ref.losses)
    assert runs[3].losses != ref.losses
