"""The shape of a decoder-only language model, read from its Hugging Face config.json.

The planner needs sizes, not weights: how many decoder layers there are and how big each
one is, plus the embedding and the output head. Every family the worker slices
(`relaytrain_contract.families`: Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3/4, Mixtral,
Qwen-MoE, GPT-OSS, OLMo 2, Granite) has attention with grouped key/value heads and a gated
MLP, or a mixture of such MLPs (experts) behind a router, so one formula covers them, with
what differs per family read from the config the way transformers' config classes read it
(transformers 5.23, the worker's; `tests/unit/test_planner_meta.py` compares every family's
count with a meta-device build of its transformers model):

- norms: two per layer; Gemma 2/3 four (sandwich norms); Qwen3, Qwen3-MoE and Gemma 3 add
  q/k norms of one head's width, OLMo 2 q/k norms over all heads and no input norm;
- biases: q/k/v always on Qwen2, `qkv_bias` on Qwen2-MoE; on the other families that take
  `attention_bias` it biases q, k, v and o; `mlp_bias` (Llama, Granite); GPT-OSS's attention
  sinks (one per head), router bias and expert biases;
- experts: an MoE layer holds every expert (`expert_params`) but a token multiplies by
  `num_experts_per_tok` of them, plus the router and Qwen2-MoE's gated shared expert
  (`active_matmul_params`); Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step` make
  some layers dense (`dense_intermediate_size`);
- attention windows per layer (`attention_windows`): `layer_types` when the config has it,
  else each family's default (Gemma 2 and GPT-OSS alternate sliding and full layers, Gemma 3
  has `sliding_window_pattern` - 1 sliding layers per full one, Mistral/Mixtral/Phi-3 slide
  every layer when `sliding_window` is set, Qwen's `use_sliding_window` with
  `max_window_layers`).

Layers that differ (sliding or full; an MoE layer or a dense one) are priced by the mean
for compute and by the largest for memory: the search splits layers as if they were equal
(planner/search.py), so a stage's memory is never under-estimated.
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

__all__ = [
    "EAGER_ATTENTION",
    "EXPERT_NAMES",
    "FUSED_NAMES",
    "LINEAR_NAMES",
    "SUPPORTED_MODEL_TYPES",
    "ModelShape",
    "ModelShapeError",
]

#: Families whose q/k/v projections carry biases: always (Qwen2), or as a config key says
#: (Qwen2-MoE's `qkv_bias`); their o_proj never has one.
_QKV_BIASED = {"qwen2": None, "qwen2_moe": "qkv_bias"}
#: Families whose q, k, v and o projections all take `attention_bias` (default False).
_ATTENTION_BIAS = {
    "llama", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt_oss", "olmo2", "granite",
    "qwen3_moe",
}  # fmt: skip
#: Families whose config class ties the head to the embedding when config.json is silent
#: (google/gemma-2-27b's config.json does not say).
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text"}
#: Families whose gate/up/down projections take `mlp_bias`.
_MLP_BIAS = {"llama", "granite"}
#: Where each MoE family keeps its expert count.
_EXPERT_KEYS = ("num_local_experts", "num_experts")
#: Fused modules (Phi-3): name -> the Llama linears it holds side by side.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Fused projections (Phi-3/4) a LoRA target may name; priced as the projections they fuse.
FUSED_NAMES = tuple(_FUSED)
#: The expert weights a LoRA target may name (peft's `target_parameters`, 3-D tensors of
#: shape experts x in x out): name -> the Llama linears each expert's slice holds.
EXPERT_NAMES = ("experts.gate_up_proj", "experts.down_proj")
#: Families whose layers slide every layer when the config sets `sliding_window`, and the
#: window their config class assumes when config.json leaves the key out.
_SLIDE_ALL = {"mistral": 4096, "mixtral": None, "phi3": None}
#: Families that alternate: (pattern key, default pattern, default window).
_ALTERNATE = {"gemma2": (None, 2, 4096), "gpt_oss": (None, 2, 128), "gemma3_text":
              ("sliding_window_pattern", 6, 4096)}  # fmt: skip
#: Families the worker runs with eager attention (relaytrain_worker.model.families: sdpa has no
#: logit soft-capping or attention sinks), which materialises every score.
EAGER_ATTENTION = frozenset({"gemma2", "gpt_oss"})


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
    norm_params: int | None = None
    """Norm weights of one decoder layer (None: two of ``hidden_size``)."""
    other_params: int = 0
    """Parameters of one decoder layer besides its matmul weights, q/k/v biases and norms:
    o_proj and MLP biases, attention sinks, router and expert biases (GPT-OSS)."""
    dense_layers: int = 0
    """Layers of an MoE model whose MLP is dense (Qwen-MoE ``mlp_only_layers``)."""
    dense_intermediate_size: int = 0
    """MLP width of those dense layers (``intermediate_size``)."""
    attention_windows: tuple[int, ...] = ()
    """Per decoder layer, the keys a query sees at most (0: every earlier key); empty: all
    layers attend fully."""
    logit_softcapping: bool = False
    """Whether the output logits are soft-capped (``final_logit_softcapping``; Gemma 2/3)."""

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
        for name in (
            "num_experts",
            "experts_per_token",
            "shared_expert_size",
            "other_params",
            "dense_layers",
            "dense_intermediate_size",
        ):
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
        if self.dense_layers > self.num_layers:
            raise ModelShapeError(
                f"dense layers ({self.dense_layers}) exceed the layers ({self.num_layers})"
            )
        if self.attention_windows and len(self.attention_windows) != self.num_layers:
            raise ModelShapeError(
                f"layer_types names {len(self.attention_windows)} layers, the model has "
                f"{self.num_layers}"
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
        layers = need("num_hidden_layers")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or (hidden // heads if heads > 0 else 0)
        experts = per_token = shared = dense = 0
        intermediate = need("intermediate_size")
        dense_width = 0
        if family(model_type).moe:
            key = next((k for k in _EXPERT_KEYS if k in config), _EXPERT_KEYS[0])
            experts, per_token = need(key), need("num_experts_per_tok")
            if "moe_intermediate_size" in config:
                dense_width, intermediate = intermediate, need("moe_intermediate_size")
                dense = sum(not _sparse(config, i) for i in range(layers))
            shared = int(config.get("shared_expert_intermediate_size") or 0)
        if model_type in _QKV_BIASED:
            bias_key = _QKV_BIASED[model_type]
            qkv_bias = bool(config.get(bias_key, True)) if bias_key else True
        else:
            default = model_type == "gpt_oss"  # its config class defaults attention_bias on
            qkv_bias = model_type in _ATTENTION_BIAS and bool(config.get("attention_bias", default))
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        norms = 2 * hidden
        if model_type in ("gemma2", "gemma3_text"):
            norms = 4 * hidden
        if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            norms += 2 * head_dim
        if model_type == "olmo2":
            norms += q_dim + kv_dim
        other = hidden if qkv_bias and model_type in _ATTENTION_BIAS else 0  # o_proj's bias
        if model_type in _MLP_BIAS and config.get("mlp_bias"):
            other += 2 * intermediate + hidden
        if model_type == "gpt_oss":
            # Attention sinks, the router's bias, each expert's gate_up and down biases.
            other += heads + experts + experts * (2 * intermediate + hidden)
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(
                config.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)
            ),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            attention_bias=qkv_bias,
            model_type=str(model_type),
            num_experts=experts,
            experts_per_token=per_token,
            shared_expert_size=shared,
            norm_params=norms,
            other_params=other,
            dense_layers=dense,
            dense_intermediate_size=dense_width if dense else 0,
            attention_windows=_windows(config, str(model_type), layers),
            logit_softcapping=bool(config.get("final_logit_softcapping")),
        )

    @property
    def q_dim(self) -> int:
        """Output width of q_proj (all query heads)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Output width of k_proj and of v_proj."""
        return self.num_kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts > 0

    @property
    def eager_attention(self) -> bool:
        """Whether the worker runs this family's attention eagerly (every score materialised)."""
        return self.model_type in EAGER_ATTENTION

    def linear_shape(self, name: str) -> tuple[int, int]:
        """(in features, out features) of the decoder layer's linear ``name``: a Llama name,
        a fused one (``qkv_proj``, ``gate_up_proj``), or one expert's slice of an expert
        weight (``experts.gate_up_proj``, ``experts.down_proj``); an MLP name is one
        expert's."""
        if name in _FUSED:
            parts = [self.linear_shape(p) for p in _FUSED[name]]
            return parts[0][0], sum(out for _, out in parts)
        if name in EXPERT_NAMES:
            return self.linear_shape(name.removeprefix("experts."))
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
        return self.shared_linear_params + self.router_params

    @property
    def shared_linear_params(self) -> int:
        """The shared expert's three linears and its one-output gate (Qwen2-MoE; 0: none)."""
        h = self.hidden_size
        return 3 * h * self.shared_expert_size + h if self.shared_expert_size else 0

    @property
    def router_params(self) -> int:
        """The router's weight (experts x hidden) of an MoE layer; 0 in a dense model."""
        return self.hidden_size * self.num_experts

    @property
    def expert_params(self) -> int:
        """Every expert's weights in one MoE layer (3-D parameters, not ``nn.Linear``s)."""
        return self.num_experts * self._mlp_params

    @property
    def moe_layers(self) -> int:
        """Decoder layers whose MLP is a mixture of experts."""
        return self.num_layers - self.dense_layers if self.moe else 0

    @property
    def _dense_mlp_params(self) -> int:
        width = self.dense_intermediate_size or self.intermediate_size
        return 3 * self.hidden_size * width

    @property
    def layer_linear_params(self) -> int:
        """Weights of one decoder layer held in ``nn.Linear`` modules (what qlora quantises):
        attention, and the dense MLP or the shared expert. The largest layer's."""
        if not self.moe:
            return self._attention_params + self._mlp_params
        moe = self._attention_params + self.shared_linear_params
        dense = self._attention_params + self._dense_mlp_params if self.dense_layers else 0
        return moe if moe + self.expert_params + self.router_params >= dense else dense

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer that take part in matmuls (every expert's); the
        largest layer's when MoE and dense layers mix."""
        if not self.moe:
            return self._attention_params + self._mlp_params
        moe = self._attention_params + self.expert_params + self._shared_params
        dense = self._attention_params + self._dense_mlp_params if self.dense_layers else 0
        return max(moe, dense)

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies by in one MoE decoder layer (its routed experts, the
        shared expert and the router); a dense layer's in a dense model."""
        experts = self.experts_per_token if self.num_experts else 1
        return self._attention_params + experts * self._mlp_params + self._shared_params

    @property
    def mean_active_matmul_params(self) -> float:
        """Weights one token multiplies by, averaged over the decoder layers."""
        if not self.dense_layers:
            return float(self.active_matmul_params)
        dense = self._attention_params + self._dense_mlp_params
        moe = self.active_matmul_params * self.moe_layers
        return (moe + dense * self.dense_layers) / self.num_layers

    @property
    def layer_params(self) -> int:
        """All parameters of one decoder layer (matmul weights, biases, norms, sinks)."""
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        norms = 2 * self.hidden_size if self.norm_params is None else self.norm_params
        return self.layer_matmul_params + bias + norms + self.other_params

    @property
    def embedding_params(self) -> int:
        """Parameters of the token embedding (and of an untied output head)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Parameters of the whole model, counted once when embeddings are tied."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        layers = self.num_layers * self.layer_params
        if self.dense_layers:  # layer_params is the larger (MoE) layer's
            dense = self._attention_params + self._dense_mlp_params
            layers -= self.dense_layers * (self.layer_matmul_params - dense)
        return layers + self.embedding_params + head + self.hidden_size

    def attention_pairs(self, sequence_length: int) -> float:
        """(query, key) pairs one sequence's causal attention scores, averaged over the
        layers: s²/2 for a full layer, s·w − w²/2 for a layer sliding over w < s keys."""
        s = float(sequence_length)
        full = s * s / 2
        if not self.attention_windows:
            return full
        total = 0.0
        for w in self.attention_windows:
            total += full if not w or w >= s else s * w - w * w / 2
        return total / self.num_layers


def _sparse(config: Mapping[str, Any], layer: int) -> bool:
    """Whether Qwen-MoE decoder layer ``layer`` is an MoE layer (transformers' rule)."""
    only = config.get("mlp_only_layers") or ()
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in only and (layer + 1) % step == 0


def _windows(config: Mapping[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
    """Per layer, the sliding window (0: full attention), as the family's config class
    derives it; () when every layer attends fully."""
    window = config.get("sliding_window", _SLIDE_ALL.get(model_type, 4096))
    if model_type in _ALTERNATE:
        key, pattern, window = _ALTERNATE[model_type]
        window = config.get("sliding_window", window)
        pattern = int(config.get(key, pattern) if key else pattern)
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    elif model_type in _SLIDE_ALL:
        kinds = ["sliding_attention"] * layers
    elif model_type in ("qwen2", "qwen3"):
        start = int(config.get("max_window_layers", 28))
        slide = config.get("use_sliding_window", False)
        kinds = ["sliding_attention" if slide and i >= start else "full_attention"
                 for i in range(layers)]  # fmt: skip
    elif model_type == "qwen2_moe":
        stop = int(config.get("max_window_layers", 28))
        slide = config.get("use_sliding_window", False)
        kinds = ["sliding_attention" if slide and (i + 1) % 2 and i < stop else "full_attention"
                 for i in range(layers)]  # fmt: skip
    elif model_type == "qwen3_moe":
        kinds = ["sliding_attention" if config.get("use_sliding_window") else "full_attention"]
        kinds *= layers
    else:
        return ()
    types = config.get("layer_types")
    if isinstance(types, list) and model_type not in _SLIDE_ALL:
        kinds = [str(t) for t in types]
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return ()
    out = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    return out if any(out) else ()
