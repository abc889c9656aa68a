"""What a periodic outer step sends with `sync.outerCode` int4/int2/int1: an error-fed,
rotated low-bit code of each pipeline's update.

With a code (replicas/periodic.py) a pipeline does not send its weights at an outer step
but its *update* since the last one, ``d = theta_q - theta_anchor + e_q``, coded with
`pipeline/lowbit.py` (each block of 64 values rotated by a randomized Hadamard transform,
Lloyd-Max levels, one bf16 scale per block: ``bits + 0.25`` bits per value), and it keeps
what the code left out as its residual ``e_q = d - decode(code)`` (error feedback: nothing
a pipeline learned is dropped, only delayed to the next outer step; DeMo, SparseLoCo).

The code is one uint8 vector: the pipeline's weight (its label tokens since the last outer
step, float64), the block scales (bf16), then the packed codes. The exchange gathers the
codes as they are (`stats.OUTER_CODES`: every pipeline gets every pipeline's bytes, in
pipeline order), and every pipeline decodes the same bytes and folds the same weighted mean
in the same order (float64): every replica ends the outer step with the same bits, and the
mean is never coded a second time.

Lowering the bits cost less learning per byte saved than sparsifying (sending only each
chunk's largest values) in bench/bench_outer_sync.py's experiments, so the code is dense.
Hand-written because the exchange needs a pure byte format both ends decode alike.
"""

from __future__ import annotations

import torch
from relaytrain_contract.stage import OuterCode

from relaytrain_worker.pipeline import lowbit

_BITS = {"int4": 4, "int2": 2, "int1": 1}
_WEIGHT_BYTES = 8


def bits_of(code: OuterCode | str) -> int:
    """The bits per value of a low-bit outer code (ValueError for `float64` or another)."""
    if code not in _BITS:
        raise ValueError(f"{code!r} is not a low-bit outer code; valid: {', '.join(_BITS)}")
    return _BITS[code]


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the code of a parameter of `numel` values (the weight's 8 included)."""
    blocks = -(-numel // lowbit.BLOCK)
    return _WEIGHT_BYTES + blocks * (2 + 8 * bits)


def encode(
    update: torch.Tensor, weight: float, bits: int, variant: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The code of `update` (any shape, floating) with `weight`, and the float32 residual
    it leaves, of `update`'s shape: ``update - decode(code)`` (float32).

    `variant` picks the rotation (`lowbit.sign_bits`); the outer step passes its step, so
    what one code left out is coded in a fresh basis by the next: with one basis, the part
    a 1-bit code cannot represent stays unrepresentable and the residual of a constant
    update grows to about 8x the update, with a fresh one it stays below 1.5x."""
    flat = update.detach().reshape(-1).to(torch.float32).cpu()
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("the update has a NaN or infinite value: the run is diverging")
    b = lowbit.check_bits(bits)
    packed, scales = lowbit.quantise_blocks(lowbit.to_blocks(flat), b, variant=variant)
    head = torch.tensor([float(weight)], dtype=torch.float64).view(torch.uint8)
    code = torch.cat([head, scales.view(torch.uint8), packed.reshape(-1)])
    sent = lowbit.dequantise_blocks(packed, scales, b, variant=variant).reshape(-1)
    residual = flat - sent[: flat.numel()]
    return code, residual.reshape(update.shape)


def decode(
    code: torch.Tensor, numel: int, bits: int, variant: int = 0
) -> tuple[float, torch.Tensor]:
    """(weight, the float32 flat update of `numel` values) from a code of `encode`."""
    if code.dtype != torch.uint8 or code.numel() != code_bytes(numel, bits):
        raise ValueError(
            f"a code of {code.numel()} {code.dtype} bytes is not one of {numel} values at "
            f"{bits} bits ({code_bytes(numel, bits)} uint8 bytes)"
        )
    blocks = -(-numel // lowbit.BLOCK)
    code = code.cpu()
    # Copies: a row of a gathered stack may start at any byte, and a view as float64 or
    # bf16 needs its own alignment.
    weight = float(code[:_WEIGHT_BYTES].clone().view(torch.float64)[0])
    scales = code[_WEIGHT_BYTES : _WEIGHT_BYTES + 2 * blocks].clone().view(torch.bfloat16)
    packed = code[_WEIGHT_BYTES + 2 * blocks :].clone().reshape(blocks, -1)
    values = lowbit.dequantise_blocks(packed, scales, lowbit.check_bits(bits), variant=variant)
    return weight, values.reshape(-1)[:numel]


def weighted_mean(
    codes: torch.Tensor | list[torch.Tensor], numel: int, bits: int, variant: int = 0
) -> torch.Tensor:
    """The float32 mean of the codes' updates (one per row of a gathered stack, or a list)
    weighted by their weights, folded in order in float64: what every pipeline applies at
    an outer step. Zeros when no pipeline trained a token."""
    acc = torch.zeros(numel, dtype=torch.float64)
    total = 0.0
    for code in codes:
        weight, values = decode(code, numel, bits, variant)
        if weight > 0:
            acc += values.to(torch.float64) * weight
            total += weight
    if total <= 0.0:
        return torch.zeros(numel, dtype=torch.float32)
    return (acc / total).to(torch.float32)


def raw(values: torch.Tensor, weight: float) -> torch.Tensor:
    """The uncoded form of a gathered outer step (`sync.outerCode: float64` with the exact
    LoRA merge, which needs every pipeline's factors, not their sum): `weight` then the
    values, float64, as uint8 bytes."""
    flat = values.detach().reshape(-1).to("cpu", torch.float64)
    return torch.cat([torch.tensor([float(weight)], dtype=torch.float64), flat]).view(torch.uint8)


def unraw(code: torch.Tensor, numel: int) -> tuple[float, torch.Tensor]:
    """(weight, the float64 flat values) of a `raw` row."""
    if code.dtype != torch.uint8 or code.numel() != 8 * (numel + 1):
        raise ValueError(
            f"a row of {code.numel()} {code.dtype} bytes is not {numel} float64 values "
            f"and a weight ({8 * (numel + 1)} uint8 bytes)"
        )
    values = code.cpu().clone().view(torch.float64)  # a copy: a stack's row may be unaligned
    return float(values[0]), values[1:]
