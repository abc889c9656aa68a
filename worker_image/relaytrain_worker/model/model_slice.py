"""A stage: a contiguous slice of a Hugging Face causal LM, loaded alone.

The architecture is built from config.json on the meta device (no memory), pruned to
this stage's decoder layers (plus the embedding on stage 0 and the final norm and head
on the last stage; the rotary embedding everywhere), and then only the tensors the
slice keeps are read from the safetensors shards. Layers stay under their global
names (`model.layers.<global index>.…`) by holding them in a ModuleDict keyed by the
global index, so checkpoints, LoRA names and the exported adapter line up with the
unsplit model without renaming.

Checkpoint tensors become parameters by transformers' own conversion rules for the
family (a Mixtral or Qwen-MoE checkpoint holds one tensor per expert, the model one 3-D
tensor per layer and projection): a stage reads exactly the checkpoint tensors its
parameters are made of, and transformers' loader merges them.

The forward pass repeats the model's own forward (embedding → masks → rotary →
layers → norm → head) with transformers' own modules and mask functions, plus the few
steps a family's forward does inline around them (`families`), so a pipeline of
slices computes bit-for-bit what the unsplit model computes in fp32.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    convert_and_load_state_dict_in_model,
    rename_source_key,
)
from transformers.modeling_utils import LoadStateDictConfig
from transformers.utils import logging as hf_logging

from relaytrain_worker.model import families
from relaytrain_worker.model.shards import ModelLoadError, check_shard, read_index

BUILD_LOCK = threading.RLock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


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
    """Read config.json; the error names the directory when it is not a model, and the
    model_type and the supported ones when no stage can slice it."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face model?)")
    # Checked before transformers reads it: a model_type transformers lacks is refused the same way.
    families.check_model_type(json.loads(path.read_text()).get("model_type"), model_dir)
    config: PretrainedConfig = AutoConfig.from_pretrained(str(model_dir))
    families.check_config(config, model_dir)
    # Pinned (sdpa, or eager where the family needs it) so every stage and the reference agree.
    config._attn_implementation = families.attention_implementation(config)
    return config


class StageModel(nn.Module):
    """The modules of one stage and the forward pass over them."""

    def __init__(self, model: nn.Module, config: PretrainedConfig, spec: SliceSpec) -> None:
        super().__init__()
        self.model = model
        self.config = config
        self.spec = spec
        self.steps = families.FORWARD[config.model_type]
        """What the family's forward does inline around its modules."""

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
        inner, config, steps = self.inner, self.config, self.steps
        hidden = families.embed(steps, inner, x) if self.spec.first else x
        layers = self.layer_items()
        kinds = {index: families.layer_type(config, index) for index, _ in layers}
        types = set(kinds.values())
        masks = families.masks(config, types, hidden, attention_mask, position_ids)
        rotary = families.rotary(steps, inner.rotary_emb, types, hidden, position_ids)
        for index, layer in layers:
            hidden = layer(
                hidden,
                attention_mask=masks[kinds[index]],
                position_embeddings=rotary[kinds[index]],
                position_ids=position_ids,
            )
        if self.spec.last:
            hidden = inner.norm(hidden)
            return families.logits(steps, config, self.model.lm_head, hidden)
        return hidden


def device_of(module: nn.Module) -> torch.device:
    """Where a module's parameters are (the CPU for one without any)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def build_stage_model(
    model_dir: Path,
    spec: SliceSpec,
    dtype: str = "float32",
    *,
    fill: Callable[[nn.Module], None] | None = None,
) -> StageModel:
    """Build the slice on the meta device and load only its tensors from the shards.

    ``fill`` replaces the loading: it gets the slice's transformers model, every parameter
    still on the meta device under its global name, and must put each one in place (random
    weights straight on a GPU for benchmarks: relaytrain_testkit.random_models); the model
    directory then needs only its config.json.
    """
    # init_empty_weights patches nn.Module process-wide: while it is active, a parameter
    # another thread registers lands on the meta device. In-process pipelines (tests,
    # benchmarks) hold BUILD_LOCK around every module construction.
    with BUILD_LOCK:
        return _build_stage_model(model_dir, spec, dtype, fill)


def _build_stage_model(
    model_dir: Path, spec: SliceSpec, dtype: str, fill: Callable[[nn.Module], None] | None
) -> StageModel:
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
    if fill is None:
        _load_tensors(model, model_dir, tied, DTYPES[dtype])
    else:
        fill(model)
    if tied and spec.first and spec.last:
        model.lm_head.weight = inner.embed_tokens.weight
    model.train()
    stage = StageModel(model, config, spec)
    for param in stage.parameters():
        param.requires_grad_(False)
    return stage


def _load_tensors(model: Any, model_dir: Path, tied: bool, dtype: torch.dtype) -> None:
    """Fill the slice's parameters from the checkpoint tensors they are made of.

    The family's conversion rules (transformers') give, for every checkpoint key, the
    parameter it becomes: the same name, a renamed one, or a merged one (Mixtral's
    `experts.<e>.w1` and `w3` into one `experts.gate_up_proj`). The keys whose parameter
    this slice holds are read and handed to transformers' loader, which merges them. A
    tied head without its own tensor reads the embedding's.
    """
    wanted = set(model.state_dict())
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    index = read_index(model_dir)
    targets = {key: rename_source_key(key, renamings, converters)[0] for key in index}
    sources = {key: key for key, target in targets.items() if target in wanted}
    covered = {targets[key] for key in sources}
    if tied and HEAD in wanted and HEAD not in covered:
        embedding = [key for key, target in targets.items() if target == EMBEDDING]
        if embedding:
            sources[HEAD] = embedding[0]  # the embedding's tensor, read under the head's name
            covered.add(HEAD)
    missing = sorted(wanted - covered)
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
                state[name] = handle.get_tensor(sources[name])
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call] # one "Loading weights" bar per stage is noise
    try:
        info, _ = convert_and_load_state_dict_in_model(
            model, state, LoadStateDictConfig(dtype=dtype, weight_mapping=[*renamings, *converters])
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    problems = [
        *(f"{name} was not loaded" for name in sorted(info.missing_keys & wanted)),
        *(
            f"{m[0]} is {m[1]} in the checkpoint, {m[2]} in the model"
            for m in sorted(info.mismatched_keys)
        ),
        *map(str, info.conversion_errors.values()),
        *info.error_msgs,
    ]
    if problems:
        raise ModelLoadError(f"{model_dir}: loading this stage's tensors failed: {problems[0]}")


def model_layer_count(model_dir: Path) -> int:
    """Decoder layers of the model in `model_dir`, from its config.json alone."""
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
