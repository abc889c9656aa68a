"""A stage's optimizer/schedule/RNG state (`training.state_bytes`): after a restore the
random draws — dropout masks above all — are the ones an uninterrupted run makes, on the
CPU and on every CUDA device."""

from __future__ import annotations

import io

import pytest
import torch
from relaytrain_worker.model.training import load_state_bytes, state_bytes
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


def test_optimizer_state_saved_under_one_split_restores_under_another() -> None:
    # Four parameters held [a, b | c, d] by two stages, restored as [a | b, c, d]: the state
    # travels by name, so each parameter gets its own moments whatever position it has.
    from relaytrain_worker.model.training import load_named_optimizer_state, named_optimizer_state

    gen = torch.Generator().manual_seed(0)
    names = ["a", "b", "c", "d"]
    values = {n: torch.randn(3, generator=gen) for n in names}

    Held = tuple[torch.optim.AdamW, list[torch.nn.Parameter]]

    def make(held: list[str]) -> Held:
        params = [torch.nn.Parameter(values[n].clone()) for n in held]
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, foreach=False), params

    def step(split: list[tuple[list[str], Held]], seed: int) -> None:
        for held, (opt, params) in split:
            for n, p in zip(held, params, strict=True):
                g = torch.Generator().manual_seed(seed * 10 + names.index(n))
                p.grad = torch.randn(3, generator=g)
            opt.step()

    before = [(["a", "b"], make(["a", "b"])), (["c", "d"], make(["c", "d"]))]
    step(before, 1)
    step(before, 2)
    # Through bytes, as in a checkpoint (and so no tensor is shared with `before`).
    saved = [
        torch.load(_bytes(named_optimizer_state(opt, held)), weights_only=True)
        for held, (opt, _) in before
    ]
    merged = {"group": saved[0]["group"], "state": {**saved[0]["state"], **saved[1]["state"]}}
    trained = {
        n: p.detach().clone() for held, (_, ps) in before for n, p in zip(held, ps, strict=True)
    }

    after = [(["a"], make(["a"])), (["b", "c", "d"], make(["b", "c", "d"]))]
    for held, (opt, params) in after:
        with torch.no_grad():
            for n, p in zip(held, params, strict=True):
                p.copy_(trained[n])
        load_named_optimizer_state(opt, held, merged)
    # One more step on either split gives the same weights, bit for bit (same grads by name).
    step(before, 3)
    step(after, 3)
    old = {n: p for held, (_, ps) in before for n, p in zip(held, ps, strict=True)}
    new = {n: p for held, (_, ps) in after for n, p in zip(held, ps, strict=True)}
    assert [n for n in names if not torch.equal(old[n], new[n])] == []
    assert not torch.equal(old["a"], trained["a"])  # the step moved them


def _bytes(obj: object) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
