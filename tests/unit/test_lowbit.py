"""Rotated low-bit codec: the rotation, the Lloyd-Max levels, error bounds, determinism, NaN."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from relaytrain_worker.pipeline.lowbit import (
    BITS,
    BLOCK,
    DISTORTION,
    LEVELS,
    SIGN_BITS,
    bits_per_value,
    decode,
    dequantise_blocks,
    distortion,
    encode,
    pack_bits,
    quantise_blocks,
    rotate,
    sign_bits,
    to_blocks,
    unpack_bits,
)

pytestmark = pytest.mark.unit


def _gaussian(shape: tuple[int, ...] = (4, 64, 512), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rel(y: torch.Tensor, x: torch.Tensor) -> float:
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


def _matrix(variant: int = 0) -> torch.Tensor:
    """R = D H D / 8 built independently: Sylvester's construction and the sign bits."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < BLOCK:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    word = sign_bits(variant)
    d = torch.tensor([-1.0 if (word >> i) & 1 else 1.0 for i in range(BLOCK)], dtype=torch.float64)
    return d[:, None] * h * d[None, :] / 8


@pytest.mark.parametrize("variant", [0, 1, 7])
def test_rotation_is_the_randomised_hadamard_and_orthonormal_and_self_inverse(
    variant: int,
) -> None:
    eye = torch.eye(BLOCK, dtype=torch.float64)
    r = rotate(eye, variant)  # row i = R applied to e_i = column i of R (R is symmetric)
    assert torch.allclose(r, _matrix(variant), atol=1e-15)
    assert torch.allclose(r @ r.T, eye, atol=1e-12)
    assert torch.equal(r, r.T)
    x = _gaussian((100, BLOCK)).double()
    assert torch.allclose(rotate(rotate(x, variant), variant), x, atol=1e-12)
    assert torch.allclose(rotate(x, variant).norm(dim=1), x.norm(dim=1), rtol=1e-12)


def test_rotation_variants_differ_and_spread_a_spike() -> None:
    assert sign_bits(0) == SIGN_BITS
    words = {sign_bits(v) for v in range(50)}
    assert len(words) == 50
    spike = torch.zeros(1, BLOCK)
    spike[0, 5] = 8.0
    for v in (0, 3):
        assert torch.equal(rotate(spike, v).abs(), torch.ones(1, BLOCK))
    # Different variants rotate differently (the delta codec relies on it).
    assert not torch.equal(rotate(spike, 0), rotate(spike, 1))


def _normal_pdf(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("bits", BITS)
def test_levels_are_lloyd_max_for_a_unit_gaussian(bits: int) -> None:
    levels = LEVELS[bits]
    assert len(levels) == 2**bits and list(levels) == sorted(levels)
    cuts = [-math.inf] + [(a + b) / 2 for a, b in itertools.pairwise(levels)] + [math.inf]
    distortion = 0.0
    for level, (lo, hi) in zip(levels, itertools.pairwise(cuts), strict=True):
        mass = _normal_cdf(hi) - _normal_cdf(lo)
        mean = _normal_pdf(lo) - _normal_pdf(hi)  # E[X; lo < X < hi]
        assert mean / mass == pytest.approx(level, abs=2e-6)  # each level is its centroid
        second = mass + (lo * _normal_pdf(lo) if lo > -math.inf else 0.0)
        second -= hi * _normal_pdf(hi) if hi < math.inf else 0.0
        distortion += second - 2 * level * mean + level**2 * mass
    assert distortion == pytest.approx(DISTORTION[bits], abs=2e-6)


@pytest.mark.parametrize("bits", BITS)
def test_gaussian_error_is_the_lloyd_max_distortion(bits: int) -> None:
    # After the rotation a Gaussian block is still Gaussian, so the relative mean square
    # error is about D_b; picking each block's best trial scale with its least-squares
    # refit can only lower it (the RMS alone gives 0.93-0.99 D_b; measured 0.81-0.98 D_b).
    x = _gaussian()
    rel2 = _rel(decode(encode(x, bits)), x) ** 2
    assert 0.75 * DISTORTION[bits] <= rel2 <= 1.0 * DISTORTION[bits]


@pytest.mark.parametrize("scale", ["least-squares", "unshrunk"])
@pytest.mark.parametrize("bits", BITS)
def test_block_error_never_exceeds_the_block_norm(bits: int, scale: str) -> None:
    # The least-squares scale guarantees it for any input: spikes, heavy tails, constants.
    # The unshrunk scale keeps to codes within 45 degrees of their block, where its error
    # is at most the block's norm too (up to the scale's bf16 rounding); a constant block at
    # 2 bits or a spike is farther: least squares there.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, BLOCK, generator=g) ** 3
    x[0] = 0.0
    x[1, 3] = 1e4
    x[2] = 1.5
    x[3] = torch.linspace(-1, 1, BLOCK)
    x[4] = torch.randn(BLOCK, generator=g).sign()
    err = (decode(encode(x, bits, scale=scale)) - x).norm(dim=1)  # type: ignore[arg-type]
    slack = 1e-5 if scale == "least-squares" else 2**-7
    assert (err <= x.norm(dim=1) * (1 + slack) + 1e-30).all()
    assert err[0] == 0.0


def _outliers(seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    x = _gaussian((4, 64, 512), seed)
    channels = [7, 100, 300, 411]
    x[..., channels] *= 30.0
    return x, channels


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotation_keeps_outlier_channels_from_ruining_the_rest(bits: int) -> None:
    # Without the rotation a 30x spike in a block of RMS ~3.9 sits at 7.7 RMS, far past the
    # top level (2.7 at 4 bits): clipped. With it, the error relative to the whole tensor
    # stays near sqrt(D_b), and the other channels' error stays bounded by the block's.
    x, channels = _outliers()
    y = decode(encode(x, bits))
    assert _rel(y, x) <= 1.15 * math.sqrt(DISTORTION[bits])
    identity = _gaussian((4, 64, 512))  # the same values with the outliers left out
    normal = [c for c in range(512) if c not in channels]
    rest = _rel(y[..., normal], x[..., normal])
    baseline = _rel(decode(encode(identity, bits))[..., normal], identity[..., normal])
    # The 4 blocks with an outlier carry 30^2/64 ~ 15x the energy each: their other values
    # get ~sqrt(15) the error; 4 of 8 blocks per row -> at most ~3x overall.
    assert rest <= 3.5 * baseline


def test_round_trip_shape_dtype_and_odd_sizes() -> None:
    for shape in [(), (1,), (63,), (65,), (3, 5, 7), (2, 0, 4), (130, 3)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            x = _gaussian(shape, seed=3).to(dtype)
            enc = encode(x, 2)
            y = decode(enc)
            assert y.shape == x.shape and y.dtype == x.dtype
            blocks = -(-x.numel() // BLOCK)
            assert enc.numel == x.numel()
            assert enc.nbytes == blocks * (8 * 2 + 2)
            if x.numel() >= BLOCK:
                assert _rel(y, x) < 0.45


@pytest.mark.parametrize("bits", BITS)
def test_bytes_per_value(bits: int) -> None:
    x = _gaussian((8, 64, 512))
    enc = encode(x, bits)
    assert enc.nbytes * 8 / enc.numel == bits_per_value(bits) == bits + 0.25
    assert enc.codes.dtype == torch.uint8 and enc.scales.dtype == torch.bfloat16


def test_packing_format_is_little_endian_runs_of_eight() -> None:
    codes = torch.arange(8)
    word = sum(c << (3 * j) for j, c in enumerate(range(8)))
    expected = [(word >> (8 * k)) & 0xFF for k in range(3)]
    assert pack_bits(codes, 3).tolist() == expected
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [0b10000001]
    assert pack_bits(torch.tensor([3, 0, 1, 2, 0, 0, 0, 0]), 2).tolist() == [0b10010011, 0]
    for bits in BITS:
        q = torch.randint(0, 2**bits, (640,), generator=torch.Generator().manual_seed(bits))
        packed = pack_bits(q, bits)
        assert packed.numel() == 640 * bits // 8
        assert torch.equal(unpack_bits(packed, bits), q)


@pytest.mark.parametrize("seed", [None, 5])
def test_encoding_is_deterministic(seed: int | None) -> None:
    x, _ = _outliers()
    a, b = encode(x, 2, seed), encode(x.clone(), 2, seed)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
    assert torch.equal(decode(a), decode(b))


@pytest.mark.parametrize("seed", [None, 0])
def test_nan_or_inf_poisons_exactly_its_block(seed: int | None) -> None:
    x = _gaussian((4, BLOCK))
    x[1, 10] = float("nan")
    x[3, 0] = float("inf")
    y = decode(encode(x, 2, seed))
    assert torch.isnan(y[1]).all() and torch.isnan(y[3]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()
    clean = x[[0, 2]]
    if seed is None:  # the other blocks code as they would alone
        assert torch.equal(y[[0, 2]], decode(encode(clean, 2)))
    else:  # (stochastic: the draws depend on the block's position)
        assert _rel(y[[0, 2]], clean) < 1.0


@pytest.mark.parametrize("bits", [1, 2])
def test_stochastic_rounding_is_unbiased_and_seeded(bits: int) -> None:
    x = _gaussian((16, 256))
    x[:, 3] *= 30.0
    one = decode(encode(x, bits, seed=0))
    assert torch.equal(one, decode(encode(x, bits, seed=0)))
    assert not torch.equal(one, decode(encode(x, bits, seed=1)))
    n = 256
    mean = torch.stack([decode(encode(x, bits, seed=s)) for s in range(n)]).double().mean(0)
    # Unbiased: the mean of n independent codes has 1/sqrt(n) of one code's error (a biased
    # code would keep its bias); 1.3x slack for the estimate's own spread.
    assert _rel(mean, x) <= 1.3 * _rel(one, x) / math.sqrt(n)
    # Nothing clips: in the rotated basis every value lands on one of its two neighbouring
    # levels, scale = absmax / top (rounded up to bf16), so its error is below the widest gap.
    levels = torch.tensor(LEVELS[bits])
    gap = (levels[1:] - levels[:-1]).max() / levels[-1]
    absmax = rotate(to_blocks(x)).abs().amax(dim=1, keepdim=True)
    err = rotate(to_blocks(one) - to_blocks(x)).abs()
    assert (err <= gap * absmax * (1 + 2**-7) + 1e-6).all()


@pytest.mark.parametrize("bits", BITS)
def test_least_squares_codes_shrink_and_unshrunk_codes_do_not(bits: int) -> None:
    # Least squares decodes each block as its projection onto its code: <decoded, y> =
    # ||decoded||^2 = ||y||^2 - ||error||^2, shorter by the whole error (1 - D_b along y).
    # Unshrunk keeps the decoded block's part along y equal to y (up to the scale's bf16
    # rounding) and puts the error at right angles to y: D_b / (1 - D_b) of its energy.
    x = to_blocks(_gaussian())
    for scale, err2 in (
        ("least-squares", DISTORTION[bits]),
        ("unshrunk", DISTORTION[bits] / (1 - DISTORTION[bits])),
    ):
        assert distortion(bits, scale) == err2  # type: ignore[arg-type]
        out = dequantise_blocks(*quantise_blocks(x, bits, scale=scale), bits)  # type: ignore[arg-type]
        parallel = (out * x).sum(dim=1) / x.square().sum(dim=1)
        rel2 = ((out - x).square().sum() / x.square().sum()).item()
        if scale == "unshrunk":  # but for a 1-bit code farther than 45 degrees: 0.07 %
            unshrunk = ((parallel - 1).abs() <= 2**-8).float().mean().item()
            assert unshrunk == 1.0 if bits > 1 else unshrunk > 0.99, unshrunk
        else:
            assert parallel.mean().item() == pytest.approx(1 - rel2, abs=2**-8)
            assert parallel.max().item() < 1.0
        assert 0.75 * err2 <= rel2 <= 1.0 * err2, (scale, rel2)


def test_rejects_bad_input() -> None:
    with pytest.raises(
        ValueError, match="unsupported scale 'longer'; valid: least-squares, unshrunk"
    ):
        encode(torch.zeros(64), 2, scale="longer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale 'unshrunk' is for nearest codes"):
        encode(torch.zeros(64), 2, seed=3, scale="unshrunk")
    with pytest.raises(ValueError, match="unsupported bits 5"):
        encode(torch.zeros(64), 5)
    with pytest.raises(TypeError):
        encode(torch.zeros(64, dtype=torch.int64), 2)
