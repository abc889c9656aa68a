"""The planner reads every supported family's config.json and plans it; others are refused.

The configs are the published ones of a model of each family (the keys the planner reads);
the parameter counts they give are checked against the published sizes, which is what the
memory side of a plan rests on.
"""

from __future__ import annotations

from typing import Any

import pytest
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES
from relaytrain_operator.planner import ModelShape, ModelShapeError, Pool, TrainingShape, plan

pytestmark = pytest.mark.unit

# model_type -> (published size in parameters, config.json keys)
CONFIGS: dict[str, tuple[float, dict[str, Any]]] = {
    "llama": (8.03e9, {  # Llama-3.1-8B
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    }),
    "mistral": (7.24e9, {  # Mistral-7B-v0.1
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "sliding_window": 4096,
    }),
    "qwen2": (7.62e9, {  # Qwen2.5-7B
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    }),
    "qwen3": (8.19e9, {  # Qwen3-8B
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936,
    }),
    "gemma": (8.54e9, {  # gemma-7b
        "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
        "vocab_size": 256000, "tie_word_embeddings": True,
    }),
    "gemma2": (2.61e9, {  # gemma-2-2b
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "vocab_size": 256000, "tie_word_embeddings": True, "final_logit_softcapping": 30.0,
    }),
    "gemma3_text": (1.00e9, {  # gemma-3-1b-pt
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "vocab_size": 262144, "tie_word_embeddings": True, "sliding_window": 512,
    }),
    "phi3": (14.66e9, {  # phi-4
        "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 10, "vocab_size": 100352,
    }),
    "mixtral": (46.7e9, {  # Mixtral-8x7B-v0.1
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    }),
    "qwen2_moe": (14.3e9, {  # Qwen1.5-MoE-A2.7B
        "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
        "num_experts": 60, "num_experts_per_tok": 4,
    }),
    "qwen3_moe": (30.5e9, {  # Qwen3-30B-A3B
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
    }),
    "gpt_oss": (20.9e9, {  # gpt-oss-20b, dequantized (its hub config carries mxfp4)
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 201088, "num_local_experts": 32, "num_experts_per_tok": 4,
    }),
    "olmo2": (7.30e9, {  # OLMo-2-1124-7B
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 100352,
    }),
    "granite": (8.17e9, {  # granite-3.0-8b-base
        "hidden_size": 4096, "intermediate_size": 12800, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49155,
        "tie_word_embeddings": True, "embedding_multiplier": 12.0, "logits_scaling": 16.0,
    }),
}  # fmt: skip

# gpt-oss-20b's published 3.61e9 leaves out its 0.58e9 unembedding; counted here.
ACTIVE = {"mixtral": 12.9e9, "qwen2_moe": 2.7e9, "qwen3_moe": 3.3e9, "gpt_oss": 3.61e9 + 0.58e9}
"""Published parameters per token of the MoE models."""


def _shape(model_type: str, **extra: Any) -> ModelShape:
    return ModelShape.from_hf_config({"model_type": model_type, **CONFIGS[model_type][1], **extra})


def test_a_config_per_supported_family() -> None:
    assert set(CONFIGS) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_every_family_parses_to_its_published_size_and_plans(model_type: str) -> None:
    published, _ = CONFIGS[model_type]
    shape = _shape(model_type)
    # Norms are approximate per family and expert biases are left out: within 2 %.
    assert shape.total_params == pytest.approx(published, rel=0.02)
    pools = [Pool("a100", "NVIDIA-A100-SXM4-80GB", 8, 10_000, 10)]
    result = plan(shape, TrainingShape(1, 8, 512, dtype="bfloat16"), pools)
    assert sum(s.layer_end - s.layer_start for s in result.stages) == shape.num_layers


@pytest.mark.parametrize("model_type", sorted(ACTIVE))
def test_moe_models_know_their_experts(model_type: str) -> None:
    shape = _shape(model_type)
    assert 0 < shape.experts_per_token < shape.num_experts
    active = shape.total_params - shape.num_layers * (
        shape.layer_matmul_params - shape.active_matmul_params
    )
    assert active == pytest.approx(ACTIVE[model_type], rel=0.1)


def test_phi3_fused_projections_have_the_shapes_of_their_parts() -> None:
    shape = _shape("phi3")
    assert shape.linear_shape("qkv_proj") == (5120, 5120 + 2 * 1280)
    assert shape.linear_shape("gate_up_proj") == (5120, 2 * 17920)


def test_fused_projection_targets_are_planned_as_the_projections_they_fuse() -> None:
    from relaytrain_operator.planner.cost import lora_params_per_layer

    shape = _shape("phi3")
    fused = TrainingShape(1, 8, 512, lora_targets=("qkv_proj", "gate_up_proj"))
    # rank x (in + out) of each fused module: one input, the outputs of its parts.
    r = fused.lora_rank
    assert lora_params_per_layer(shape, fused) == r * (5120 + 7680) + r * (5120 + 35840)
    with pytest.raises(ValueError, match="qkv_proj, gate_up_proj"):
        TrainingShape(1, 8, 512, lora_targets=("experts.down_proj",))


def test_attention_biases_follow_the_family_default() -> None:
    assert _shape("gpt_oss").attention_bias and _shape("qwen2").attention_bias
    assert _shape("qwen2_moe").attention_bias
    assert not _shape("qwen2_moe", qkv_bias=False).attention_bias
    assert not _shape("mixtral").attention_bias


@pytest.mark.parametrize("model_type", ["gpt2", "gemma3", "deepseek_v3", None])
def test_unsupported_model_types_are_refused_naming_type_and_list(model_type: Any) -> None:
    config = {**CONFIGS["llama"][1], "model_type": model_type}
    listed = ", ".join(SUPPORTED_MODEL_TYPES)
    with pytest.raises(ModelShapeError) as err:
        ModelShape.from_hf_config(config)
    assert str(err.value) == f"model_type {model_type!r} is not supported; supported: {listed}"


def test_a_pre_quantized_checkpoint_is_refused() -> None:
    with pytest.raises(ModelShapeError, match=r"pre-quantized \(mxfp4\)"):
        _shape("gpt_oss", quantization_config={"quant_method": "mxfp4"})


def test_an_moe_config_without_its_experts_names_the_key() -> None:
    config = {"model_type": "mixtral", **CONFIGS["mixtral"][1]}
    del config["num_local_experts"]
    with pytest.raises(ModelShapeError, match="lacks 'num_local_experts'"):
        ModelShape.from_hf_config(config)


def test_the_operator_refuses_an_unsupported_type_before_any_pod() -> None:
    from relaytrain_operator.actions import Create
    from relaytrain_operator.decide import ModelConfig, decide

    from tests.shapes import SMOLLM2_135M_CONFIG
    from tests.unit.test_operator_decide import SETTINGS, events, manifest, observed

    model = ModelConfig({**SMOLLM2_135M_CONFIG, "model_type": "phimoe"})
    decision = decide(observed(manifest(), model=model), SETTINGS)
    assert not [a for a in decision.actions if isinstance(a, Create)]
    (event,) = events(decision)
    listed = ", ".join(SUPPORTED_MODEL_TYPES)
    want = f"model_type 'phimoe' is not supported; supported: {listed}"
    assert (event.type, event.reason) == ("Warning", "Unschedulable")
    assert want in event.message
    assert decision.status is not None
    ready = next(c for c in decision.status.conditions if c.type == "Ready")
    assert ready.reason == "Unschedulable" and want in ready.message
