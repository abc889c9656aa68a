"""A stage: a contiguous slice of a Hugging Face causal LM, loaded alone.

The architecture is built from config.json on the meta device (no memory), pruned to
this stage's decoder layers (plus the embedding on stage 0 and the final norm and head
on the last stage; the rotary embedding everywhere), and then only the tensors the
slice keeps are read from the safetensors shards. Layers stay under their global
names (`model.layers.<global index>.…`) by holding them in a ModuleDict keyed by the
global index, so checkpoints, LoRA names and the exported adapter line up with the
unsplit model without renaming.

The forward pass repeats the model's own forward (embedding → masks → rotary →
layers → norm → head) with transformers' own mask functions, so a pipeline of
slices computes bit-for-bit what the unsplit model computes in fp32.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from relaytrain_worker.shards import ModelLoadError, check_shard, read_index

BUILD_LOCK = threading.RLock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SliceSpec:
    """Which part of the model a stage holds."""

    layer_start: int
    """First global decoder layer (inclusive)."""
    layer_end: int
    """Last global decoder layer (exclusive)."""
    first: bool
    """Holds the token embedding and takes token ids."""
    last: bool
    """Holds the final norm and the output head and returns logits."""


def load_config(model_dir: Path) -> PretrainedConfig:
    """Read config.json; the error names the directory when it is not a model."""
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face model?)")
    config: PretrainedConfig = AutoConfig.from_pretrained(str(model_dir))
    # sdpa is transformers' default; pin it so every stage and the reference agree.
    config._attn_implementation = "sdpa"
    return config


class StageModel(nn.Module):
    """The modules of one stage and the forward pass over them."""

    def __init__(self, model: nn.Module, config: PretrainedConfig, spec: SliceSpec) -> None:
        super().__init__()
        self.model = model
        self.config = config
        self.spec = spec

    @property
    def inner(self) -> Any:
        """The decoder body (`LlamaModel`, `Qwen2Model`, ...)."""
        return self.model.model

    def layer_items(self) -> list[tuple[int, nn.Module]]:
        """(global index, decoder layer) in order."""
        return [(int(k), v) for k, v in self.inner.layers.items()]

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Token ids (stage 0) or hidden states in; hidden states or logits (last) out."""
        inner = self.inner
        hidden = inner.embed_tokens(x) if self.spec.first else x
        masks = _masks(self.config, hidden, attention_mask, position_ids)
        position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
        for index, layer in self.layer_items():
            hidden = layer(
                hidden,
                attention_mask=masks[_layer_type(self.config, index)],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if self.spec.last:
            hidden = inner.norm(hidden)
            head: Any = self.model.lm_head
            return head(hidden)  # type: ignore[no-any-return]
        return hidden


def _layer_type(config: PretrainedConfig, index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return str(layer_types[index])
    # Mistral applies its sliding window on every layer when one is configured.
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _masks(
    config: PretrainedConfig,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> dict[str, Any]:
    """The same mask objects the unsplit model builds (causal + padding, maybe sliding)."""
    kwargs: dict[str, Any] = {
        "config": config,
        "inputs_embeds": hidden,
        "attention_mask": attention_mask,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    masks: dict[str, Any] = {"full_attention": create_causal_mask(**kwargs)}
    types = {_layer_type(config, i) for i in range(config.num_hidden_layers)}
    if "sliding_attention" in types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def build_stage_model(model_dir: Path, spec: SliceSpec, dtype: str = "float32") -> StageModel:
    """Build the slice on the meta device and load only its tensors from the shards."""
    # init_empty_weights patches nn.Module process-wide: while it is active, a parameter
    # another thread registers lands on the meta device. In-process pipelines (tests,
    # benchmarks) hold BUILD_LOCK around every module construction.
    with BUILD_LOCK:
        return _build_stage_model(model_dir, spec, dtype)


def _build_stage_model(model_dir: Path, spec: SliceSpec, dtype: str) -> StageModel:
    config = load_config(model_dir)
    n_layers = int(config.num_hidden_layers)
    if spec.layer_end > n_layers or spec.layer_start < 0 or spec.layer_start >= spec.layer_end:
        raise ModelLoadError(
            f"stage asks for layers [{spec.layer_start}, {spec.layer_end}) but the model in "
            f"{model_dir} has {n_layers} decoder layers (valid: 0..{n_layers})"
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])  # type: ignore[no-untyped-call]
    inner = model.model
    inner.layers = nn.ModuleDict(
        {str(i): inner.layers[i] for i in range(spec.layer_start, spec.layer_end)}
    )
    if not spec.first:
        inner.embed_tokens = None
    if not spec.last:
        inner.norm = None
        model.lm_head = None
    if not (spec.first and spec.last):
        # A slice ties nothing inside itself (the shared weight is held by two processes);
        # peft's tie detection would otherwise look for the embedding this slice lacks.
        model._tied_weights_keys = None

    wanted = list(model.state_dict().keys())
    index = read_index(model_dir)
    sources = {name: _source_name(name, index, tied) for name in wanted}
    missing = sorted(src for src in sources.values() if src not in index)
    if missing:
        raise ModelLoadError(
            f"{model_dir}: the checkpoint lacks {len(missing)} tensor(s) this stage needs, "
            f"e.g. {missing[0]!r}"
        )
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, src in sources.items():
        by_shard[index[src]].append(name)
    state: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        path = model_dir / shard
        check_shard(path)
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                state[name] = handle.get_tensor(sources[name]).to(DTYPES[dtype])
    model.load_state_dict(state, strict=True, assign=True)
    if tied and spec.first and spec.last:
        model.lm_head.weight = inner.embed_tokens.weight
    model.train()
    stage = StageModel(model, config, spec)
    for param in stage.parameters():
        param.requires_grad_(False)
    return stage


def _source_name(name: str, index: dict[str, str], tied: bool) -> str:
    """The checkpoint tensor that fills parameter `name` (a tied head reads the embedding)."""
    if name == "lm_head.weight" and tied and name not in index:
        return "model.embed_tokens.weight"
    return name


def model_layer_count(model_dir: Path) -> int:
    """Decoder layers of the model in `model_dir`, from its config.json alone."""
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
