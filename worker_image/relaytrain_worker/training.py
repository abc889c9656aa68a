"""Optimizer, learning-rate schedule and the state a checkpoint must carry."""

from __future__ import annotations

import io
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
        params, lr=spec.learningRate, weight_decay=spec.weightDecay, foreach=False
    )
    scheduler = get_scheduler(
        _SCHEDULES[spec.schedule],
        optimizer,
        num_warmup_steps=spec.warmupSteps,
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


def state_bytes(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> bytes:
    """Optimizer, schedule and RNG state as one torch-serialised blob.

    The RNG state is the CPU generator's and, where CUDA is up, every CUDA device's (dropout
    on a GPU draws from the device's generator, not the CPU's).
    """
    buf = io.BytesIO()
    state: dict[str, Any] = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    # A process that never touched CUDA drew nothing from it, and asking would initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, buf)
    return buf.getvalue()


def load_state_bytes(
    data: bytes,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Restore what `state_bytes` wrote (CUDA generators too, when it saved them and this
    process has as many devices)."""
    state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    cuda = state.get("cuda_rng")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
