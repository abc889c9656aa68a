"""The shape of a decoder-only language model, read from its Hugging Face config.json.

The planner needs sizes, not weights: how many decoder layers there are and how big each
one is, plus the embedding and the output head. Llama-family models (Llama, Mistral,
Qwen2/3, SmolLM) share one layer layout: attention with grouped key/value heads, a gated
(SwiGLU) MLP and two RMSNorms, so one formula covers them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: model_type values whose layers follow the Llama layout (the worker runs these).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: Linear layers of a decoder layer: name -> (input features, output features) builder.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelShapeError(ValueError):
    """A model config the planner cannot read; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-family causal LM."""

    num_layers: int
    """Decoder layers (``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream (``hidden_size``)."""
    intermediate_size: int
    """Width of the MLP (``intermediate_size``)."""
    num_heads: int
    """Query heads (``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads (``num_key_value_heads``; equals ``num_heads`` without GQA)."""
    head_dim: int
    """Width of one head (``head_dim``, else ``hidden_size // num_heads``)."""
    vocab_size: int
    """Vocabulary size (rows of the embedding and of the output head)."""
    tie_word_embeddings: bool = False
    """Whether the output head reuses the embedding matrix."""
    max_position_embeddings: int = 2048
    """Longest sequence the model was built for."""
    attention_bias: bool = False
    """Whether q/k/v projections carry biases (Qwen2 does)."""
    model_type: str = "llama"
    """The config's ``model_type``."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelShapeError(f"model {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelShapeError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` (as a dict) of a Llama-family model."""
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelShapeError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> int:
            if key not in config:
                raise ModelShapeError(f"model config lacks {key!r}")
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelShapeError(f"model config {key!r} must be an integer, got {value!r}")
            return value

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or (hidden // heads if heads > 0 else 0)
        return cls(
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            model_type=str(model_type),
        )

    @property
    def q_dim(self) -> int:
        """Output width of q_proj (all query heads)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Output width of k_proj and of v_proj."""
        return self.num_kv_heads * self.head_dim

    def linear_shape(self, name: str) -> tuple[int, int]:
        """(in features, out features) of the decoder layer's linear ``name``."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if name not in shapes:
            raise ModelShapeError(
                f"unknown target module {name!r}; valid: {', '.join(LINEAR_NAMES)}"
            )
        return shapes[name]

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer that take part in matmuls."""
        return sum(a * b for a, b in map(self.linear_shape, LINEAR_NAMES))

    @property
    def layer_params(self) -> int:
        """All parameters of one decoder layer (matmul weights, biases, two norms)."""
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return self.layer_matmul_params + bias + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Parameters of the token embedding (and of an untied output head)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Parameters of the whole model, counted once when embeddings are tied."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + self.embedding_params + head + self.hidden_size
