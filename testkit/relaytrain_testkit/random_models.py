"""Random models built straight on a device from a config.json: no checkpoint is written
or read, nothing is downloaded (a Llama-3.1-8B-shaped model is on a GPU in seconds).

Every weight is drawn from a generator seeded by (seed, its global name) on the device it
lives on, so a stage's slice holds exactly the weights the unsplit model holds under the
same names: pipelines of random slices and the random unsplit model train the same model
(on one device type; a CPU and a GPU generator draw different numbers). Matrices and
embeddings are drawn from N(0, initializer_range²), as transformers initialises them;
vectors named ``…bias`` are zeros, other vectors (norm weights) ones. A tied head is drawn
under the embedding's name, so a last stage that holds it alone holds the same numbers.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from relaytrain_worker.model.model_slice import (
    BUILD_LOCK,
    DTYPES,
    EMBEDDING,
    HEAD,
    SliceSpec,
    StageModel,
    build_stage_model,
    load_config,
)
from torch import nn


def config_dir(out: Path, config: Mapping[str, Any]) -> Path:
    """A model directory holding only `config` as config.json (what the builders read)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(config), indent=2))
    return out


def random_stage(
    model_dir: Path, spec: SliceSpec, *, dtype: str, device: str | torch.device, seed: int = 0
) -> StageModel:
    """The slice `spec` of the model whose config.json is in `model_dir`, its weights drawn
    on `device` (the worker's own builder, with the loading replaced)."""
    return build_stage_model(
        model_dir, spec, dtype, fill=partial(fill_random, device=torch.device(device), seed=seed)
    )


def random_model(
    model_dir: Path, *, dtype: str, device: str | torch.device, seed: int = 0
) -> nn.Module:
    """The unsplit transformers model with the same weights as `random_stage`'s slices,
    frozen and in training mode (for single-process references)."""
    from transformers import AutoModelForCausalLM

    # The stages' config: the same attention implementation (sdpa, or eager where needed).
    config = load_config(model_dir)
    with BUILD_LOCK, init_empty_weights(include_buffers=False):
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])  # type: ignore[no-untyped-call]
    fill_random(model, device=torch.device(device), seed=seed)
    if getattr(config, "tie_word_embeddings", False):
        model.get_submodule("lm_head").weight = model.get_submodule("model.embed_tokens").weight
    model.train()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def fill_random(model: nn.Module, *, device: torch.device, seed: int) -> None:
    """Put every parameter of `model` still on the meta device on `device`, drawn by name
    (see the module's docstring), and move the buffers there too (the rotary frequencies)."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            if param.device.type != "meta":
                continue
            data = torch.empty(param.shape, dtype=param.dtype, device=device)
            if param.dim() > 1:
                key = EMBEDDING if tied and name == HEAD else name
                gen = torch.Generator(device=device).manual_seed(_name_seed(seed, key))
                data.normal_(0.0, std, generator=gen)
            else:
                data.fill_(0.0 if name.endswith("bias") else 1.0)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(data, requires_grad=False))
        # Buffers alone: a tied head still points at the meta embedding until the caller
        # ties it again, and moving the whole model would try to copy that.
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)


def copied_stage(
    model_dir: Path, spec: SliceSpec, state: Mapping[str, torch.Tensor], *, dtype: str
) -> StageModel:
    """The slice `spec` of a model held in memory, `state` its parameters by global name
    (an unsplit model's `named_parameters`, e.g. a `random_model` trained in place): each
    stage holds copies of exactly those weights, on the device and in the dtype they have."""
    return build_stage_model(model_dir, spec, dtype, fill=partial(fill_copied, state=state))


def fill_copied(model: nn.Module, *, state: Mapping[str, torch.Tensor]) -> None:
    """Put every parameter of `model` still on the meta device in place as a copy of
    `state`'s tensor of its name, and its buffers on that tensors' device."""
    device = next(iter(state.values())).device
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            if param.device.type != "meta":
                continue
            if name not in state or state[name].shape != param.shape:
                raise ValueError(f"{name} {tuple(param.shape)} is not among the given weights")
            owner, _, attr = name.rpartition(".")
            data = state[name].detach().to(param.dtype).clone()
            setattr(model.get_submodule(owner), attr, nn.Parameter(data, requires_grad=False))
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
