"""Model configs the planner reads in tests and benchmarks (config.json contents, no weights)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# SmolLM2-135M's shape: all the planner needs of the model.
SMOLLM2_135M_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}

# Llama 3 8B's shape (8192 positions, an lm_head of its own).
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
}

# Llama 3.1 8B: the config.json relaytrain ships (131072 positions).
LLAMA31_8B_CONFIG: dict[str, Any] = json.loads(
    resources.files("relaytrain_operator").joinpath("known_models", "llama-3.1-8b.json").read_text()
)
