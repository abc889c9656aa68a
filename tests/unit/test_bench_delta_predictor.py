"""bench/bench_delta_predictor.py's two ways of coding a boundary's rows over epochs: against
the cached value, and against it plus a linear prediction fitted on the epoch's earlier rows.
On rows whose change is a linear function of what they were, the prediction takes the change
off the codes; on rows that change at random it costs no more than the plain way (the sender
keeps the smaller code); the first epoch is full codes either way."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from relaytrain_testkit import REPO

pytestmark = [pytest.mark.unit, pytest.mark.torch]

ROWS, SEQ, H, EPOCHS = 32, 32, 64, 3


def _bench() -> Any:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_delta_predictor
    finally:
        sys.path.remove(str(REPO / "bench"))
    return bench_delta_predictor


def _epochs(step: Any) -> tuple[torch.Tensor, list[list[int]]]:
    """[epochs, rows, seq, h] rows, each epoch's made from the one before by `step`."""
    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(ROWS, SEQ, H, generator=gen)]
    for e in range(1, EPOCHS):
        states.append(step(states[-1], e, gen))
    orders = [torch.randperm(ROWS, generator=gen).tolist() for _ in range(EPOCHS)]
    return torch.stack(states), orders


def test_a_linear_change_is_predicted_off_the_codes() -> None:
    bench = _bench()
    mix = (
        torch.eye(H) + 0.5 * torch.randn(H, H, generator=torch.Generator().manual_seed(1)) / H**0.5
    )
    states, orders = _epochs(lambda x, e, gen: x @ mix)
    out = bench.boundary_epochs(states, orders, [0.25])
    assert out[0]["plain"] == out[0]["predicted"] and out[0]["W"] == 0
    for later in out[1:]:
        assert later["left"] < 0.3, later  # the reference's own error is left
        assert later["predicted"] < 0.5 * later["plain"], later
        assert later["W"] == bench.w_bytes(H) / (ROWS * SEQ)


def test_a_random_change_costs_no_more_than_the_plain_code() -> None:
    bench = _bench()
    states, orders = _epochs(lambda x, e, gen: x + 0.5 * torch.randn(x.shape, generator=gen))
    out = bench.boundary_epochs(states, orders, [0.25])
    for later in out[1:]:
        assert later["left"] > 0.9, later  # nothing to predict
        assert later["predicted"] <= later["plain"] * 1.01, later
