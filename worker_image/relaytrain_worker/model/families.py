"""What a slice repeats of each family's forward around its decoder layers.

A slice runs the family's own transformers modules: the embedding (Gemma's scaled
embedding included), the rotary embedding, every decoder layer — sandwich and q/k norms,
partial rotary, fused projections, attention sinks and soft-capping, experts and routers,
residual and attention multipliers all live inside those — the final norm and the head.
What no module holds is what `XModel.forward` and `XForCausalLM.forward` do inline between
them: which mask and which rotary embedding each layer gets, a multiplier on the embedding,
a transform of the logits. Those lines are repeated here per family, and nothing else is.

The attention implementation is chosen per family too: sdpa where the family's model
class supports it, else eager (sdpa has no attention sinks or logit soft-capping). The
experts implementation is transformers' default, the same in every stage and in the
unsplit model.

MoE routers: the auxiliary load-balancing loss (`output_router_logits`) is not added. The
training loss is the token cross-entropy the unsplit model returns by default
(`output_router_logits` defaults to false for every MoE family here, and a pretrained
router is frozen unless its weights are named as targets). Adding it exactly would need
every layer's router statistics of a micro-batch on the last stage before its backward (the
loss couples all layers: mean expert load over layers times mean router probability over
layers), i.e. one more exchange per micro-batch; a config that asks for it gets a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from relaytrain_contract.families import SUPPORTED_MODEL_TYPES, family
from transformers import PretrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from relaytrain_worker.model.shards import ModelLoadError

log = logging.getLogger("relaytrain.model")

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Forward:
    """The inline steps of one family's forward that a slice repeats."""

    embedding_multiplier: bool = False
    """Stage 0 multiplies the embedding by the model's `embedding_multiplier`
    (Granite: `GraniteModel.forward`)."""
    rotary_per_layer_type: bool = False
    """One rotary embedding per layer type, `rotary_emb(x, position_ids, layer_type)`
    (Gemma 3: local layers at 10k, global ones at 1M)."""
    sliding_when_configured: bool = False
    """No `layer_types`: every layer gets the sliding-window mask when `sliding_window` is
    set, else the causal one (Mistral, Mixtral, Phi-3, Qwen3-MoE pick one mask function)."""
    logit_softcapping: bool = False
    """The last stage soft-caps the logits, `cap * tanh(logits / cap)` with
    `final_logit_softcapping` when set (Gemma 2 and 3)."""
    logits_scaling: bool = False
    """The last stage divides the logits by `logits_scaling` (Granite)."""


PLAIN = Forward()
FORWARD: dict[str, Forward] = {
    "llama": PLAIN,
    "mistral": Forward(sliding_when_configured=True),
    "qwen2": PLAIN,  # layer_types
    "qwen3": PLAIN,  # layer_types
    "gemma": PLAIN,  # the scale is in GemmaTextScaledWordEmbedding
    "gemma2": Forward(logit_softcapping=True),
    "gemma3_text": Forward(rotary_per_layer_type=True, logit_softcapping=True),
    "phi3": Forward(sliding_when_configured=True),
    "mixtral": Forward(sliding_when_configured=True),
    "qwen2_moe": PLAIN,  # layer_types
    "qwen3_moe": Forward(sliding_when_configured=True),
    "gpt_oss": PLAIN,  # layer_types
    "olmo2": PLAIN,
    "granite": Forward(embedding_multiplier=True, logits_scaling=True),
}
assert tuple(FORWARD) == SUPPORTED_MODEL_TYPES, "one Forward per supported family"


def check_model_type(model_type: object, where: object) -> None:
    """ModelLoadError naming `model_type` and the supported ones unless it is one of them."""
    try:
        family(model_type)
    except ValueError as err:
        raise ModelLoadError(f"{where}: {err}") from None


def check_config(config: PretrainedConfig, where: object) -> Forward:
    """The family's Forward; ModelLoadError for a model the slices would compute wrongly."""
    check_model_type(config.model_type, where)
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(
            f"{where}: use_bidirectional_attention is set: an encoder, not a causal LM"
        )
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        raise ModelLoadError(
            f"{where}: the checkpoint is pre-quantized ({quantization}); stages load "
            "unquantized weights (method qlora quantizes on load)"
        )
    if getattr(config, "output_router_logits", False):
        log.warning(
            "Model %s asks for output_router_logits; the router's load-balancing loss is "
            "not added to the training loss (docs/worker.md, model families)",
            config.model_type,
        )
    return FORWARD[config.model_type]


def attention_implementation(config: PretrainedConfig) -> str:
    """sdpa where the family's model class supports it, else eager (Gemma 2, GPT-OSS)."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def layer_type(config: PretrainedConfig, index: int) -> str:
    """The attention kind of global layer `index`: its mask (and Gemma 3's rotary) key."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return str(layer_types[index])
    if FORWARD[config.model_type].sliding_when_configured and config.sliding_window is not None:
        return SLIDING
    return FULL


def masks(
    config: PretrainedConfig,
    types: set[str],
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> dict[str, Any]:
    """The mask objects the unsplit model builds, for the layer types in `types`.

    Packed rows (several documents, positions restarting at each) also get a
    same-document condition, so no token attends to another document; a sliding window
    then stays inside its document too, as positions rise by one within a document. Rows
    whose positions never restart get exactly the unsplit model's masks.
    """
    kwargs: dict[str, Any] = {
        "config": config,
        "inputs_embeds": hidden,
        "attention_mask": attention_mask,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    documents = document_ids(position_ids)
    if documents is not None:
        kwargs["and_mask_function"] = packed_sequence_mask_function(documents)
    makers = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
    return {kind: makers[kind](**kwargs) for kind in sorted(types)}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Per token, the index of its document in its row (a new one wherever the position does
    not follow the previous token's); None when no row holds more than one document.

    The boundaries travel with the position ids every stage receives: nothing else crosses
    the link for them. transformers derives them the same way when a model is called on
    packed rows without an attention mask (`find_packed_sequence_indices`); with a padding
    mask it would not, so the slices add the condition themselves.
    """
    found: torch.Tensor | None = find_packed_sequence_indices(position_ids)
    return found


def rotary(
    forward: Forward, rotary_emb: Any, types: set[str], hidden: torch.Tensor, position_ids: Any
) -> dict[str, Any]:
    """(cos, sin) per layer type: one pair for all, or one per type (Gemma 3)."""
    if forward.rotary_per_layer_type:
        return {kind: rotary_emb(hidden, position_ids, kind) for kind in sorted(types)}
    shared = rotary_emb(hidden, position_ids=position_ids)
    return dict.fromkeys(types, shared)


def embed(forward: Forward, inner: Any, ids: torch.Tensor) -> torch.Tensor:
    """Stage 0: token ids to the first layer's input."""
    hidden: torch.Tensor = inner.embed_tokens(ids)
    if forward.embedding_multiplier:
        hidden = hidden * inner.embedding_multiplier
    return hidden


def logits(
    forward: Forward, config: PretrainedConfig, head: Any, hidden: torch.Tensor
) -> torch.Tensor:
    """The last stage: normed hidden states to the logits the unsplit model returns."""
    out: torch.Tensor = head(hidden)
    cap = getattr(config, "final_logit_softcapping", None)
    if forward.logit_softcapping and cap is not None:
        out = out / cap
        out = torch.tanh(out)
        out = out * cap
    if forward.logits_scaling:
        out = out / config.logits_scaling
    return out
