"""The planner reads every supported family's config.json and plans it; others are refused.

The configs are the published ones of a model of each family (the keys the planner reads);
the parameter counts they give are checked against the published sizes, which is what the
memory side of a plan rests on.
"""

from __future__ import annotations

from typing import Any

import pytest
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES
from relaytrain_operator.domain.planner import (
    ModelShape,
    ModelShapeError,
    Pool,
    TrainingShape,
    plan,
)

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
    from relaytrain_operator.domain.planner.cost import lora_params_per_layer

    shape = _shape("phi3")
    fused = TrainingShape(1, 8, 512, lora_targets=("qkv_proj", "gate_up_proj"))
    # rank x (in + out) of each fused module: one input, the outputs of its parts.
    r = fused.lora_rank
    assert lora_params_per_layer(shape, fused) == r * (5120 + 7680) + r * (5120 + 35840)


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
    from relaytrain_operator.loop.actions import Create
    from relaytrain_operator.loop.decide import ModelConfig, decide
    from relaytrain_testkit.decide_cases import JOB, SETTINGS, events, observed
    from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

    model = ModelConfig({**SMOLLM2_135M_CONFIG, "model_type": "phimoe"})
    decision = decide(observed(JOB.build(), model=model), SETTINGS)
    assert not [a for a in decision.actions if isinstance(a, Create)]
    (event,) = events(decision)
    listed = ", ".join(SUPPORTED_MODEL_TYPES)
    want = f"model_type 'phimoe' is not supported; supported: {listed}"
    # No fleet trains it: the spec must name another model (not a wait for GPUs).
    assert (event.type, event.reason) == ("Warning", "InvalidSpec")
    assert want in event.message
    assert decision.status is not None and decision.status.phase == "Failed"
    ready = next(c for c in decision.status.conditions if c.type == "Ready")
    assert ready.reason == "InvalidSpec" and want in ready.message


# --- per-family costing --------------------------------------------------------------

POOLS = [Pool("h100", "NVIDIA-H100-80GB-HBM3", 8, 10_000, 10)]


def _cost(shape: ModelShape, training: TrainingShape) -> Any:
    from relaytrain_operator.domain.planner import DEFAULT_CATALOG
    from relaytrain_operator.domain.planner.cost import CostSettings, pool_cost

    gpu = DEFAULT_CATALOG[POOLS[0].product]
    return pool_cost(shape, training, POOLS[0], gpu, CostSettings())


@pytest.mark.parametrize("method", ["lora", "full"])
def test_an_moe_layer_computes_its_routed_experts_only(method: str) -> None:
    from relaytrain_operator.domain.planner.cost import step_flops

    mixtral = _shape("mixtral")
    # The same layer as a dense model whose MLP is experts_per_tok experts wide.
    dense = ModelShape.from_hf_config(
        {**CONFIGS["mixtral"][1], "model_type": "mistral", "sliding_window": None,
         "intermediate_size": 2 * 14336}
    )  # fmt: skip
    training = TrainingShape(1, 8, 4096, method=method)  # type: ignore[arg-type]
    moe_flops, _ = step_flops(mixtral, training)
    dense_flops, _ = step_flops(dense, training)
    # The router (4096 x 8 per token) is all that differs.
    assert moe_flops == pytest.approx(dense_flops, rel=1e-3)
    assert moe_flops > dense_flops
    # ... while the stage holds all eight experts: four times the dense MLP's weights.
    moe_mem, dense_mem = _cost(mixtral, training), _cost(dense, training)
    mlp = 3 * 4096 * 14336
    assert moe_mem.layer_weight_bytes - dense_mem.layer_weight_bytes == 2 * (6 * mlp + 4096 * 8)


def test_qwen2_moe_computes_its_shared_expert_and_router_too() -> None:
    shape = _shape("qwen2_moe")
    h = 2048
    attention = 2 * h * h + 2 * h * h  # q, o and k, v (16 KV heads: no grouping)
    routed = 4 * 3 * h * 1408
    assert shape.active_matmul_params == attention + routed + 3 * h * 5632 + h + 60 * h


def test_sliding_layers_are_cheaper_at_long_sequences_only() -> None:
    from relaytrain_operator.domain.planner.cost import step_flops

    windowed = _shape("mistral")  # sliding_window 4096 on every layer
    full = _shape("mistral", sliding_window=None)
    for seq, cheaper in ((4096, False), (32768, True)):
        training = TrainingShape(1, 8, seq)
        a, b = step_flops(windowed, training)[0], step_flops(full, training)[0]
        assert (a < b) is cheaper and a <= b
    # At 32k the window scores s·w − w²/2 pairs per sequence instead of s²/2.
    s, w = 32768, 4096
    assert windowed.attention_pairs(s) == s * w - w * w / 2
    assert full.attention_pairs(s) == s * s / 2


def test_alternating_windows_follow_each_familys_layer_pattern() -> None:
    gemma2 = _shape("gemma2", sliding_window=4096)
    assert gemma2.attention_windows == (4096, 0) * 13  # even layers slide
    gemma3 = _shape("gemma3_text")
    assert gemma3.attention_windows == ((512,) * 5 + (0,)) * 4 + (512, 512)
    assert _shape("gemma3_text", sliding_window_pattern=2).attention_windows == (512, 0) * 13
    gpt_oss = _shape("gpt_oss")  # its config class's default window: 128
    assert gpt_oss.attention_windows == (128, 0) * 12
    layer_types = ["full_attention"] * 20 + ["sliding_attention"] * 4
    assert _shape("gpt_oss", layer_types=layer_types).attention_windows == (0,) * 20 + (128,) * 4
    qwen2 = _shape("qwen2", use_sliding_window=True, sliding_window=1024, max_window_layers=20)
    assert qwen2.attention_windows == (0,) * 20 + (1024,) * 8
    assert _shape("qwen2", sliding_window=1024).attention_windows == ()  # not used
    assert _shape("mixtral").attention_windows == ()  # Mixtral's default: no window
    s, w = 8192, 4096
    assert gemma2.attention_pairs(s) == (s * s / 2 + s * w - w * w / 2) / 2


def test_a_tied_head_is_held_once_by_a_single_stage_and_copied_to_a_last_one() -> None:
    gemma2, training = _shape("gemma2"), TrainingShape(1, 8, 1024)
    cost = _cost(gemma2, training)
    embed = 256000 * 2304 * 2
    assert cost.stage_weight_bytes(0, True, False) == embed
    assert cost.stage_weight_bytes(0, False, True) == embed + 2304 * 2  # a copy, and the norm
    assert cost.stage_weight_bytes(0, True, True) == embed + 2304 * 2  # held once
    untied = _cost(_shape("gemma2", tie_word_embeddings=False), training)
    assert untied.stage_weight_bytes(0, True, True) == 2 * embed + 2304 * 2


def test_qlora_leaves_expert_weights_unquantised() -> None:
    from relaytrain_operator.domain.planner.cost import QLORA_BYTES_PER_PARAM

    mixtral, training = _shape("mixtral"), TrainingShape(1, 8, 1024, method="qlora")
    cost = _cost(mixtral, training)
    h = 4096
    linear = 2 * h * h + 2 * h * 1024  # the attention projections: nn.Linear, quantised
    experts = 8 * 3 * h * 14336 + 8 * h  # 3-D expert weights and the router: bf16
    assert cost.layer_weight_bytes == int(linear * QLORA_BYTES_PER_PARAM) + 2 * (experts + 2 * h)


def test_eager_attention_families_hold_every_score() -> None:
    training = TrainingShape(1, 8, 4096)
    gemma2 = _cost(_shape("gemma2"), training)
    gemma = _cost(
        ModelShape.from_hf_config({**CONFIGS["gemma2"][1], "model_type": "gemma"}), training
    )
    # Gemma 2 runs eager (soft-capping): fp32 softmax, its bf16 copy and the tanh output;
    # eager attention repeats k and v to its 8 query heads (q 2048 wide, k and v 1024), and
    # Gemma 2 norms attention's and the MLP's outputs too (fp32 inputs and rsqrt).
    scores = 8 * 4096**2 * 8
    repeated = 4096 * 2 * (2048 - 1024) * 2
    post_norms = 4096 * 2 * (2304 + 1) * 4
    assert gemma2.layer_activation_bytes - gemma.layer_activation_bytes == (
        scores + repeated + post_norms
    )


# --- LoRA targets on experts ----------------------------------------------------------


def test_expert_targets_are_priced_as_peft_adapts_them() -> None:
    from relaytrain_operator.domain.planner.cost import lora_params_per_layer

    shape, r = _shape("mixtral"), 8
    training = TrainingShape(1, 8, 512, lora_rank=r, lora_targets=("mlp.experts.down_proj",))
    assert training.lora_targets == ("experts.down_proj",)
    # peft's ParamWrapper: lora_A in x (r x experts), lora_B (r x experts) x out.
    assert lora_params_per_layer(shape, training) == r * 8 * (14336 + 4096)


@pytest.mark.parametrize(
    ("model_type", "targets", "refused", "valid"),
    [
        ("llama", ["q_proj", "experts.down_proj"], "experts.down_proj", "has no experts"),
        ("phi3", ["experts.gate_up_proj"], "experts.gate_up_proj", "qkv_proj, gate_up_proj"),
        ("mixtral", ["q_proj", "gate_proj"], "gate_proj", "o_proj, experts.gate_up_proj, "),
        ("gpt_oss", ["down_proj"], "down_proj", "3-D weights that peft adapts only as"),
        ("qwen3_moe", ["up_proj"], "up_proj", "experts.down_proj (or 'all-linear')"),
        ("llama", ["qkv_proj"], "qkv_proj", "has no fused projections"),
    ],
)
def test_targets_a_family_does_not_have_are_refused_naming_the_field(
    model_type: str, targets: list[str], refused: str, valid: str
) -> None:
    from relaytrain_operator.domain.planner import PlanError

    training = TrainingShape(1, 8, 512, lora_targets=tuple(targets))
    with pytest.raises(PlanError) as err:
        plan(_shape(model_type), training, POOLS)
    message = str(err.value)
    assert message.startswith(f"spec.method.targetModules names {refused}, which match nothing")
    assert valid in message


@pytest.mark.parametrize(
    ("model_type", "targets"),
    [
        ("mixtral", ("all-linear",)),  # as in peft: the linears there are (attention)
        ("mixtral", ("q_proj", "experts.gate_up_proj", "experts.down_proj")),
        ("qwen2_moe", ("gate_proj", "up_proj", "down_proj")),  # the shared expert's
        ("qwen3_moe", ("gate_proj",)),  # its dense layers' (mlp_only_layers)
        ("phi3", ("q_proj", "qkv_proj")),
    ],
)
def test_targets_a_family_has_are_planned(model_type: str, targets: tuple[str, ...]) -> None:
    extra = {"mlp_only_layers": [0, 1]} if model_type == "qwen3_moe" else {}
    result = plan(
        _shape(model_type, **extra), TrainingShape(1, 8, 512, lora_targets=targets), POOLS
    )
    assert result.stages


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_targets": ("experts.w1",)}, r"not 'experts.w1'"),
        ({"lora_targets": ("experts.gate_up_proj_bias",)}, r"experts.gate_up_proj, experts.down"),
        (
            {"lora_targets": ("experts.down_proj",), "lora_dropout": 0.05},
            r"peft adapts only without dropout; spec.method.dropout is 0.05",
        ),
    ],
)
def test_expert_targets_no_family_has_are_refused_without_the_model(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=r"spec\.method\.targetModules.*" + message):
        TrainingShape(1, 8, 512, **kwargs)


def test_relaytrain_plan_refuses_experts_on_a_dense_model(tmp_path: Any, capsys: Any) -> None:
    import json
    from pathlib import Path

    from relaytrain_operator import cli
    from relaytrain_testkit.jobs import Job

    root = Path(__file__).resolve().parents[2]
    experts = ["q_proj", "experts.down_proj"]
    lora = Job.example("finetunejob-lora").method("lora", target_modules=experts)
    job, config = lora.write(tmp_path / "job.yaml"), tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **CONFIGS["llama"][1]}))
    nodes = root / "examples" / "nodes-mixed.yaml"
    rc = cli.main(["plan", str(job), "--nodes", str(nodes), "--model-config", str(config)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "spec.method.targetModules names experts.down_proj, which match nothing in llama" in err
    assert "valid for llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in err
