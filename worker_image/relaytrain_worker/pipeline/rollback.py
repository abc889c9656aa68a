"""A stage's checkpoint files: what it saves (`stage_files`) and how it takes them back —
its own files of a commit (`load_files`), the files of a commit another split wrote, by
parameter name (`load_by_name`), or the state before step 0 (`reset_weights`). With the
exact LoRA merge the folded frozen weights (`lora_merge.Fold`) are part of that state, in
`FOLD_FILE`: every restore sets them, from the file or back to the model file's.

Weights and optimizer state are keyed by global parameter name, never by position, so any
split restores any checkpoint (DESIGN.md, "Several pipelines").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import safetensors.torch
import torch
from relaytrain_contract import StageConfig
from torch import nn

from relaytrain_worker.model.lora_merge import FOLD_FILE, Fold
from relaytrain_worker.model.methods import init_lora
from relaytrain_worker.model.model_slice import StageModel, build_stage_model
from relaytrain_worker.model.training import load_merged_state, load_state_bytes, state_bytes
from relaytrain_worker.state.checkpoint import CorruptCheckpoint
from relaytrain_worker.state.export import TRAINABLE_FILE

STATE_FILE = "state.pt"
"""Optimizer, schedule and RNG state, by parameter name."""
META_FILE = "meta.json"
"""The step, data position and layers of a stage's save."""

Trainable = Sequence[tuple[str, nn.Parameter]]


def param_names(trainable: Trainable) -> list[str]:
    """Global names of the trainable parameters, in the optimizer's order: its state is
    saved under them, not by position (DESIGN.md: any split restores any checkpoint)."""
    return [name for name, _ in trainable]


def stage_files(
    cfg: StageConfig,
    step: int,
    trainable: Trainable,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    fold: Fold | None = None,
) -> dict[str, bytes]:
    """This stage's files of checkpoint `step`: trainable weights, state and meta (and the
    fold, when an exact merge has folded anything)."""
    tensors = {name: p.detach().contiguous() for name, p in trainable}
    meta = {
        "step": step, "dataStep": step, "stage": cfg.stage.index,
        "layerStart": cfg.stage.layer_start, "layerEnd": cfg.stage.layer_end,
    }  # fmt: skip
    files = {
        TRAINABLE_FILE: safetensors.torch.save(tensors),
        STATE_FILE: state_bytes(optimizer, scheduler, param_names(trainable)),
        META_FILE: json.dumps(meta).encode(),
    }
    if fold:
        files[FOLD_FILE] = safetensors.torch.save(fold.tensors())
    return files


def _load_fold(fold: Fold | None, parts: Sequence[dict[str, bytes]]) -> None:
    """Set `fold` from the parts' fold files (none: every layer its model file's weight)."""
    if fold is None:
        return
    tensors: dict[str, torch.Tensor] = {}
    for files in parts:
        if FOLD_FILE in files:
            tensors.update(safetensors.torch.load(files[FOLD_FILE]))
    fold.load(tensors)


def load_files(
    files: dict[str, bytes],
    trainable: Trainable,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    fold: Fold | None = None,
) -> None:
    """Take the weights and state of this stage's own files of a commit."""
    tensors = safetensors.torch.load(files[TRAINABLE_FILE])
    with torch.no_grad():
        for name, param in trainable:
            param.copy_(tensors[name])
    _load_fold(fold, [files])
    load_state_bytes(files[STATE_FILE], optimizer, scheduler, param_names(trainable))
    optimizer.zero_grad(set_to_none=True)


def load_by_name(
    parts: Sequence[dict[str, bytes]],
    trainable: Trainable,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    step: int,
    source: int,
    fold: Fold | None = None,
) -> None:
    """Take the weights and state of every trainable name from `parts`, the files of the
    stages of pipeline `source` that hold this stage's layers in commit `step` (their split
    may differ). CorruptCheckpoint when a name is in none of them."""
    tensors: dict[str, torch.Tensor] = {}
    for files in parts:
        tensors.update(safetensors.torch.load(files[TRAINABLE_FILE]))
    names = param_names(trainable)
    missing = [name for name in names if name not in tensors]
    if missing:
        raise CorruptCheckpoint(
            f"step {step} holds no {missing[0]} (and {len(missing) - 1} more) in the "
            f"pipeline-{source} stages that should hold this stage's layers"
        )
    with torch.no_grad():
        for name, param in trainable:
            param.copy_(tensors[name])
    _load_fold(fold, parts)
    load_merged_state([f[STATE_FILE] for f in parts], optimizer, scheduler, names)
    optimizer.zero_grad(set_to_none=True)


def reset_weights(
    cfg: StageConfig, model_dir: Path, stage: StageModel, fold: Fold | None = None
) -> None:
    """The weights before step 0: a fresh adapter on the model file's weights, or the base
    weights re-read (`full`)."""
    if fold is not None:
        fold.clear()
    if cfg.method.type == "full":
        fresh = build_stage_model(model_dir, stage.spec, cfg.model.dtype)
        fresh_params = dict(fresh.model.named_parameters())
        with torch.no_grad():
            for name, param in stage.model.named_parameters():
                param.copy_(fresh_params[name])
    else:
        init_lora(stage.model, cfg.training.seed)


def rng_seed(cfg: StageConfig, pipeline: int, step: int) -> int:
    """The dropout RNG's seed of this stage at `step`, from the job's seed and its place:
    pipeline 0's stages start as a lone pipeline's do; the others differ (their
    micro-batches differ)."""
    return cfg.training.seed * 131 + cfg.stage.index + 7919 * pipeline + 104729 * step
