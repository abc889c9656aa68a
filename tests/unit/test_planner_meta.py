"""The planner's per-family parameter counts against transformers' own models, built on
torch's meta device (shapes only, no memory): every supported family layer by layer, and
`relaytrain plan` on Mixtral-8x7B and Gemma-2-27B stage by stage.

A stage holds decoder layers [start, end), the embedding if it is first, the final norm and
the output head if it is last (a tied head is a copy of the embedding, held once when the
stage is also first): what the worker's slice loads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES, lora_targets
from relaytrain_operator import cli
from relaytrain_operator.domain.planner import DEFAULT_CATALOG, ModelShape, TrainingShape
from relaytrain_operator.domain.planner.cost import CostSettings, pool_cost
from relaytrain_operator.domain.planner.pools import pools_from_nodes
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "planner"
NODES = ROOT / "examples" / "nodes-mixed.yaml"

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
#: Tiny config.json of each family with its twists switched on (biases, fused projections,
#: q/k norms, sandwich norms, tied embeddings, shared experts, dense layers among MoE ones).
TINY: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": True, "mlp_bias": True},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {"head_dim": 24},
    "gemma": {"head_dim": 24, "tie_word_embeddings": True},
    "gemma2": {"head_dim": 24, "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 24, "tie_word_embeddings": True, "sliding_window": 8},
    "phi3": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    "qwen3_moe": {**_MOE, "head_dim": 24, "decoder_sparse_step": 2},
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmo2": {"attention_bias": True},
    "granite": {"mlp_bias": True, "tie_word_embeddings": True},
}


def _meta_model(config: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _parts(model: Any) -> Iterator[tuple[str, int | None, int]]:
    """(part, layer index or None, parameter count) of each parameter (tied ones once)."""
    for name, param in model.named_parameters():
        found = re.match(r"model\.layers\.(\d+)\.", name)
        if found:
            yield "layer", int(found.group(1)), param.numel()
        elif name.startswith("model.embed_tokens."):
            yield "embed", None, param.numel()
        elif name.startswith(("model.norm.", "lm_head.")):
            yield "head", None, param.numel()
        else:
            raise AssertionError(f"parameter {name} belongs to no part of a stage")


def _slice_params(model: Any, start: int, end: int, first: bool, last: bool) -> int:
    """Parameters a stage of layers [start, end) holds (a tied head: the embedding's copy)."""
    parts = list(_parts(model))
    layers = sum(
        n for part, i, n in parts if part == "layer" and i is not None and start <= i < end
    )
    embed = sum(n for part, _, n in parts if part == "embed")
    head = sum(n for part, _, n in parts if part == "head")
    tied = not any(p for p, _ in model.named_parameters() if p.startswith("lm_head."))
    total = layers + (embed if first else 0)
    if last:
        total += head + (embed if tied and not first else 0)
    return total


def test_a_tiny_config_per_supported_family() -> None:
    assert set(TINY) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_every_family_counts_what_transformers_builds(model_type: str) -> None:
    config = {"model_type": model_type, **_COMMON, **TINY[model_type]}
    model = _meta_model(config)
    shape = ModelShape.from_hf_config(config)
    per_layer = [0] * shape.num_layers
    for part, i, n in _parts(model):
        if part == "layer" and i is not None:
            per_layer[i] += n
    # Every layer at most the planner's layer (the largest), the largest exactly; the model
    # exactly. Norms, biases, sinks, shared experts and dense layers all count here.
    assert max(per_layer) == shape.layer_params
    assert sum(p.numel() for p in model.parameters()) == shape.total_params


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_expert_lora_parameters_are_what_peft_adds(model_type: str) -> None:
    from peft import LoraConfig, inject_adapter_in_model
    from relaytrain_operator.domain.planner.targets import lora_params_per_layer

    config = {"model_type": model_type, **_COMMON, **TINY[model_type], "mlp_only_layers": []}
    config.pop("decoder_sparse_step", None)
    shape = ModelShape.from_hf_config(config)
    asked = ("q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj")
    mapped = lora_targets(model_type, asked)
    model = _meta_model(config)
    lora = LoraConfig(
        r=4, target_modules=list(mapped.modules), target_parameters=list(mapped.parameters)
    )
    inject_adapter_in_model(lora, model)
    added = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    training = TrainingShape(1, 1, 16, lora_rank=4, lora_targets=asked)
    assert added == shape.num_layers * lora_params_per_layer(shape, training)


def _plan_json(tmp_path: Path, config: Path, capsys: Any, job: Job) -> dict[str, Any]:
    path = job.write(tmp_path / "job.yaml")
    rc = cli.main(
        ["plan", str(path), "--nodes", str(NODES), "--model-config", str(config), "--json",
         "--replicas", "1"]
    )  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err
    return {**json.loads(out.out), "manifest": job.build()}


LORA = Job.example("finetunejob-lora")
CASES = {
    # Mixtral-8x7B: 46.7e9 parameters, every expert held by the stage that holds its layer.
    "mixtral-8x7b": (
        LORA.method("lora", target_modules=["q_proj", "v_proj", "experts.down_proj"])
        .dataset(sequence_length=2048)
        .pipeline(stages=4)
    ),
    # Gemma-2-27B: tied 256k vocabulary, so the last stage holds a copy of the embedding.
    "gemma-2-27b": (
        LORA.method("lora")
        .dataset(sequence_length=1024)
        .pipeline(stages=3)
        .training(micro_batch_size=1)
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_stage_memory_matches_a_meta_build_of_each_slice(
    name: str, tmp_path: Path, capsys: Any
) -> None:
    from peft import LoraConfig, inject_adapter_in_model
    from relaytrain_operator.domain.planning import training_shape
    from relaytrain_operator.spec import parse_job

    path = DATA / f"{name}.json"
    config = json.loads(path.read_text())
    result = _plan_json(tmp_path, path, capsys, CASES[name])
    stages = result["stages"]
    assert len(stages) == result["manifest"]["spec"]["pipeline"]["stages"]
    # The breakdown the test compares is the one the command printed.
    shape = ModelShape.from_hf_config(config)
    training = training_shape(parse_job(result["manifest"], default_checkpoint_uri="checkpoints"))
    nodes = yaml.safe_load(NODES.read_text())["items"]
    pools = {p.name: p for p in pools_from_nodes(nodes)}
    model = _meta_model(config)
    mapped = lora_targets(shape.model_type, training.lora_targets)
    lora = LoraConfig(
        r=training.lora_rank,
        target_modules=list(mapped.modules),
        target_parameters=list(mapped.parameters) or None,
    )
    inject_adapter_in_model(lora, model)
    e = training.dtype_bytes
    for k, stage in enumerate(stages):
        first, last = k == 0, k == len(stages) - 1
        pool = pools[stage["pool"]]
        cost = pool_cost(shape, training, pool, DEFAULT_CATALOG[pool.product], CostSettings())
        layers = stage["layerEnd"] - stage["layerStart"]
        in_flight = stage["microBatchesInFlight"]
        assert cost.stage_bytes(layers, first, last, in_flight) == stage["predictedMemoryBytes"]
        start, end = stage["layerStart"], stage["layerEnd"]
        # Base weights: the slice's parameters in the job's dtype (LoRA's are fp32 below).
        base = _slice_params(model, start, end, first, last) - sum(
            p.numel() for n, p in model.named_parameters() if ".lora_" in n and _in(n, start, end)
        )
        predicted = cost.stage_weight_bytes(layers, first, last)
        assert predicted == pytest.approx(base * e, rel=0.01), (k, predicted, base * e)
        # Weights and training state: base weights plus LoRA weight, gradient, Adam m and v.
        adapters = sum(
            p.numel() for n, p in model.named_parameters() if ".lora_" in n and _in(n, start, end)
        )
        static = cost.stage_static_bytes(layers, first, last)
        assert static == pytest.approx(base * e + 16 * adapters, rel=0.01), k


def _in(name: str, start: int, end: int) -> bool:
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return found is not None and start <= int(found.group(1)) < end
