"""How many bits each block of a code gets (the ``delta`` compression, `deltacache.py`): the
fewest in total whose expected error stays within a budget, by reverse water-filling over the
Lloyd-Max distortions of 0-4 bits (`lowbit.DISTORTION`; 0 bits: the block is left out and its
whole energy is the error).

Hand-written: a Lagrangian allocation over five rates is a sort and a cumulative sum, and no
library offers it over torch tensors.
"""

from __future__ import annotations

import math

import torch

from relaytrain_worker.pipeline.lowbit import DISTORTION

#: Lloyd-Max distortion of 0-4 bits (0 bits: the block is left out, its whole energy).
_D = (1.0, *(DISTORTION[b] for b in (1, 2, 3, 4)))
#: The Lagrange multiplier times a block's energy above which b bits beat b - 1, b = 1..4
#: (the distortions are convex in b, so each block's best bits are a count of these).
_STEPS = tuple(1.0 / (_D[b - 1] - _D[b]) for b in range(1, 5))


def allocate_bits(energy: torch.Tensor, budget: float, floor: int = 0) -> torch.Tensor:
    """Bits (0-4, int64) for blocks of squared norms ``energy`` whose expected error
    ``sum_i D_(b_i) energy_i`` is at most ``budget``, no block with fewer than ``floor``:
    reverse water-filling, each block taking the bits that minimise ``b + lam D_b energy_i``
    with the smallest ``lam`` that meets the budget. So no allocation of as few bits in total
    has less expected error (a Lagrangian optimum; one of a few bits fewer may still meet the
    budget). Where even 4 bits a block miss it, every block with energy gets 4.

    Block i takes its b-th bit once ``lam energy_i >= STEPS[b]``, so the error only changes at
    the breakpoints ``STEPS[b] / energy_i``: they are sorted, and the first whose cumulative
    saving meets the budget is ``lam`` (one sort, where a bisection over ``lam`` took some 70
    passes over the blocks: a third of a row's first code on the CPU). Blocks of equal energy
    share their breakpoints and so their bits: on a row whose blocks are alike the code is
    the uniform one of ``budget``'s bits; a block with no energy gets ``floor``."""
    e = energy.to(torch.float64).reshape(-1)
    budget *= 1 + 1e-12  # a budget met exactly is met, whatever the order of the sum
    d = torch.tensor(_D, dtype=torch.float64)
    live = e > 0
    # Block i's breakpoints, one a bit above the floor, increasing (the distortions are
    # convex); at a multiplier it has the bits of the breakpoints at or below it.
    points = torch.tensor(_STEPS[floor:], dtype=torch.float64)[None, :] / e[live, None]

    def pick(lam: float) -> torch.Tensor:
        bits = torch.full(e.shape, floor, dtype=torch.int64)
        bits[live] += (points <= lam).sum(dim=1)
        return bits

    def error(b: torch.Tensor) -> float:
        return float((d[b] * e).sum())

    if error(pick(0.0)) <= budget:
        return pick(0.0)
    saving = (e[live, None] * (d[floor:-1] - d[floor + 1 :])[None, :]).reshape(-1)
    flat, order = torch.sort(points.reshape(-1), stable=True)
    left = error(pick(0.0)) - saving[order].cumsum(0)
    k = int(torch.searchsorted(-left, torch.tensor([-budget], dtype=torch.float64)))
    # The sums above are one order of adding; the breakpoint is checked with error()'s own
    # (and moved on where rounding put it one early).
    while k < flat.numel() and error(pick(float(flat[k]))) > budget:
        k += 1
    return pick(math.inf if k >= flat.numel() else float(flat[k]))  # inf: 4 bits miss it
