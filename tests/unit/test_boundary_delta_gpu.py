"""The `delta` codec on a GPU stage: rows and gradients on CUDA are coded on the card and
only their codes come to the CPU, where the receiver decodes them into exactly what the
sender's mirror holds (`deltacache.py`), within int4's error, epoch after epoch; the other
tests of the codec run on the CPU (test_boundary_delta.py, test_delta_allocation.py)."""

from __future__ import annotations

import pytest
import torch
from relaytrain_worker.pipeline.allocation import DEEP, DEEP_COST, SHALLOW, allocate_bits
from relaytrain_worker.pipeline.boundary import ROWS, BoundaryCodec, codec_for
from relaytrain_worker.pipeline.lowbit import BLOCK, DISTORTION, dequantise_blocks, quantise_blocks

pytestmark = [pytest.mark.unit, pytest.mark.gpu]


def _cross(
    sender: BoundaryCodec, receiver: BoundaryCodec, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What the receiving end decodes of a frame's floating tensors (as a link's reader)."""
    out = {}
    for entry, parts in sender.encode("activation", tensors):
        assert all(p.device.type == "cpu" for p in parts)  # ready for the wire
        it = iter(parts)
        out[entry["name"]] = receiver.decode(
            "activation", entry, tensors[entry["name"]].dtype, lambda n, dtype, it=it: next(it)
        )
    return out


@pytest.mark.parametrize("receiver_on", ["cpu", "cuda"])
def test_rows_coded_on_the_card_decode_where_received_as_the_mirror_holds(
    receiver_on: str,
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, 512, generator=gen)
    x[..., 5] *= 30.0  # an outlier channel
    rows = torch.tensor([4, 9, 11])
    sender, receiver = BoundaryCodec(), BoundaryCodec()
    receiver.device = None if receiver_on == "cpu" else torch.device("cuda")
    for epoch in range(4):
        hidden = x.to(torch.bfloat16).cuda()
        got = _cross(sender, receiver, {"hidden": hidden, ROWS: rows})["hidden"]
        assert got.device.type == receiver_on and got.dtype == torch.bfloat16
        for i, row in enumerate(rows.tolist()):
            key = f"activation:{row}"
            assert torch.equal(sender.sender.cached(key), receiver.receiver.cached(key))
            assert torch.equal(got[i].cpu(), receiver.receiver.cached(key).to(torch.bfloat16))
        exact = hidden.float().cpu()
        error = (got.float().cpu() - exact).square().sum() / exact.square().sum()
        assert error <= DISTORTION[4] * 1.25, (epoch, float(error))
        x = x + 0.05 * x.std() * torch.randn(x.shape, generator=gen)  # the next epoch's drift
    assert sender.full_codes == 3 and sender.delta_codes == 9


@pytest.mark.parametrize("receiver_on", ["cpu", "cuda"])
def test_gradients_coded_on_the_card_keep_their_zero_tokens(receiver_on: str) -> None:
    g = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1))
    g[1, 40:] = 0  # tokens with no gradient (padding, or not drawn)
    receiver = BoundaryCodec()
    receiver.device = None if receiver_on == "cpu" else torch.device("cuda")
    got = _cross(BoundaryCodec(), receiver, {"grad": g.cuda()})["grad"]
    assert got.device.type == receiver_on
    got = got.cpu()
    assert torch.equal(got[1, 40:], torch.zeros_like(got[1, 40:]))
    error = (got - g).square().sum() / g.square().sum()
    assert error <= DISTORTION[3] * 1.25, float(error)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_a_code_decodes_to_the_same_bits_on_the_card_as_on_the_cpu(bits: int) -> None:
    """What lets the sender's mirror decode on its card while the receiver decodes on its
    CPU (or another card): no division, no reduction, nothing a device may round its way."""
    x = torch.randn(4096, BLOCK, generator=torch.Generator().manual_seed(bits)) * 3.0
    x[:, 7] *= 40.0
    for variant in (0, 1, 17):
        codes, scales = quantise_blocks(x, bits, variant=variant)  # type: ignore[arg-type]
        cpu = dequantise_blocks(codes, scales, bits, variant)  # type: ignore[arg-type]
        card = dequantise_blocks(codes.cuda(), scales.cuda(), bits, variant)  # type: ignore[arg-type]
        assert torch.equal(card.cpu(), cpu), (bits, variant)


@pytest.mark.parametrize("deep", [False, True])
def test_a_row_is_allocated_on_the_card_within_its_budget_at_the_cpus_cost(deep: bool) -> None:
    """The sender allocates a row's bits where the row is (`allocation.allocate_bits`): on a
    GPU stage its card, not one CPU thread (the 2026-12-04 card run's 2.3-3 s steps). The
    bits stay on the card, meet the budget and cost what the CPU's allocation costs (their
    sums may round apart at a breakpoint: one block's step at most)."""
    gen = torch.Generator().manual_seed(5)
    energy = torch.randn(32768, generator=gen).square() * torch.rand(32768, generator=gen) ** 4
    table, cost = (DEEP, DEEP_COST) if deep else (SHALLOW, None)
    price = DEEP_COST if deep else tuple(range(len(SHALLOW)))  # wire bits a value, by bits
    for share in (0.012, 0.05, 0.3):  # at 4 bits a block the error is about 0.01
        budget = float(energy.sum()) * share
        cpu = allocate_bits(energy, budget, table=table, cost=cost)
        card = allocate_bits(energy.cuda(), budget, table=table, cost=cost)
        assert card.device.type == "cuda"
        error = float((torch.tensor(table, dtype=torch.float64)[card.cpu()] * energy).sum())
        assert error <= budget * (1 + 1e-9), (share, error, budget)
        wire = [sum(price[b] for b in bits.tolist()) for bits in (card, cpu)]
        assert abs(wire[0] - wire[1]) <= max(price), (share, wire)


@pytest.mark.parametrize(
    ("sender_on", "receiver_on"), [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")]
)
def test_rows_coded_in_fitted_bases_decode_on_another_device_as_the_mirror_holds(
    sender_on: str, receiver_on: str
) -> None:
    """`pipeline.activationBasis: fitted` (transform.py): a basis is fitted where the sender
    codes, sent in bf16, and installed alike on both ends; a code's change is its coordinates
    times the basis, a matrix product a card and a CPU may round apart in float32's last bit.
    Two ends on different devices hold the same rows within that rounding (the bf16 cache may
    round a value the other way: one bf16 step of it), epoch after epoch, within int4's error;
    two cards hold the same bits."""
    gen = torch.Generator().manual_seed(2)
    mix = torch.linalg.qr(torch.randn(256, 256, generator=gen)).Q
    scale = torch.logspace(1, -2, 256)  # energy in a few directions, as in a boundary
    sender, receiver = codec_for("int4", transform=True), codec_for("int4", transform=True)
    sender.sender.fitter.switch = 0  # rows coded in a basis from the frame that carries it
    receiver.device = None if receiver_on == "cpu" else torch.device(receiver_on)
    rows = [torch.randn(3, 64, 256, generator=gen) * scale @ mix.T for _ in range(6)]
    frames = [(f, rows[f]) for f in range(6)]  # new rows: full codes, a basis after 4 frames
    for epoch in range(1, 7):  # the first frame's rows again, drifting: deltas
        drift = torch.randn(3, 64, 256, generator=gen) * scale @ mix.T
        frames.append((0, rows[0] + 0.1 * epoch * drift))
    for f, x in frames:
        index = torch.arange(3 * f, 3 * f + 3)
        hidden = x.to(torch.bfloat16).to(sender_on)
        got = _cross(sender, receiver, {"hidden": hidden, ROWS: index})["hidden"]
        assert got.device.type == receiver_on and got.dtype == torch.bfloat16
        for row in index.tolist():
            mirror = sender.sender.cached(f"activation:{row}").float()
            held = receiver.receiver.cached(f"activation:{row}").float()
            if sender_on == receiver_on:
                assert torch.equal(held, mirror), (f, row)
            else:
                apart = (held - mirror).abs().max() / mirror.abs().max()
                assert apart <= 2**-7, (f, row, float(apart))
        exact = hidden.float().cpu()
        error = (got.float().cpu() - exact).square().sum() / exact.square().sum()
        assert error <= DISTORTION[4] * 1.25, (f, float(error))
    # Both kinds were fitted and used: full codes from frame 5, deltas from the last two.
    for against in (False, True):
        assert sender.sender.bases.held(against) == 1 == receiver.receiver.bases.held(against)
