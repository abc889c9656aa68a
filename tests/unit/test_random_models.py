"""Random models from a config alone (relaytrain_testkit.random_models), what the GPU check
builds its 8B-shaped model with: every weight is drawn by its global name, so each slice of
a split holds exactly what the unsplit model holds under the same names (a tied head too),
and a different seed draws different weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from relaytrain_testkit.random_models import config_dir, copied_stage, random_model, random_stage
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


def test_slices_copy_a_model_trained_in_memory_and_name_a_weight_it_lacks(tmp_path: Path) -> None:
    """`copied_stage`: a benchmark pretrains the drawn model on the card and splits that one:
    each slice holds its copies (in the slice's dtype), and a weight the given state lacks is
    named, not drawn."""
    model_dir = config_dir(tmp_path, CONFIG)
    whole = random_model(model_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        for param in whole.parameters():
            param.add_(1.0)  # trained: no longer what the names draw
    state = dict(whole.named_parameters())
    stage = copied_stage(model_dir, SliceSpec(1, 3, False, True), state, dtype="bfloat16")
    for name, param in stage.model.named_parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad
        assert torch.equal(param, state[name].to(torch.bfloat16)), name
        assert param.data_ptr() != state[name].data_ptr()
    del state["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        copied_stage(model_dir, SliceSpec(1, 3, False, True), state, dtype="float32")
