"""`pipeline.gradientBits` (the bits a value of `delta`'s gradient codes): what a link sends
at each, the noise a byte buys with a share of the tokens (why 1 bit with more tokens beats
3 with fewer), and the spec and the planner that take it. The stage documents and the links
a stage makes: test_activation_error.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from relaytrain_contract import GRADIENT_BITS
from relaytrain_operator.domain.planner import TrainingShape
from relaytrain_operator.domain.planner.link_cost import delta_gradient_bytes, wire_bytes_per_value
from relaytrain_operator.spec import SpecError, parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.linkcreds import linked
from relaytrain_worker.pipeline import lowbit
from relaytrain_worker.pipeline.boundary import codec_for, variant_of
from relaytrain_worker.pipeline.sampling import sample_tokens
from relaytrain_worker.pipeline.transport import Frame, Link

pytestmark = pytest.mark.unit


def _gradient(seed: int = 0) -> torch.Tensor:
    """[2, 32, 128]: tokens whose norms spread over two orders, as a fine-tune's do."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(2, 32, 128, generator=gen)
    return g * torch.rand(2, 32, 1, generator=gen).pow(4)


@pytest.fixture
def link() -> Iterator[tuple[Link, Link]]:
    with linked("bits") as ends:
        yield ends


@pytest.mark.parametrize("bits", [1, 2])
def test_a_link_sends_the_gradients_at_its_bits(link: tuple[Link, Link], bits: int) -> None:
    up, down = link
    up.codec = codec_for("int3", gradient_bits=bits)  # only the sender reads it
    flat = _gradient(2).reshape(-1, 128)
    # Every token: its codes at `bits` and a bf16 scale a block of 64, nothing else.
    up.send(Frame("gradient", 0, 0, {"grad": flat}), "delta")
    got = down.recv(timeout=10).tensors["grad"]
    assert up.coded_bytes_sent == 64 * 128 * (bits + 0.25) / 8
    variant = variant_of(0, 0)  # the frame's rotation, named in it
    assert torch.equal(got, lowbit.decode(lowbit.encode(flat, bits, None, "unshrunk", variant)))
    # A share of them: a map of a bit a token, then the tokens drawn, at `bits`.
    g = sample_tokens(_gradient(1), 0.25, seed=3).reshape(-1, 128)
    live = g.ne(0).any(dim=1)
    before = up.coded_bytes_sent
    up.send(Frame("gradient", 0, 1, {"grad": g}), "delta")
    got = down.recv(timeout=10).tensors["grad"]
    assert up.coded_bytes_sent - before == 64 // 8 + int(live.sum()) * 128 * (bits + 0.25) / 8
    assert not bool(got[~live].any())
    assert variant_of(0, 1) != variant  # a rotation of its own
    want = lowbit.decode(lowbit.encode(g[live], bits, None, "unshrunk", variant_of(0, 1)))
    assert torch.equal(got[live], want)


def test_each_gradient_is_coded_in_a_rotation_of_its_own(link: tuple[Link, Link]) -> None:
    up, down = link
    up.codec = codec_for("int3", gradient_bits=1)
    g = _alike(5).reshape(-1, 128)
    # The same gradient sent 8 times: each code's error is its own, so their mean's error
    # falls as 1 / 8 where one rotation would repeat the same error 8 times (1).
    decoded = []
    for micro in range(8):
        up.send(Frame("gradient", 0, micro, {"grad": g}), "delta")
        decoded.append(down.recv(timeout=10).tensors["grad"])
    one = float((decoded[0] - g).square().sum())
    mean = float((torch.stack(decoded).mean(dim=0) - g).square().sum())
    assert one == pytest.approx(0.57 * float(g.square().sum()), rel=0.1)
    assert mean < 0.25 * one, (mean, one)


def _alike(seed: int = 0) -> torch.Tensor:
    """[2, 32, 128]: tokens whose norms are within 3x of each other."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(2, 32, 128, generator=gen)
    return g * (0.5 + torch.rand(2, 32, 1, generator=gen))


def _noise(g: torch.Tensor, share: float, bits: int, draws: int = 100) -> tuple[float, float]:
    """Over ``draws`` draws of a ``share`` of the tokens of ``g``, coded at ``bits``: the mean
    squared error against the whole gradient, as a share of its energy, and the decoded
    tokens' length along what was drawn, as a share of its (1: no shorter)."""
    g = g.reshape(-1, 128).double()
    energy, error, along, drawn = float(g.square().sum()), 0.0, 0.0, 0.0
    for d in range(draws):
        sent = sample_tokens(g.float(), share, seed=d).double()
        live = sent.ne(0).any(dim=1)
        decoded = torch.zeros_like(sent)
        coded = lowbit.encode(sent[live].float(), bits, scale="unshrunk")
        decoded[live] = lowbit.decode(coded).double()
        error += float((decoded - g).square().sum()) / energy
        along += float((decoded * sent).sum())
        drawn += float(sent.square().sum())
    return error / draws, along / drawn


def test_where_the_draw_decides_more_tokens_at_one_bit_buy_less_noise_than_fewer_at_three() -> None:
    # 0.65 of the tokens at 1 bit cost what 0.25 at 3 bits do (0.65 x 1.25 = 0.25 x 3.25 bits
    # a value, a bf16 scale a block of 64 each).
    three, three_along = _noise(_alike(), 0.25, 3)
    one, one_along = _noise(_alike(), 0.65, 1)
    # Tokens of alike norms are drawn, none sent for sure: each is divided by its probability,
    # its code's error with it, and the draw's own noise, (1 / p - 1) of its energy, is the
    # larger. So for the same bytes, more tokens at fewer bits add less than half the noise,
    # and 0.375 of them at 1 bit add what 0.25 at 3 bits do, at 0.58 of the bytes.
    assert one < 0.5 * three, (one, three)
    assert _noise(_alike(), 0.375, 1)[0] == pytest.approx(three, rel=0.1)
    # Each token crosses no shorter than it was sent (least squares' scale would shrink a
    # 1-bit code to about 0.64 of it, a bias no draw averages away).
    assert one_along == pytest.approx(1.0, abs=0.02) and three_along == pytest.approx(1.0, abs=0.02)
    # Where a few tokens hold the energy they are sent for sure (no draw's noise on them) and
    # their code's error is what is left: there 3 bits on fewer tokens add less.
    assert _noise(_gradient(4), 0.25, 3)[0] < _noise(_gradient(4), 0.65, 1)[0]


def _bits(job: Job, bits: int) -> Job:
    return job.set("spec.pipeline.gradientBits", bits)


def test_the_spec_takes_bits_only_with_delta_and_the_planner_prices_them() -> None:
    job = parse_job(_bits(Job().pipeline(compression="delta"), 1).build())
    assert job.spec.pipeline.gradient_bits == 1
    # 2 by default since 2026-12-07 (3 before): one constant, the contract's, for all of them.
    assert parse_job(Job().build()).spec.pipeline.gradient_bits == GRADIENT_BITS == 2
    assert TrainingShape(1, 4, 256).gradient_bits == GRADIENT_BITS
    assert codec_for().gradient_bits == GRADIENT_BITS
    for bad in (0, 5, "one"):
        with pytest.raises(SpecError) as info:
            parse_job(_bits(Job().pipeline(compression="delta"), bad).build())  # type: ignore[arg-type]
        assert "spec.pipeline.gradientBits" in info.value.paths
        assert "1, 2, 3 or 4" in str(info.value) or "1, 2, 3, 4" in str(info.value), info.value
    for bits in (1, 4):
        with pytest.raises(SpecError, match="needs compression: delta") as info:
            parse_job(_bits(Job().pipeline(compression="int8"), bits).build())
        assert "spec.pipeline.gradientBits" in info.value.paths
    # A job created before holds the old default, 3, stored by the API server: it still
    # parses without delta (and ignores it), as the CRD's rule lets it.
    old = parse_job(_bits(Job().pipeline(compression="int8"), 3).build())
    assert old.spec.pipeline.gradient_bits == 3
    # Priced at its bits and a bf16 scale a block; with a share, that share and a bit a token.
    for bits in (1, 3):
        every = TrainingShape(1, 4, 256, compression="delta", gradient_bits=bits)
        assert wire_bytes_per_value(every, backward=True) == (bits + 0.25) / 8
        share = replace(every, gradient_tokens=0.5)
        assert wire_bytes_per_value(share, backward=True) == pytest.approx(
            delta_gradient_bytes(bits) / 2 + 1 / 512
        )
    with pytest.raises(ValueError, match="gradient_bits must be 1 to 4"):
        TrainingShape(1, 4, 256, compression="delta", gradient_bits=0)
