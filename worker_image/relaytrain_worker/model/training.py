"""Optimizer, learning-rate schedule and the state a checkpoint must carry."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from relaytrain_contract import TrainingSpec
from torch import nn
from transformers import get_scheduler

_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def make_optimizer(
    trainable: list[tuple[str, nn.Parameter]], spec: TrainingSpec
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the stage's trainable parameters and the job's warm-up + decay schedule."""
    params = [p for _, p in trainable]
    # foreach=False: the per-tensor path gives the same bits however the parameters
    # are grouped into stages, which the equivalence tests rely on.
    optimizer = torch.optim.AdamW(
        params, lr=spec.learning_rate, weight_decay=spec.weight_decay, foreach=False
    )
    scheduler = get_scheduler(
        _SCHEDULES[spec.schedule],
        optimizer,
        num_warmup_steps=spec.warmup_steps,
        num_training_steps=spec.steps,
    )
    return optimizer, scheduler


def optimizer_step(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> None:
    """Apply the (already clipped) gradients and advance the schedule."""
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name instead of position.

    `names` are the global names of the optimizer's parameters, in its order (one group).
    Per-parameter state (AdamW's step, exp_avg, exp_avg_sq) goes under the name; the
    group's hyperparameters once. Any split holding some of the names can take their state
    from it (`load_named_optimizer_state`), so a checkpoint saved under one layer split
    restores under another.
    """
    sd = optimizer.state_dict()
    (group,) = sd["param_groups"]
    if len(group["params"]) != len(names):
        raise ValueError(f"{len(names)} names for {len(group['params'])} parameters")
    by_name = {names[i]: sd["state"][index] for i, index in enumerate(group["params"])
               if index in sd["state"]}  # fmt: skip
    return {"group": {k: v for k, v in group.items() if k != "params"}, "state": by_name}


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Sequence[str], named: Mapping[str, Any]
) -> None:
    """Load what `named_optimizer_state` wrote (of this or another split) for `names`; a
    name without state (never stepped) starts fresh."""
    sd = optimizer.state_dict()
    (group,) = sd["param_groups"]
    if len(group["params"]) != len(names):
        raise ValueError(f"{len(names)} names for {len(group['params'])} parameters")
    state = {index: named["state"][n] for n, index in zip(names, group["params"], strict=True)
             if n in named["state"]}  # fmt: skip
    optimizer.load_state_dict(
        {"state": state, "param_groups": [{**named["group"], "params": group["params"]}]}
    )


def state_bytes(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    names: Sequence[str] | None = None,
) -> bytes:
    """Optimizer, schedule and RNG state as one torch-serialised blob.

    With `names` (the optimizer's parameters' global names, in order) the optimizer state is
    keyed by name (`named_optimizer_state`); without, by position (torch's own state_dict).
    The RNG state is the CPU generator's and, where CUDA is up, every CUDA device's (dropout
    on a GPU draws from the device's generator, not the CPU's).
    """
    buf = io.BytesIO()
    state: dict[str, Any] = {
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    if names is None:
        state["optimizer"] = optimizer.state_dict()
    else:
        state["optimizer_by_name"] = named_optimizer_state(optimizer, names)
    # A process that never touched CUDA drew nothing from it, and asking would initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, buf)
    return buf.getvalue()


def load_state_bytes(
    data: bytes,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    names: Sequence[str] | None = None,
) -> None:
    """Restore what `state_bytes` wrote (CUDA generators too, when it saved them and this
    process has as many devices). A state keyed by name needs `names`; one keyed by
    position (written without names, as stages did before) loads either way."""
    state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if "optimizer_by_name" in state:
        if names is None:
            raise ValueError("this optimizer state is keyed by name: pass the parameters' names")
        load_named_optimizer_state(optimizer, names, state["optimizer_by_name"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    cuda = state.get("cuda_rng")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def load_merged_state(
    parts: Sequence[bytes],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    names: Sequence[str],
) -> None:
    """Restore the optimizer and schedule from what several stages' `state_bytes` wrote
    (keyed by name): another split's stages that together hold `names` (a pipeline other
    than the one that saved). The schedule is the first part's (every stage steps it
    alike); the RNG is left alone (it was another stage's). ValueError when a part's
    optimizer state is keyed by position."""
    named: dict[str, Any] = {}
    group: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    for data in parts:
        state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if "optimizer_by_name" not in state:
            raise ValueError("a stage's optimizer state is keyed by position, not by name")
        by_name = state["optimizer_by_name"]
        named.update(by_name["state"])
        group = group if group is not None else by_name["group"]
        schedule = schedule if schedule is not None else state["scheduler"]
    if group is None or schedule is None:
        raise ValueError("no optimizer state to restore")
    load_named_optimizer_state(optimizer, names, {"group": group, "state": named})
    scheduler.load_state_dict(schedule)
