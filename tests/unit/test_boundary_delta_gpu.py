"""The `delta` codec on a GPU stage: rows and gradients on CUDA are coded on the card and
only their codes come to the CPU, where the receiver decodes them into exactly what the
sender's mirror holds (`deltacache.py`), within int4's error, epoch after epoch; the other
tests of the codec run on the CPU (test_boundary_delta.py, test_delta_allocation.py)."""

from __future__ import annotations

import pytest
import torch
from relaytrain_worker.pipeline.boundary import ROWS, BoundaryCodec
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
