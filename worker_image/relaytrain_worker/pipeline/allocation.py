"""How many bits each block of a code gets (the ``delta`` compression, `deltacache.py`): the
fewest in total whose expected error stays within a budget, by reverse water-filling over the
Lloyd-Max distortions of 0-4 bits (`lowbit.DISTORTION`; 0 bits: the block is left out and its
whole energy is the error), or of 0-8 (`DEEP`: 5-8 bits are a 4-bit code and a 1-4-bit code
of what it left, as transformed codes send them, `transform.py`), each priced as the blocks'
scales are fitted (`lowbit.distortion`), only the bits on a table's lower convex hull given
(`hull`); and the codes of blocks so allocated, grouped by bits (`quantise_grouped`,
`quantise_deep`, and their decodes).

Hand-written: a Lagrangian allocation over five rates is a sort and a cumulative sum, and no
library offers it over torch tensors; nor the two-stage code of 5-8 bits.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from relaytrain_worker.pipeline.lowbit import (
    BLOCK,
    Scale,
    check_bits,
    dequantise_blocks,
    distortion,
    quantise_blocks,
)


@functools.cache
def shallow(scale: Scale = "least-squares") -> tuple[float, ...]:
    """Expected error of 0-4 bits over a block's energy, its scale fitted as ``scale`` says
    (`lowbit.distortion`; 0 bits: the block is left out, its whole energy). Unshrunk, a
    first bit buys less error (0.429) than a second (0.438): the table is not convex, and
    `allocate_bits` gives a block 2 bits or none where least squares gave it 1."""
    return (1.0, *(distortion(b, scale) for b in (1, 2, 3, 4)))


@functools.cache
def deep(scale: Scale = "least-squares") -> tuple[float, ...]:
    """Expected error of 0-8 bits over a block's energy: 5-8 bits are a 4-bit code and a
    1-4-bit code of its residual (convex in the bits at least-squares scales; unshrunk, 1
    and 5 bits are off the hull, `shallow`)."""
    four = distortion(4, scale)
    return (*shallow(scale), *(four * distortion(b, scale) for b in (1, 2, 3, 4)))


SHALLOW = shallow()
"""Lloyd-Max distortion of 0-4 bits (0 bits: the block is left out, its whole energy)."""
DEEP = deep()
"""`deep` with least-squares scales."""
DEEP_COST = tuple(b + 16 / 64 * ((b > 0) + (b > 4)) for b in range(9))
"""Wire bits a value of a block of 0-8 bits: its codes and one bf16 scale per code (two
above 4). In a fitted basis many blocks hold little: a first bit there costs a quarter more
than its code, which the allocation must weigh."""


def allocate_bits(
    energy: torch.Tensor,
    budget: float,
    floor: int = 0,
    table: tuple[float, ...] = SHALLOW,
    cost: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Bits (0 to ``len(table) - 1``, int64) for blocks of squared norms ``energy`` whose
    expected error ``sum_i table[b_i] energy_i`` is at most ``budget``, no block with fewer
    than ``floor``: reverse water-filling, each block taking the bits that minimise
    ``cost[b] + lam table[b] energy_i`` (``cost``: what b bits a value take on the wire;
    default ``b``) with the smallest ``lam`` that meets the budget. So no allocation that
    costs as little in total has less expected error (a Lagrangian optimum; one a little
    cheaper may still meet the budget). Where even the most bits a block miss it, every
    block with energy gets the most. ``table`` must be decreasing; where it is not convex
    against ``cost`` (a further bit buying more error per cost than the one before, as an
    unshrunk 1-bit code's first bit does, `shallow`), only the bits on its lower convex hull
    are given (`hull`): no block takes bits that a mix of its neighbours on the hull beats.

    Block i takes its b-th bit once ``lam energy_i >= STEPS[b]``, so the error only changes at
    the breakpoints ``STEPS[b] / energy_i``: they are sorted, and the first whose cumulative
    saving meets the budget is ``lam`` (one sort, where a bisection over ``lam`` took some 70
    passes over the blocks: a third of a row's first code on the CPU). Blocks of equal energy
    share their breakpoints and so their bits: on a row whose blocks are alike the code is
    the uniform one of ``budget``'s bits; a block with no energy gets ``floor``.

    Runs where ``energy`` is and returns the bits there: on a GPU stage, its card. On one CPU
    thread it costs 6-11 ns a value of the row (`bench/bench_codec_speed.py`, 2026-12-05),
    twice a row coded in a fitted basis: about 1.1 s of each step of the first card run
    (2026-12-04: 24 rows of 512 x 4096 a step, on the host then), whose `delta` steps took
    2.3-3 s. Only the sender allocates and the bits travel in the code, so where it ran
    does not matter to the two ends' agreement."""
    device = energy.device
    e = energy.to(torch.float64).reshape(-1)
    budget *= 1 + 1e-12  # a budget met exactly is met, whatever the order of the sum
    d = torch.tensor(table, dtype=torch.float64, device=device)
    live = e > 0
    costs = tuple(float(b) for b in range(len(table))) if cost is None else tuple(cost)
    c = torch.tensor(costs, dtype=torch.float64, device=device)
    given = torch.tensor(hull(costs, tuple(table), floor), device=device)
    # Block i's breakpoints, one for each step along the hull from the floor, increasing
    # (the hull is convex): the multiplier times its energy above which a step's bits beat
    # the step before. At a multiplier it has the bits of the breakpoints at or below it.
    gain = d[given[:-1]] - d[given[1:]]
    steps = (c[given[1:]] - c[given[:-1]]) / gain
    points = steps[None, :] / e[live, None]

    def pick(lam: float) -> torch.Tensor:
        bits = torch.full(e.shape, floor, dtype=torch.int64, device=device)
        bits[live] = given[(points <= lam).sum(dim=1)]
        return bits

    def error(b: torch.Tensor) -> float:
        return float((d[b] * e).sum())

    if error(pick(0.0)) <= budget:
        return pick(0.0)
    saving = (e[live, None] * gain[None, :]).reshape(-1)
    flat, order = torch.sort(points.reshape(-1), stable=True)
    left = error(pick(0.0)) - saving[order].cumsum(0)
    k = int(torch.searchsorted(-left, torch.tensor([-budget], dtype=torch.float64, device=device)))
    # The sums above are one order of adding; the breakpoint is checked with error()'s own
    # (and moved on where rounding put it one early).
    while k < flat.numel() and error(pick(float(flat[k]))) > budget:
        k += 1
    return pick(math.inf if k >= flat.numel() else float(flat[k]))  # inf: the most miss it


MASSIVE = 20.0
"""A token of more than this many times the energy of its row's median token is massive: a
pretrained model's attention sink (SmolLM2-135M's first token, 20-90 times the median before its
middle layers and thousands of times after) and its like. Its blocks take a code's most bits,
outside the budget (`token_weights`): 8, its row's full code at 0-8 bits a block in the identity
too (`deltacache`; a change, small against it, 4 there): at int3's error such a token lost at
SmolLM2's first boundary does not become the sink it is (the rows' loss +23.7 %; +3.4 % with the
tokens over 20 times the median as they are), in fitted bases at int4's error +3.1 % (+0.74 %),
and at int4's error in the identity, 4 bits a value, +0.68 % (at 8, +0.27 %)."""


class Weighed(NamedTuple):
    """How `allocate_bits` weighs a row's blocks (`token_weights`)."""

    weight: torch.Tensor
    """Each block's weight: its token's, 0 where the token is massive."""
    massive: torch.Tensor
    """Each block's: whether its token is massive (its blocks take the code's most bits)."""
    energy: float
    """The weighed energy of the tokens that are not massive: a budget is ``D`` times it."""


def token_weights(value: torch.Tensor, width: int) -> Weighed:
    """Each block's weight in the allocation of a row of tokens of ``width`` values: the
    blocks' energy ``value`` (`lowbit.to_blocks` of the row's value, squared, summed a block)
    is weighed by the mean token's over its token's, so that `allocate_bits` holds the mean of
    the tokens' relative errors within ``D``, where it held the row's error: a token of massive
    activations then held most of the budget and let every other token be left out
    (SmolLM2-135M, 2026-12-07: `bench/bench_boundary_spectrum.py --codes`). A massive token
    (above ``MASSIVE`` times the median's energy) weighs nothing and is left to the caller to
    code at its most bits; the mean is of the others. Where ``width`` is not a multiple of
    ``BLOCK``, the fewest whole tokens that hold the block stand for its token. A token with
    no energy weighs as one of a millionth of the mean's."""
    k = math.lcm(max(1, width), BLOCK) // BLOCK
    flat = value.reshape(-1).to(torch.float64)
    tokens = torch.nn.functional.pad(flat, (0, (-flat.numel()) % k)).reshape(-1, k).sum(dim=1)
    massive = tokens > MASSIVE * tokens.median()  # (none where the median is zero)
    ordinary = tokens[~massive]
    mean = ordinary.mean() if ordinary.numel() else tokens.new_zeros(())
    if not float(mean) > 0:  # nothing to weigh (on a card, one sync a row)
        none = torch.zeros(value.shape, dtype=torch.bool, device=value.device)
        return Weighed(torch.ones_like(value), none, 0.0)
    weight = torch.where(massive, 0.0, mean / tokens.clamp_min(1e-6 * mean))

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(k)[: flat.numel()].reshape(value.shape)

    weight = per_block(weight).to(value.dtype)
    # summed as the allocation sums what it weighs: a code whose blocks all take its bits
    # meets a budget of its own distortion to the last bit, not one rounding below it
    return Weighed(weight, per_block(massive), float((value * weight).sum()))


@functools.cache
def hull(cost: tuple[float, ...], table: tuple[float, ...], floor: int = 0) -> tuple[int, ...]:
    """The bits, from ``floor``, on the lower convex hull of the points ``(cost[b],
    table[b])``: those each of whose further steps buys less error per cost than the step
    before (all of them where ``table`` is convex against ``cost``). Cached: a link asks
    the same few tables for every row."""
    kept: list[int] = []
    for b in range(floor, len(table)):
        while len(kept) >= 2:
            i, j = kept[-2], kept[-1]
            # j is above the chord from i to b (or on it): a mix of i and b beats it.
            if (table[j] - table[i]) * (cost[b] - cost[i]) >= (table[b] - table[i]) * (
                cost[j] - cost[i]
            ):
                kept.pop()
            else:
                break
        kept.append(b)
    return tuple(kept)


def quantise_grouped(
    blocks: torch.Tensor, bits: torch.Tensor, variant: int, scale: Scale = "least-squares"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Codes and scales, on the CPU for the wire, of float32 ``[n, BLOCK]`` ``blocks`` at
    ``bits`` (0-4 a block; 0: not sent), grouped by bits, 1 to 4, in block order within a
    group, each block's scale fitted as ``scale`` says (`lowbit.Scale`). Coded where
    ``blocks`` are (on a GPU stage, its card: 5 trial scales a block are cheap there)."""
    codes, scales = [], []
    for b in range(1, 5):
        chosen = (bits == b).nonzero().reshape(-1)
        if chosen.numel():
            c, s = quantise_blocks(
                blocks[chosen.to(blocks.device)], check_bits(b), variant=variant, scale=scale
            )
            codes.append(c.cpu())
            scales.append(s.cpu())
    return codes, scales


def dequantise_grouped(
    bits: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    variant: int,
    out: torch.Tensor,
) -> tuple[int, int]:
    """Add to ``out`` (float32 ``[n, BLOCK]``, on the device to decode on) the blocks a
    `quantise_grouped` code at ``bits`` stands for, reading ``codes`` and ``scales`` from
    their start; returns how many code bytes and scales it read. A gather, a multiplication,
    the rotation and an addition: the same bits on every device."""
    at_code = at_scale = 0
    for b in range(1, 5):
        chosen = (bits == b).nonzero().reshape(-1)
        n = chosen.numel()
        if n:
            c = codes[at_code : at_code + 8 * b * n].to(out.device)
            s = scales[at_scale : at_scale + n].to(out.device)
            out[chosen.to(out.device)] += dequantise_blocks(c, s, check_bits(b), variant)
            at_code, at_scale = at_code + 8 * b * n, at_scale + n
    return at_code, at_scale


def quantise_deep(
    blocks: torch.Tensor, bits: torch.Tensor, version: int, scale: Scale = "least-squares"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (CPU, for the wire) of float32 ``[n, BLOCK]`` ``blocks`` at ``bits``
    (0-8 a block): first each block's code of up to 4 bits, grouped by bits 1 to 4
    (`quantise_grouped`, each block's scale fitted as ``scale`` says); then, for
    blocks of more than 4, a code of what the first left, grouped alike."""
    low = bits.clamp(0, 4)
    codes, scales = quantise_grouped(blocks, low, 2 * version, scale)
    if bool((bits > 4).any()):
        first = torch.zeros_like(blocks)
        dequantise_grouped(low, torch.cat(codes), torch.cat(scales), 2 * version, first)
        more = quantise_grouped(blocks - first, (bits - 4).clamp(0, 4), 2 * version + 1, scale)
        codes, scales = codes + more[0], scales + more[1]
    return (
        torch.cat(codes) if codes else torch.zeros(0, dtype=torch.uint8),
        torch.cat(scales) if scales else torch.zeros(0, dtype=torch.bfloat16),
    )


def dequantise_deep(
    key: str,
    bits: torch.Tensor,
    *,
    codes: torch.Tensor,
    scales: torch.Tensor,
    version: int,
    device: torch.device,
) -> torch.Tensor:
    """Float32 ``[n, BLOCK]`` blocks of a code `quantise_deep` made, on ``device``: 0 where a block
    got no bits."""
    want_codes = 8 * int(bits.sum())
    want_scales = int((bits > 0).sum() + (bits > 4).sum())
    if bool((bits >= len(DEEP_COST)).any()) or (want_codes, want_scales) != (
        codes.numel(),
        scales.numel(),
    ):
        raise ValueError(
            f"transformed code for sample {key!r}: its bit map asks {want_codes} code bytes "
            f"and {want_scales} scales, the message holds {codes.numel()} and {scales.numel()}"
        )
    out = torch.zeros(bits.numel(), BLOCK, dtype=torch.float32, device=device)
    read = dequantise_grouped(bits.clamp(0, 4), codes, scales, 2 * version, out)
    codes, scales = codes[read[0] :], scales[read[1] :]
    dequantise_grouped((bits - 4).clamp(0, 4), codes, scales, 2 * version + 1, out)
    return out
