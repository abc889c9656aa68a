"""Rotated 1-4-bit quantisation of boundary tensors (the first-epoch and gradient codec).

The tensor is flattened, zero-padded to a multiple of ``BLOCK`` (64) values and cut into
blocks of 64 consecutive values. Each block is rotated by ``R = D H D / 8``: ``H`` the 64x64
Sylvester Hadamard matrix, ``D`` a fixed diagonal of signs (bit i of ``SIGN_BITS``, the
first 64 bits of pi's fraction: 1 = minus; ``variant`` k > 0 mixes k into them, see
``sign_bits``: the delta codec rotates each version of a sample differently, so that what
one code left out looks Gaussian again to the next). ``R`` is orthonormal and symmetric,
hence its own inverse; it is applied as a fast Walsh-Hadamard transform (6 butterfly
stages over all blocks at once) whose operations are adds, subtracts and multiplications
by powers of two, so decode gives the same bits on any device (the delta codec's
mirrored caches need that; a matmul would not). The rotation spreads an outlier channel
over the whole block (a spike ``a`` becomes 64 values of magnitude ``a / 8``); after it a
Gaussian-like block stays Gaussian, so the code levels are the Gaussian-optimal
(Lloyd-Max) ones for ``2**bits`` levels, scaled per block.

Two rounding modes:

- nearest (default): for five trial scales ``t`` (0.65-1.55x the block's RMS) each value
  ``y / t`` goes to the nearest level ``L[c]`` and the scale is refitted by least squares,
  ``s = <y, L[c]> / <L[c], L[c]>``; the block keeps the trial with the smallest error
  ``||y||^2 - s^2 ||L[c]||^2``. With ``s`` rounded to bf16 (``s (1 + d)``, ``|d| <= 2**-8``)
  the error is ``||y||^2 - s^2 ||L[c]||^2 (1 - d^2)``: **the error of a block never exceeds
  the block's norm** (any input), and on Gaussian blocks its mean square is at most the
  Lloyd-Max distortion ``D_b`` (``DISTORTION``) of the block's mean square (0.81-0.98 D_b
  measured). The trials matter where a block is not Gaussian: a rotated outlier spike is
  ``+-a/8`` in every position, which the RMS scale puts between two 2-bit levels.
  The least-squares scale makes the decoded block the projection of the block onto its
  code, so it is *shorter* than the block by the whole error: ``||decode||^2 = ||y||^2 -
  ||error||^2``, every code the same way (1.7 % at 3 bits, 0.5 % at 4, in norm). With
  ``scale="unshrunk"`` the scale is ``s = ||y||^2 / <y, L[c]>`` instead: the decoded block's
  part along the block is the block itself, its error at right angles to it, and larger:
  ``||y||^2 (||y||^2 ||L[c]||^2 / <y, L[c]>^2 - 1)``, ``D / (1 - D)`` of the block's energy
  in place of ``D`` on Gaussian blocks (`distortion`: +3.6 % at 3 bits, +13 % at 2, +57 % at
  1). Kept to blocks whose code is within 45 degrees of them (``2 <y, L[c]>^2 >= ||y||^2
  ||L[c]||^2``: the error is then at most the block's norm, as above); other blocks keep
  the least-squares scale. The decoder is the same: a block's scale is whatever the sender
  chose. The ``delta`` boundary compression codes this way (`deltacache.DeltaConfig.scale`):
  a boundary that shortens every activation crossing it cost a fine-tune at a width of 1024
  2.2 % of its held-out loss at int3's error, unshrunk none (docs/gpu-check.md). Its
  allocation of bits prices the larger error, and at 1 bit, +57 %, a first bit buys less
  than a second: it gives a block 2 bits or none (`allocation.hull`).
- stochastic (``seed`` given; for gradients): the scale is the block's largest rotated
  magnitude over the top level (rounded up to bf16, so nothing clips) and each value goes
  to one of its two neighbouring levels with the probability that makes the code
  **unbiased**: ``E[decode] = x`` exactly (up to float32). The random numbers come from a
  CPU ``torch.Generator`` seeded with ``seed``: the same input and seed give the same bytes.

Wire format (``LowBitTensor``): ``codes``, ``8 * bits`` bytes per block (8 codes of ``bits``
bits form a little-endian integer of ``bits`` bytes, first code in the lowest bits), and
``scales``, one bf16 per block. Bits per value: ``bits + 16 / 64``:

==== ========== ======= ============== ========= ============ ==============
bits bits/value x bf16  D_b            Gaussian  30x outliers same, other
                                                 (all values) channels only
==== ========== ======= ============== ========= ============ ==============
1    1.25       12.8x   0.363 (60 %)   59.8 %    27 %         77 %
2    2.25       7.1x    0.117 (34 %)   33.4 %    20 %         56 %
3    3.25       4.9x    0.035 (19 %)   17.4 %    13 %         38 %
4    4.25       3.8x    0.0095 (9.7 %) 8.8 %     7.3 %        21 %
==== ========== ======= ============== ========= ============ ==============

Relative error ``||decode(x) - x|| / ||x||`` (bench/bench_boundary_codec.py; [8, 128, 512],
four channels 30x). Over the whole tensor the rotation makes outliers harmless, but the
other 63 values of a block that holds an outlier share its scale, so their own error grows
~4x: compression.py's int4 with per-channel scales keeps them at 11 %. Stochastic rounding
pays for being unbiased: 4x the nearest error at 1 bit (243 % vs 60 %), 2x at 2 bits
(68 % vs 33 %); the mean of 16 seeded 2-bit codes has 17 %. Speed, one CPU thread: encode
16-40 MB/s of float32 (the five trials), decode 130-300 MB/s.

NaN or inf in a block makes the whole decoded block NaN (as compression.py does), so a
diverging run stays visibly broken. Any floating dtype in gives the same dtype out (the
arithmetic is float32). Everything is vectorised torch and deterministic.

The codec is hand-written because it has to be a pure, self-describing byte format that
both ends decode without shared library state, and its decode has to be bit-exact across
devices for the delta cache (deltacache.py); no library offers rotated Lloyd-Max codes
with that guarantee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

Bits = Literal[1, 2, 3, 4]
BITS: tuple[int, ...] = get_args(Bits)
Scale = Literal["least-squares", "unshrunk"]
"""How a nearest code's block scale is fitted (see the module's docstring)."""
SCALES: tuple[str, ...] = get_args(Scale)

#: Values per rotation and scale block.
BLOCK = 64
#: Sign of D's entry i is minus where bit i is set (the first 64 fraction bits of pi).
SIGN_BITS = 0x243F6A8885A308D3

_HALF_LEVELS: dict[int, tuple[float, ...]] = {
    1: (0.797885,),
    2: (0.45278, 1.510418),
    3: (0.245094, 0.756005, 1.343909, 2.151946),
    4: (0.128395, 0.388048, 0.656759, 0.94234, 1.256231, 1.618046, 2.069017, 2.73259),
}
#: Lloyd-Max levels for a unit Gaussian, ascending (code c decodes to ``LEVELS[bits][c]``).
LEVELS: dict[int, tuple[float, ...]] = {
    b: tuple(-v for v in reversed(h)) + h for b, h in _HALF_LEVELS.items()
}
#: Mean square error of those levels on a unit Gaussian (the Lloyd-Max distortion).
DISTORTION: dict[int, float] = {1: 0.36338, 2: 0.117482, 3: 0.034548, 4: 0.009501}


def check_bits(bits: int) -> Bits:
    """Return ``bits`` typed as Bits, or raise ValueError naming the valid ones."""
    if bits not in BITS:
        raise ValueError(f"unsupported bits {bits!r}; valid: {', '.join(map(str, BITS))}")
    return bits  # type: ignore[return-value]


def distortion(bits: int, scale: Scale = "least-squares") -> float:
    """Expected error, over their energy, of nearest codes of Gaussian blocks at ``bits``
    whose scales are fitted as ``scale`` says: ``D_b`` (least squares), ``D_b / (1 - D_b)``
    (unshrunk)."""
    d = DISTORTION[check_bits(bits)]
    return d / (1 - d) if check_scale(scale) == "unshrunk" else d


def check_scale(scale: str) -> Scale:
    """Return ``scale`` typed as Scale, or raise ValueError naming the valid ones."""
    if scale not in SCALES:
        raise ValueError(f"unsupported scale {scale!r}; valid: {', '.join(SCALES)}")
    return scale  # type: ignore[return-value]


@dataclass(frozen=True)
class LowBitTensor:
    """One tensor in wire form: packed ``codes`` and one bf16 scale per block."""

    bits: Bits
    """Bits per code (1-4)."""
    dtype: torch.dtype
    """dtype of the original tensor; decode returns this dtype."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    codes: torch.Tensor
    """1-D contiguous uint8 CPU tensor: ``8 * bits`` bytes per block."""
    scales: torch.Tensor
    """1-D contiguous bf16 CPU tensor, one scale per block."""
    variant: int = 0
    """The blocks' rotation (`rotate`)."""

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies on the wire (payload only, no framing)."""
        return self.codes.numel() + 2 * self.scales.numel()

    @property
    def numel(self) -> int:
        """Number of values of the original tensor."""
        return math.prod(self.shape)


def encode(
    t: torch.Tensor,
    bits: Bits | int,
    seed: int | None = None,
    scale: Scale = "least-squares",
    variant: int = 0,
) -> LowBitTensor:
    """Encode floating ``t`` (any device, any shape) with ``bits`` bits per value.

    ``seed`` None rounds to the nearest level, each block's scale fitted as ``scale`` says;
    an int rounds stochastically (unbiased) with random numbers from that seed. ``variant``:
    the blocks' rotation (`rotate`). The result lives on the CPU.
    """
    bits = check_bits(bits)
    if not t.is_floating_point():
        raise TypeError(f"lowbit encodes floating tensors, got {t.dtype}")
    codes, scales = quantise_blocks(to_blocks(t), bits, seed, variant, scale)
    return LowBitTensor(bits, t.dtype, tuple(t.shape), codes.cpu(), scales.cpu(), variant)


def decode(enc: LowBitTensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Rebuild a tensor of the original shape and dtype (on ``device``, default CPU)."""
    codes = enc.codes if device is None else enc.codes.to(device)
    scales = enc.scales if device is None else enc.scales.to(device)
    blocks = dequantise_blocks(codes, scales, enc.bits, enc.variant)
    return from_blocks(blocks, enc.shape, enc.dtype)


def bits_per_value(bits: Bits | int) -> float:
    """Asymptotic wire bits per value (codes plus the block's bf16 scale)."""
    return check_bits(bits) + 16 / BLOCK


def to_blocks(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened to float32, zero-padded, as ``[ceil(numel / BLOCK), BLOCK]``."""
    flat = t.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.reshape(-1, BLOCK)


def from_blocks(blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of to_blocks: drop the padding, restore shape and dtype."""
    return blocks.reshape(-1)[: math.prod(shape)].to(dtype).reshape(shape)


def rotate(blocks: torch.Tensor, variant: int = 0) -> torch.Tensor:
    """``R = D H D / 8`` applied to every row of ``blocks`` (``[..., BLOCK]``, float).

    Orthonormal and self-inverse: ``rotate(rotate(x)) == x`` up to float rounding.
    """
    signs = _signs(variant, blocks.device, blocks.dtype)
    x = blocks * signs  # D
    lead = x.shape[:-1]
    h = 1
    while h < BLOCK:  # log2(64) = 6 butterfly stages, each over all blocks at once
        pairs = x.reshape(*lead, BLOCK // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, BLOCK)
        h *= 2
    return x * (signs * 0.125)  # D / 8: exact, a power of two with a sign


def quantise_blocks(
    blocks: torch.Tensor,
    bits: Bits,
    seed: int | None = None,
    variant: int = 0,
    scale: Scale = "least-squares",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate and quantise float32 ``[n, BLOCK]`` blocks: packed uint8 codes (``8 * bits``
    bytes per block) and one bf16 scale per block, on the blocks' device. ``scale``: how a
    nearest code's scale is fitted (`Scale`); a stochastic code's is always its block's
    largest magnitude."""
    check_scale(scale)
    if seed is not None and scale != "least-squares":
        raise ValueError(
            f"scale {scale!r} is for nearest codes; a stochastic code (seed) has its own"
        )
    y = rotate(blocks, variant)
    levels = torch.tensor(LEVELS[bits], dtype=torch.float32, device=y.device)
    top = levels[-1].item()
    if seed is None:
        rms = y.square().mean(dim=1).sqrt_()
        divisor = rms.masked_fill(rms == 0, 1.0)
        thresholds = (levels[1:] + levels[:-1]) * 0.5
        # Codes for a few trial scales around the RMS, each with its least-squares scale
        # (so a block's error is at most its norm); per block, keep the trial whose error
        # ||y||^2 - <y, c>^2 / ||c||^2 is smallest. Blocks that are not Gaussian (a rotated
        # spike is +-a/8 everywhere) need a scale far from the RMS.
        trial = divisor[None, :, None] * _TRIALS.to(y.device)[:, None, None]
        q = torch.bucketize(y[None] / trial, thresholds)
        chosen = levels[q]
        dot = (y[None] * chosen).sum(dim=2)
        norm2 = chosen.square().sum(dim=2)
        best = (dot.square() / norm2).argmax(dim=0)
        pick = best[None, :, None].expand(1, -1, BLOCK)
        q = q.gather(0, pick)[0]
        fit = (dot / norm2).gather(0, best[None])[0]
        if scale == "unshrunk":
            # s = ||y||^2 / <y, c>: the decoded block's part along y is y. Only where the
            # code is within 45 degrees of the block (2 <y, c>^2 >= ||y||^2 ||c||^2), so
            # that the error stays within the block's norm; elsewhere least squares.
            d = dot.gather(0, best[None])[0]
            c2 = norm2.gather(0, best[None])[0]
            y2 = y.square().sum(dim=1)
            near = (d > 0) & (2 * d.square() >= y2 * c2)
            fit = torch.where(near, y2 / d.masked_fill(~near, 1.0), fit)
        scales = fit.to(torch.bfloat16)
        bad = ~torch.isfinite(rms)
    else:
        absmax = torch.maximum(y.amax(dim=1), y.amin(dim=1).neg())
        # Round the scale up to bf16 so that |y / scale| <= top: nothing clips, no bias.
        exact = absmax / top
        scales = exact.to(torch.bfloat16)
        low = scales.to(torch.float32) < exact
        scales = torch.where(low, (scales.view(torch.int16) + 1).view(torch.bfloat16), scales)
        divisor = scales.to(torch.float32).masked_fill_(absmax == 0, 1.0)
        u = (y / divisor[:, None]).clamp_(-top, top)
        lower = torch.bucketize(u, levels, right=True).sub_(1).clamp_(0, levels.numel() - 2)
        lo, hi = levels[lower], levels[lower + 1]
        gen = torch.Generator().manual_seed(seed)
        draw = torch.rand(u.shape, generator=gen, dtype=torch.float32).to(u.device)
        q = lower + (draw * (hi - lo) < u - lo).to(lower.dtype)
        bad = ~torch.isfinite(absmax)
    if bool(bad.any()):
        # A NaN or inf in a block: its scale becomes NaN, so the whole block decodes as NaN
        # and a diverging run stays visibly broken; its codes are zeroed.
        q = q.masked_fill(bad[:, None], 0)
        scales = scales.masked_fill(bad, float("nan"))
    return pack_bits(q, bits), scales.reshape(-1).contiguous()


def dequantise_blocks(
    codes: torch.Tensor, scales: torch.Tensor, bits: Bits, variant: int = 0
) -> torch.Tensor:
    """Float32 ``[n, BLOCK]`` blocks (rotated back) from packed codes and bf16 scales.

    Only a gather, one multiplication and the rotation's butterflies: the same bits on
    every device."""
    levels = torch.tensor(LEVELS[bits], dtype=torch.float32, device=codes.device)
    q = unpack_bits(codes, bits).reshape(-1, BLOCK)
    y = levels[q] * scales.view(torch.bfloat16).to(torch.float32)[:, None]
    return rotate(y, variant)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in ``[0, 2**bits)`` (numel a multiple of 8) as bytes: each run of 8
    codes is one little-endian integer of ``bits`` bytes, code j in bits ``[bits*j, ...)``."""
    groups = q.reshape(-1, 8).to(torch.int64)
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * bits
    word = (groups << shifts).sum(dim=1)
    byte_shifts = torch.arange(bits, device=q.device, dtype=torch.int64) * 8
    return ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: int64 codes, 8 per ``bits`` bytes."""
    groups = packed.view(torch.uint8).reshape(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (groups << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((word[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)


def sign_bits(variant: int = 0) -> int:
    """The 64 sign bits of rotation ``variant``: SIGN_BITS for 0, else SIGN_BITS mixed with
    the variant by splitmix64's finaliser (so consecutive variants are unrelated)."""
    if variant == 0:
        return SIGN_BITS
    z = (SIGN_BITS + variant * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_MASK64 = (1 << 64) - 1
#: Trial scales of the nearest mode, as multiples of the block's rotated RMS.
_TRIALS = torch.tensor([0.65, 0.8, 1.0, 1.25, 1.55])


def _signs(variant: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """D's diagonal: -1 where bit i of sign_bits(variant) is set, else +1."""
    word = sign_bits(variant)
    bit = [(word >> i) & 1 for i in range(BLOCK)]
    return torch.tensor([-1.0 if b else 1.0 for b in bit], dtype=dtype, device=device)
