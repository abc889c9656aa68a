"""Tiny random models of every supported family, for tests: built from the family's own
transformers config class (no hub), with the family's twist switched on and set so that it
matters at this size (short sliding windows, small soft-caps, far-apart rotary bases,
multipliers far from 1), and saved like a hub checkpoint (sharded) with a tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relaytrain_testkit.tiny_models import save_tokenizer

LAYERS = 4
"""Every family's tiny model has this many decoder layers."""


def family_config(model_type: str, vocab: int) -> Any:
    """The tiny config of a family, from the family's own config class."""
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "pad_token_id": vocab - 1,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    }
    moe: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_experts": 4}
    gemma: dict[str, Any] = {"head_dim": 8, "query_pre_attn_scalar": 8, "tie_word_embeddings": True}
    builders: dict[str, Callable[[], Any]] = {
        "llama": lambda: tf.LlamaConfig(**{**common, "tie_word_embeddings": True}),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=4),
        "qwen2": lambda: tf.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=4, max_window_layers=2
        ),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8),
        "gemma": lambda: tf.GemmaConfig(**{**common, "tie_word_embeddings": True}, head_dim=8),
        "gemma2": lambda: tf.Gemma2Config(
            **{**common, **gemma},
            sliding_window=4,
            final_logit_softcapping=2.0,
            attn_logit_softcapping=3.0,
        ),
        "gemma3_text": lambda: tf.Gemma3TextConfig(
            **{**common, **gemma},
            sliding_window=4,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "default", "rope_theta": 100_000.0},
            },
            final_logit_softcapping=2.0,
        ),
        "phi3": lambda: tf.Phi3Config(
            **common,
            sliding_window=6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
        "mixtral": lambda: tf.MixtralConfig(
            **common, sliding_window=5, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=24, mlp_only_layers=[1]
        ),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim via **kwargs
            **common, **moe, head_dim=8, norm_topk_prob=True, mlp_only_layers=[2]
        ),
        "gpt_oss": lambda: tf.GptOssConfig(
            **common,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        ),
        "olmo2": lambda: tf.Olmo2Config(**common),
        "granite": lambda: tf.GraniteConfig(
            **{**common, "tie_word_embeddings": True},
            embedding_multiplier=6.0,
            logits_scaling=4.0,
            residual_multiplier=0.3,
            attention_multiplier=0.2,
        ),
    }
    return builders[model_type]()


def tiny_family_dir(out: Path, model_type: str, seed: int = 0) -> Path:
    """A random tiny model of `model_type`, saved like a hub checkpoint (sharded)."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = family_config(model_type, save_tokenizer(out))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    # Random init leaves GPT-OSS's attention sinks and some norms at values that hide
    # them (zero sinks, unit norms); perturb every parameter so each one matters.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(str(out), max_shard_size="40KB")
    return out
