"""Random models from a config alone (relaytrain_testkit.random_models), what the GPU check
builds its 8B-shaped model with: every weight is drawn by its global name, so each slice of
a split holds exactly what the unsplit model holds under the same names (a tied head too),
and a different seed draws different weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from relaytrain_testkit.random_models import config_dir, random_model, random_stage
from relaytrain_worker.model.model_slice import SliceSpec

pytestmark = pytest.mark.unit

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_every_slice_holds_the_unsplit_models_weights(tmp_path: Path, tied: bool) -> None:
    model_dir = config_dir(tmp_path, {**CONFIG, "tie_word_embeddings": tied})
    whole = dict(random_model(model_dir, dtype="float32", device="cpu").named_parameters())
    seen = set()
    for spec in (SliceSpec(0, 1, True, False), SliceSpec(1, 3, False, True)):
        stage = random_stage(model_dir, spec, dtype="float32", device="cpu")
        for name, param in stage.model.named_parameters():
            want = whole["model.embed_tokens.weight" if name not in whole else name]
            assert torch.equal(param, want), name
            assert not param.requires_grad
            seen.add(name)
    assert set(whole) <= seen
    assert ("lm_head.weight" in whole) != tied
    norm = whole["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < float(whole["model.layers.0.mlp.up_proj.weight"].std()) < 0.025


def test_another_seed_draws_other_weights(tmp_path: Path) -> None:
    model_dir = config_dir(tmp_path, CONFIG)
    spec = SliceSpec(0, 3, True, True)
    a = random_stage(model_dir, spec, dtype="float32", device="cpu", seed=0)
    b = random_stage(model_dir, spec, dtype="float32", device="cpu", seed=1)
    name = "model.layers.2.self_attn.q_proj.weight"
    assert not torch.equal(a.model.get_parameter(name), b.model.get_parameter(name))
