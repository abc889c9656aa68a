"""Delta codec with per-sample caches: mirrored caches, stale versions, self-correction, skips."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from relaytrain_worker.pipeline.deltacache import (
    DeltaConfig,
    DeltaReceiver,
    DeltaSender,
    StaleCacheError,
)
from relaytrain_worker.pipeline.deltamessage import DeltaMessage
from relaytrain_worker.pipeline.lowbit import BLOCK, DISTORTION

pytestmark = pytest.mark.unit


def _sample(seed: int, shape: tuple[int, ...] = (2, 32, 256)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rel(y: torch.Tensor, x: torch.Tensor) -> float:
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


def _pair(**kw: object) -> tuple[DeltaSender, DeltaReceiver]:
    cfg = DeltaConfig(**kw)  # type: ignore[arg-type]
    return DeltaSender(cfg), DeltaReceiver(cfg)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float32"])
def test_sender_and_receiver_caches_stay_bit_identical(cache_dtype: str) -> None:
    sender, receiver = _pair(full_bits=2, delta_bits=1, skip_below=0.02, cache_dtype=cache_dtype)
    keys = [f"sample-{i}" for i in range(3)]
    base = {k: _sample(i) for i, k in enumerate(keys)}
    drift = {k: _sample(100 + i) * 0.02 for i, k in enumerate(keys)}
    kinds = []
    for epoch in range(12):
        for k in keys:
            x = (base[k] + epoch * drift[k]).to(torch.bfloat16)
            msg = sender.encode(x, k)
            y = receiver.decode(msg)
            kinds.append(msg.kind)
            assert y.dtype == x.dtype and y.shape == x.shape
            assert msg.version == epoch + 1 == sender.version(k) == receiver.version(k)
            a, b = sender.cached(k), receiver.cached(k)
            assert a is not None and b is not None
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bit for bit
            assert torch.equal(y, b.to(y.dtype))  # the output is the cache entry
    assert kinds[:3] == ["full"] * 3 and set(kinds[3:]) == {"delta"}
    assert len(sender) == len(receiver) == 3
    assert sender.cache_nbytes == receiver.cache_nbytes


def test_first_sight_and_shape_change_send_full_codes() -> None:
    sender, receiver = _pair()
    x = _sample(0)
    m1 = sender.encode(x, "k")
    assert (m1.kind, m1.version, m1.base_version) == ("full", 1, None)
    m2 = sender.encode(x, "k")
    assert (m2.kind, m2.version, m2.base_version) == ("delta", 2, 1)
    receiver.decode(m1)
    receiver.decode(m2)
    shorter = _sample(1, (2, 17, 256))
    m3 = sender.encode(shorter, "k")
    assert (m3.kind, m3.version) == ("full", 3)
    assert _rel(receiver.decode(m3), shorter) < 0.36  # 2-bit full code: sqrt(D_2) = 0.34


def test_restarted_receiver_raises_stale_cache_then_reset_resumes_full_codes() -> None:
    sender, receiver = _pair()
    x = _sample(0)
    receiver.decode(sender.encode(x, "alpha"))
    receiver.decode(sender.encode(x, "alpha"))
    receiver.reset()  # a replaced stage comes back empty
    with pytest.raises(StaleCacheError, match=r"'alpha'.*version 2.*no entry") as info:
        receiver.decode(sender.encode(x, "alpha"))
    assert (info.value.key, info.value.base_version, info.value.held_version) == ("alpha", 2, None)
    sender.reset()
    assert len(sender) == 0
    msg = sender.encode(x, "alpha")
    assert msg.kind == "full"
    y = receiver.decode(msg)
    assert _rel(y, x) < 0.36
    nxt = sender.encode(x, "alpha")
    assert nxt.kind == "delta"
    assert _rel(receiver.decode(nxt), x) < 0.36 * math.sqrt(DISTORTION[1]) * 1.1


def test_a_lost_message_raises_stale_cache_naming_both_versions() -> None:
    sender, receiver = _pair()
    x = _sample(0)
    receiver.decode(sender.encode(x, "beta"))
    sender.encode(x * 1.01, "beta")  # version 2, never delivered
    with pytest.raises(StaleCacheError, match=r"'beta'.*version 2.*holds version 1"):
        receiver.decode(sender.encode(x, "beta"))
    sender.forget("beta")
    receiver.decode(sender.encode(x, "beta"))  # full again: resynchronised
    receiver.decode(sender.encode(x, "beta"))


def test_static_sample_error_shrinks_by_sqrt_distortion_per_epoch() -> None:
    # A fresh rotation per version keeps each residual Gaussian to the next code, so each
    # epoch multiplies the error by about sqrt(D_1) = 0.60 (the same rotation every time
    # stalls: 0.60, 0.67, 0.78, 0.87...).
    sender, receiver = _pair(full_bits=2, delta_bits=1, cache_dtype="float32")
    x = _sample(0)
    errs = [_rel(receiver.decode(sender.encode(x, "s")), x) for _ in range(8)]
    for before, after in itertools.pairwise(errs[1:]):
        assert after / before == pytest.approx(math.sqrt(DISTORTION[1]), abs=0.05)
    assert errs[-1] < 0.01


@pytest.mark.parametrize("delta_bits", [1, 2])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float32"])
def test_error_on_a_drifting_sample_does_not_grow(delta_bits: int, cache_dtype: str) -> None:
    # e_k <= sqrt(D) (d + e_(k-1)) settles at most at d sqrt(D) / (1 - sqrt(D)).
    sender, receiver = _pair(full_bits=2, delta_bits=delta_bits, cache_dtype=cache_dtype)
    x0, drift = _sample(0), _sample(1)
    d = 0.02
    errs = []
    for epoch in range(16):
        x = x0 + epoch * d * drift
        y = receiver.decode(sender.encode(x, "s"))
        errs.append(((y - x).norm() / x0.norm()).item())
    root = math.sqrt(DISTORTION[delta_bits])
    limit = d * root / (1 - root) + (0.003 if cache_dtype == "bfloat16" else 0.0)
    assert max(errs[8:]) <= limit
    assert all(e <= errs[1] for e in errs[2:])  # never worse than the first delta
    assert errs[-1] <= errs[1] / 3


def test_skipping_cuts_bytes_and_the_skipped_part_arrives_later() -> None:
    sender, receiver = _pair(full_bits=4, delta_bits=2, skip_below=0.05, cache_dtype="float32")
    x = _sample(0, (8, 256))  # 32 blocks
    for _ in range(6):  # converge: 4-bit then 2-bit deltas until every delta is skipped
        msg = sender.encode(x, "s")
        receiver.decode(msg)
    assert msg.kind == "delta" and msg.sent_blocks == 0
    assert msg.nbytes == 32 // 8  # the bitmap alone
    floor = _rel(receiver.decode(sender.encode(x, "s")), x)
    assert floor < 0.05
    # A 3 % drift in the first block: under the 5 % threshold, skipped...
    bump = torch.zeros_like(x)
    bump[0, :BLOCK] = 0.03 * x[0, :BLOCK].norm() / math.sqrt(BLOCK) * _sample(9, (BLOCK,))
    x1 = x + bump
    m1 = sender.encode(x1, "s")
    y1 = receiver.decode(m1)
    assert m1.sent_blocks == 0
    assert _rel(y1[0, :BLOCK], x1[0, :BLOCK]) >= 0.025  # the receiver lacks it for now
    # ...then another 3 % the same way: the cumulative 6 % is sent, the skipped half too.
    x2 = x1 + bump
    m2 = sender.encode(x2, "s")
    y2 = receiver.decode(m2)
    assert m2.sent_blocks == 1 and m2.sent is not None
    assert m2.nbytes == 32 // 8 + 8 * 2 + 2
    assert _rel(y2[0, :BLOCK], x2[0, :BLOCK]) < 0.06 * math.sqrt(DISTORTION[2]) + 0.01
    assert torch.equal(y2[1:], y1[1:])  # untouched blocks unchanged


def test_skipping_reduces_bytes_on_a_drifting_sample() -> None:
    totals = {}
    for skip in (0.0, 0.05):
        sender, receiver = _pair(full_bits=2, delta_bits=1, skip_below=skip)
        x0, drift = _sample(0), _sample(1)
        total = 0
        for epoch in range(8):
            msg = sender.encode(x0 + epoch * 0.005 * drift, "s")
            receiver.decode(msg)
            total += msg.nbytes
        totals[skip] = total
    assert totals[0.05] < 0.8 * totals[0.0]


def test_nan_travels_as_a_full_code_and_recovers() -> None:
    sender, receiver = _pair()
    x = _sample(0, (4, BLOCK))
    receiver.decode(sender.encode(x, "n"))
    bad = x.clone()
    bad[2, 5] = float("nan")
    m = sender.encode(bad, "n")
    y = receiver.decode(m)
    assert m.kind == "full" and torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()
    m = sender.encode(x, "n")  # the cache holds NaN: full again, not NaN forever
    y = receiver.decode(m)
    assert m.kind == "full" and torch.isfinite(y).all()


def test_message_accounting() -> None:
    sender, _ = _pair(full_bits=3, delta_bits=1)
    x = _sample(0, (3, 100))  # 300 values -> 5 blocks, the last padded
    full = sender.encode(x, "a")
    delta = sender.encode(x, "a")
    assert isinstance(full, DeltaMessage)
    assert (full.numel, full.blocks) == (300, 5)
    assert full.nbytes == 5 * (8 * 3 + 2) and full.sent is None
    assert delta.nbytes == 5 * (8 * 1 + 2)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="bits"):
        DeltaConfig(delta_bits=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip_below"):
        DeltaConfig(skip_below=-0.1)
    with pytest.raises(ValueError, match="cache_dtype"):
        DeltaConfig(cache_dtype="float16")  # type: ignore[arg-type]
