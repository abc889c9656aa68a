"""The shape of a decoder-only language model, read from its Hugging Face config.json.

The planner needs sizes, not weights: how many decoder layers there are and how big each
one is, plus the embedding and the output head. Every family the worker slices
(`relaytrain_contract.families`: Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3/4, Mixtral,
Qwen-MoE, GPT-OSS, OLMo 2, Granite) has attention with grouped key/value heads and a gated
MLP, or a mixture of such MLPs (experts) behind a router, so one formula covers them.

Approximate, per family (the per-family cost model is a later step):
- norms are counted as two per layer (Gemma 2/3 have four, OLMo 2 and Qwen3 add q/k norms);
- an MoE model is planned as if every layer were an MoE layer (Qwen-MoE's
  `mlp_only_layers` and `decoder_sparse_step` make some dense); expert biases (GPT-OSS)
  are left out;
- `layer_matmul_params` of an MoE layer counts *every* expert (what its weights take in
  memory), so its compute is over-estimated by about experts / experts-per-token;
  `active_matmul_params` is what one token multiplies by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relaytrain_contract.families import (
    LINEAR_NAMES,
    SUPPORTED_MODEL_TYPES,
    family,
    unsupported_message,
)

__all__ = ["FUSED_NAMES", "LINEAR_NAMES", "SUPPORTED_MODEL_TYPES", "ModelShape", "ModelShapeError"]

#: Families whose q/k/v projections carry biases unless the config says otherwise.
_BIASED = {"qwen2": "attention_bias", "qwen2_moe": "qkv_bias", "gpt_oss": "attention_bias"}
#: Where each MoE family keeps its expert count.
_EXPERT_KEYS = ("num_local_experts", "num_experts")
#: Fused modules (Phi-3): name -> the Llama linears it holds side by side.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Fused projections (Phi-3/4) a LoRA target may name; priced as the projections they fuse.
FUSED_NAMES = tuple(_FUSED)


class ModelShapeError(ValueError):
    """A model config the planner cannot read; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a causal LM of a supported family."""

    num_layers: int
    """Decoder layers (``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream (``hidden_size``)."""
    intermediate_size: int
    """Width of the MLP (``intermediate_size``); of one expert in an MoE model
    (``moe_intermediate_size`` where the family has it)."""
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
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (``num_experts_per_tok``; 0: a dense model)."""
    shared_expert_size: int = 0
    """Width of the always-on shared expert's MLP (Qwen2-MoE; 0: none)."""

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
        for name in ("num_experts", "experts_per_token", "shared_expert_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelShapeError(f"model {name} must be a whole number, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ModelShapeError(
                f"num_experts_per_tok ({self.experts_per_token}) exceeds the number of "
                f"experts ({self.num_experts})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelShapeError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` (as a dict) of a supported family."""
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelShapeError(unsupported_message(model_type))
        quantization = config.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ModelShapeError(
                f"the checkpoint is pre-quantized ({method or 'quantization_config'}); stages "
                "load unquantized "
                "weights (bfloat16/float16/float32; method qlora quantizes on load)"
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
        experts = per_token = shared = 0
        intermediate_key = "intermediate_size"
        if family(model_type).moe:
            key = next((k for k in _EXPERT_KEYS if k in config), _EXPERT_KEYS[0])
            experts, per_token = need(key), need("num_experts_per_tok")
            if "moe_intermediate_size" in config:
                intermediate_key = "moe_intermediate_size"
            shared = int(config.get("shared_expert_intermediate_size") or 0)
        bias_key = _BIASED.get(model_type, "attention_bias")
        return cls(
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=need(intermediate_key),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            attention_bias=bool(config.get(bias_key, model_type in _BIASED)),
            model_type=str(model_type),
            num_experts=experts,
            experts_per_token=per_token,
            shared_expert_size=shared,
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
        """(in features, out features) of the decoder layer's linear ``name``: a Llama name,
        or a fused one (``qkv_proj``, ``gate_up_proj``); an MLP name is one expert's."""
        if name in _FUSED:
            parts = [self.linear_shape(p) for p in _FUSED[name]]
            return parts[0][0], sum(out for _, out in parts)
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
                f"unknown target module {name!r}; valid: {', '.join(LINEAR_NAMES + FUSED_NAMES)}"
            )
        return shapes[name]

    @property
    def _attention_params(self) -> int:
        return sum(a * b for a, b in map(self.linear_shape, LINEAR_NAMES[:4]))

    @property
    def _mlp_params(self) -> int:
        """One gated MLP (a dense layer's, or one expert's)."""
        return sum(a * b for a, b in map(self.linear_shape, LINEAR_NAMES[4:]))

    @property
    def _shared_params(self) -> int:
        """The shared expert's MLP and its gate (Qwen2-MoE), plus the router."""
        if not self.num_experts:
            return 0
        h = self.hidden_size
        shared = 3 * h * self.shared_expert_size + h if self.shared_expert_size else 0
        return shared + h * self.num_experts

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer that take part in matmuls (every expert's)."""
        experts = max(self.num_experts, 1)
        return self._attention_params + experts * self._mlp_params + self._shared_params

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies by in one decoder layer (its routed experts only)."""
        experts = self.experts_per_token if self.num_experts else 1
        return self._attention_params + experts * self._mlp_params + self._shared_params

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
