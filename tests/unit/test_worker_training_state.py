"""A stage's optimizer/schedule/RNG state (`training.state_bytes`): after a restore the
random draws — dropout masks above all — are the ones an uninterrupted run makes, on the
CPU and on every CUDA device."""

from __future__ import annotations

import pytest
import torch
from relaytrain_worker.training import load_state_bytes, state_bytes
from torch.nn import functional

pytestmark = pytest.mark.unit


def _optimizer() -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _dropout_masks(device: str) -> list[torch.Tensor]:
    x = torch.ones(64, 64, device=device)
    return [functional.dropout(x, p=0.3, training=True) != 0 for _ in range(3)]


def test_a_restore_replays_the_cpu_dropout_masks() -> None:
    optimizer, scheduler = _optimizer()
    torch.manual_seed(5)
    saved = state_bytes(optimizer, scheduler)
    first = _dropout_masks("cpu")
    load_state_bytes(saved, optimizer, scheduler)
    again = _dropout_masks("cpu")
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])  # the masks are random, not all alike


@pytest.mark.gpu
def test_a_restore_replays_the_cuda_dropout_masks() -> None:
    optimizer, scheduler = _optimizer()
    torch.manual_seed(5)
    torch.rand(1, device="cuda")  # CUDA is in use, as on a GPU stage
    saved = state_bytes(optimizer, scheduler)
    first = _dropout_masks("cuda")
    cuda_draws = torch.rand(8, device="cuda")
    load_state_bytes(saved, optimizer, scheduler)
    again = _dropout_masks("cuda")
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert torch.equal(torch.rand(8, device="cuda"), cuda_draws)
