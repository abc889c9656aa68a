"""Compression of boundary tensors: round trips within stated bounds, sizes, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from relaytrain_worker.pipeline.compression import (
    BLOCK,
    CHANNEL_ROWS,
    COMPRESSIONS,
    EncodedTensor,
    decode,
    encode,
    wire_bytes_per_value,
)

pytestmark = pytest.mark.unit

# Stated bounds (see compression.py): per value, a = the block's largest magnitude.
BOUND = {"int8": 1 / 254 * (1 + 2**-7), "int4": 1 / 14 * (1 + 2**-7)}


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each value's block absmax, in the original layout."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, BLOCK)
    a = blocks.abs().amax(dim=1, keepdim=True).expand(-1, BLOCK)
    return a.reshape(-1)[: flat.numel()].reshape(x.shape)


def _bound(x: torch.Tensor, enc: EncodedTensor, mode: str) -> torch.Tensor:
    """The stated per-value bound, with the per-channel scales when the encoder used them."""
    x = x.float()
    if enc.channel_scales is None:
        return _block_absmax(x) * BOUND[mode]
    c = enc.channel_scales.float()
    # + fp32 rounding of x / c and of the product on decode.
    return _block_absmax(x / c) * BOUND[mode] * c + x.abs() * 2**-22


def _activations(
    shape: tuple[int, ...] = (4, 64, 576), seed: int = 0, outliers: bool = True
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if outliers:
        x[..., 7] *= 40.0  # an outlier channel, as real hidden states have
    return x


@pytest.mark.parametrize("mode", COMPRESSIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_keeps_shape_and_dtype_within_bound(mode: str, dtype: torch.dtype) -> None:
    x = _activations().to(dtype)
    enc = encode(x, mode)
    y = decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (y.float() - x.float()).abs()
    if mode == "none" or (mode == "bf16" and dtype == torch.bfloat16):
        assert torch.equal(y, x)
    elif mode == "bf16":
        assert (err <= x.float().abs() * 2**-8).all()
    else:
        # The final cast back to a 16-bit dtype adds its own half-ulp.
        cast = 0.0 if dtype == torch.float32 else 2**-8 if dtype == torch.bfloat16 else 2**-11
        bound = _bound(x, enc, mode) + x.float().abs() * cast
        assert (err <= bound + 1e-12).all(), (err - bound).max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantisation_error_is_small_relative_to_the_signal(mode: str) -> None:
    x = _activations(outliers=False)
    y = decode(encode(x, mode))
    rel = ((y - x).norm() / x.norm()).item()
    # Gaussian blocks of 64: absmax ~ 2.4 sigma, rms error ~ absmax / (sqrt(12) * qmax),
    # i.e. ~0.55% for int8 and ~10% for int4.
    assert rel < {"int8": 0.01, "int4": 0.15}[mode]


@pytest.mark.parametrize("mode", COMPRESSIONS)
def test_integer_and_bool_tensors_travel_losslessly(mode: str) -> None:
    labels = torch.tensor([[-100, 5, 49151, 7]], dtype=torch.int64)
    huge = torch.tensor([[-100, 5, 2**40]], dtype=torch.int64)
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.int64)
    bools = torch.tensor([[True, False, True, True]])
    pos = torch.arange(300, dtype=torch.int32).reshape(1, 300)
    for t in (labels, huge, mask, bools, pos):
        enc = encode(t, mode)
        assert enc.mode == "none"
        back = decode(enc)
        assert torch.equal(back, t) and back.dtype == t.dtype
    if mode != "none":  # narrowed on the wire: int32 labels, uint8 masks, int16 positions
        assert encode(labels, mode).nbytes == 4 * 4
        assert encode(mask, mode).nbytes == 4
        assert encode(pos, mode).nbytes == 2 * 300
        assert encode(huge, mode).nbytes == 8 * 3


@pytest.mark.parametrize("rows", [CHANNEL_ROWS - 1, CHANNEL_ROWS, 8 * 256])
def test_wire_size_against_bf16_meets_the_targets(rows: int) -> None:
    x = _activations((rows, 576))  # SmolLM2-135M hidden size; 576 values per token
    bf16 = encode(x, "bf16").nbytes
    ratios = {m: encode(x, m).nbytes / bf16 for m in ("int8", "int4")}
    assert ratios["int8"] <= 0.52
    assert ratios["int4"] <= 0.27
    assert ratios["int8"] == pytest.approx(wire_bytes_per_value("int8") / 2, abs=0.004)
    assert ratios["int4"] == pytest.approx(wire_bytes_per_value("int4") / 2, abs=0.004)
    assert encode(x, "none").nbytes == 2 * bf16  # fp32 activations


@pytest.mark.parametrize(("mode", "limit"), [("int8", 0.01), ("int4", 0.15)])
def test_an_outlier_channel_does_not_wipe_out_its_neighbours(mode: str, limit: float) -> None:
    x = _activations((4, 128, 576))  # channel 7 is 40x larger than the others
    enc = encode(x, mode)
    assert enc.channel_scales is not None
    y = decode(enc)
    rest = torch.ones(576, dtype=torch.bool)
    rest[7] = False
    assert ((y - x)[..., rest].norm() / x[..., rest].norm()).item() < limit
    assert ((y - x)[..., 7].norm() / x[..., 7].norm()).item() < limit
    small = encode(x[0, :8], mode)  # too few rows to pay for per-channel scales
    assert small.channel_scales is None


@pytest.mark.parametrize("mode", COMPRESSIONS)
def test_encoding_is_deterministic(mode: str) -> None:
    a, b = encode(_activations(seed=3), mode), encode(_activations(seed=3), mode)
    assert torch.equal(a.data, b.data)
    assert (a.scales is None) == (b.scales is None)
    if a.scales is not None and b.scales is not None:
        assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_edge_cases_zeros_odd_sizes_tiny_gradients_and_empty(mode: str) -> None:
    assert torch.equal(decode(encode(torch.zeros(3, 5, 7), mode)), torch.zeros(3, 5, 7))
    odd = torch.linspace(-1, 1, 3 * 5 * 7).reshape(3, 5, 7)  # 105 values: not a block multiple
    assert (decode(encode(odd, mode)) - odd).abs().max() <= BOUND[mode]
    # Gradients far below fp16's range keep their values (the block scale is bf16).
    base = _activations((2, 64), outliers=False)
    back = decode(encode(base * 1e-30, mode)) * 1e30
    rel = ((back - base).norm() / base.norm()).item()
    assert rel < 0.15
    empty = torch.empty(0, 576)
    assert decode(encode(empty, mode)).shape == (0, 576)
    scalar = torch.tensor(3.5)
    assert decode(encode(scalar, mode)).shape == ()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_nan_stays_visible_instead_of_being_clipped(mode: str) -> None:
    x = torch.randn(2 * BLOCK)
    x[3] = math.nan
    y = decode(encode(x, mode))
    assert torch.isnan(y[:BLOCK]).all()  # the poisoned block
    assert not torch.isnan(y[BLOCK:]).any()  # its neighbour is untouched
    wide = torch.randn(CHANNEL_ROWS, 2 * BLOCK)  # with per-channel scales too
    wide[5, 3] = math.inf
    back = decode(encode(wide, mode))
    assert torch.isnan(back[5, :BLOCK]).all() and torch.isnan(back[:, 3]).all()
    assert not torch.isnan(back[:, BLOCK:]).any()


def test_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="none, bf16, int8, int4"):
        encode(torch.ones(2), "fp8")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=700),
    scale=st.floats(min_value=1e-20, max_value=1e20),
    seed=st.integers(min_value=0, max_value=2**16),
    mode=st.sampled_from(["int8", "int4"]),
)
def test_bound_holds_for_any_size_and_scale(n: int, scale: float, seed: int, mode: str) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    y = decode(encode(x, mode))
    assert ((y - x).abs() <= _block_absmax(x) * BOUND[mode] * (1 + 1e-6)).all()
