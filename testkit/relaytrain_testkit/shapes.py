"""Model configs the planner reads in tests and benchmarks (config.json contents, no weights)."""

from __future__ import annotations

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
