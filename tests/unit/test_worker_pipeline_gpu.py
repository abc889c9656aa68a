"""Stages on a GPU: the stage runtime moves micro-batches and what arrives over the links
(decoded on the CPU, `delta`'s codes on the card) to the stage's device. One stage, and two
stages over a loopback link, both on CUDA, train a tiny random Llama the same (float32), and
as the same stage on the CPU does, within float tolerance; so do two `delta` stages; a random
slice built on the GPU has all of itself there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from relaytrain_testkit.inputs import CLIPPED_TRAINING, random_batches
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import PipelineRun, run_pipeline_threads
from relaytrain_testkit.random_models import config_dir, random_stage
from relaytrain_worker.model.model_slice import SliceSpec, StageModel

pytestmark = [pytest.mark.unit, pytest.mark.gpu]

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}  # fmt: skip
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}


def _train(
    model_dir: Path, device: str, splits: list[tuple[int, int]], compression: str = "none"
) -> PipelineRun:
    def build(spec: SliceSpec) -> StageModel:
        # Drawn on the CPU and moved: the CPU and the GPU runs start from the same weights.
        return random_stage(model_dir, spec, dtype="float32", device="cpu").to(device)

    steps = random_batches(3, 3, 2, 16, 300)
    return run_pipeline_threads(build, splits, steps, CLIPPED_TRAINING,
                                credentials=stage_credentials(len(splits)), lora=LORA,
                                compression=compression)  # fmt: skip


def test_stages_on_a_gpu_train_as_one_stage_and_as_the_cpu(tmp_path: Path) -> None:
    model_dir = config_dir(tmp_path, CONFIG)
    cpu = _train(model_dir, "cpu", [(0, 4)])
    one = _train(model_dir, "cuda", [(0, 4)])
    two = _train(model_dir, "cuda", [(0, 2), (2, 4)])
    assert {t.device.type for t in two.grads[-1].values()} == {"cuda"}
    assert two.losses == pytest.approx(one.losses, rel=1e-6)
    assert one.losses == pytest.approx(cpu.losses, rel=1e-4)
    for name, want in one.grads[-1].items():
        assert torch.allclose(two.grads[-1][name], want, rtol=1e-5, atol=1e-8), name
        assert torch.allclose(want.cpu(), cpu.grads[-1][name], rtol=1e-3, atol=1e-6), name


def test_delta_stages_on_a_gpu_code_and_decode_there_and_train_as_on_the_cpu(
    tmp_path: Path,
) -> None:
    """`delta` on a GPU stage codes on the card and decodes on the receiving card
    (`BoundaryCodec.device`); the codes may differ from the CPU's in a block's trial scale
    (a sum in another order), not in what they are worth."""
    model_dir = config_dir(tmp_path, CONFIG)
    cpu = _train(model_dir, "cpu", [(0, 2), (2, 4)], "delta")
    gpu = _train(model_dir, "cuda", [(0, 2), (2, 4)], "delta")
    exact = _train(model_dir, "cpu", [(0, 4)])
    assert {t.device.type for t in gpu.grads[-1].values()} == {"cuda"}
    assert gpu.losses == pytest.approx(cpu.losses, rel=1e-3)
    assert gpu.losses == pytest.approx(exact.losses, rel=2e-3)  # 1e-4 apart on the CPU


def test_a_random_slice_built_on_the_gpu_is_all_there(tmp_path: Path) -> None:
    stage = random_stage(config_dir(tmp_path, CONFIG), SliceSpec(0, 2, True, False),
                         dtype="bfloat16", device="cuda")  # fmt: skip
    assert {t.device.type for t in [*stage.parameters(), *stage.buffers()]} == {"cuda"}
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
