"""The ``delta`` boundary compression on a real link: each row's activation as a change against
what the other end decoded for it last time, both caches in step, a new connection starting
from full codes, and a stale delta breaking the link with a message naming the sample."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from relaytrain_testkit.linkcreds import link_pair, stage_credentials
from relaytrain_worker.pipeline.boundary import CONFIG, GRADIENT_BITS, ROWS, BoundaryCodec
from relaytrain_worker.pipeline.lowbit import distortion
from relaytrain_worker.pipeline.transport import Frame, Link, LinkBroken

pytestmark = pytest.mark.unit

CREDS = stage_credentials(2, job="delta")
ROWS_TOTAL, PER_MICRO, SEQ, HIDDEN = 8, 2, 32, 128


def _pair() -> tuple[Link, Link]:
    """A fresh connection: (stage 0's link down, stage 1's link up)."""
    return link_pair(CREDS, "delta")


@pytest.fixture
def link() -> Iterator[tuple[Link, Link]]:
    up, down = _pair()
    yield up, down
    up.close()
    down.close()


def _rows(seed: int = 0) -> torch.Tensor:
    """Each row's activation: a fixed part per row plus outlier channels, as hidden states have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS_TOTAL, SEQ, HIDDEN, generator=gen)
    x[..., :3] *= 20
    return x


def _frame(kind: str, step: int, micro: int, hidden: torch.Tensor, rows: torch.Tensor) -> Frame:
    labels = torch.randint(0, 49152, (len(rows), SEQ))
    tensors = {
        "hidden": hidden,
        "attention_mask": torch.ones(len(rows), SEQ, dtype=torch.long),
        "labels": labels,
        ROWS: rows,
    }
    return Frame(kind, step, micro, tensors, {"items": 7})


def _epoch(up: Link, down: Link, data: torch.Tensor, step: int) -> tuple[int, float]:
    """Send every row once in micro-batches of PER_MICRO (a shuffled order); returns the bytes
    the codes took (before the frames' deflate) and the largest relative error of a decoded
    row."""
    before = up.coded_bytes_sent
    order = torch.randperm(ROWS_TOTAL, generator=torch.Generator().manual_seed(step))
    worst = 0.0
    for m in range(ROWS_TOTAL // PER_MICRO):
        rows = order[m * PER_MICRO : (m + 1) * PER_MICRO]
        sent = _frame("activation", step, m, data[rows], rows)
        up.send(sent, "delta")
        got = down.recv(timeout=10)
        assert (got.kind, got.step, got.micro, got.meta) == ("activation", step, m, {"items": 7})
        for name in ("attention_mask", "labels", ROWS):  # integers travel losslessly
            assert torch.equal(got.tensors[name], sent.tensors[name]), name
        assert got.tensors["hidden"].dtype == torch.float32
        for i, row in enumerate(rows.tolist()):
            key = f"activation:{row}"
            # The sender's mirror and the receiver's cache hold the same bits, and the
            # decoded row is that cache entry.
            mine, theirs = up.codec.sender.cached(key), down.codec.receiver.cached(key)
            assert mine is not None and theirs is not None
            assert torch.equal(mine, theirs)
            assert torch.equal(got.tensors["hidden"][i], theirs.to(torch.float32))
            # the root of the mean of its tokens' squared relative errors, which the code
            # holds within a full code's (`allocation.token_weights`)
            each = (got.tensors["hidden"][i] - data[row]).norm(dim=-1) / data[row].norm(dim=-1)
            worst = max(worst, float(each.square().mean().sqrt()))
    return up.coded_bytes_sent - before, worst


def test_later_epochs_send_only_what_changed_and_both_caches_agree(
    link: tuple[Link, Link],
) -> None:
    up, down = link
    base = _rows()
    drift = torch.Generator().manual_seed(1)
    sizes, errors = [], []
    data = base
    for epoch in range(4):
        if epoch:  # adapters move slowly: each row's activation drifts by 1 % per epoch
            data = data + 0.01 * base.std() * torch.randn(base.shape, generator=drift)
        size, error = _epoch(up, down, data, epoch)
        sizes.append(size)
        errors.append(error)
    values = ROWS_TOTAL * SEQ * HIDDEN
    ints = ROWS_TOTAL * SEQ * (1 + 4) + ROWS_TOTAL  # mask uint8, labels int32, rows uint8
    bits = [(size - ints) * 8 / values for size in sizes]
    # Epoch 1 codes every row within int4's error: about int4's 4.25 bits a value, plus
    # 3 bits a block of 64 for its bits. Epoch 2 takes that error down to a quarter
    # (`boundary.ACTIVATION_ERRORS`: about a bit a value); later, a 1 % drift keeps every row
    # within it, so few blocks need bits: the bit maps and a few codes cross, 190x fewer
    # bytes than bf16.
    assert 3.9 < bits[0] <= 4.25 + 3 / 64, bits
    assert 0.5 < bits[1] < 1.25, bits
    assert all(3 / 64 <= b < 0.1 for b in bits[2:]), bits
    assert (up.codec.full_codes, up.codec.delta_codes) == (ROWS_TOTAL, 3 * ROWS_TOTAL)
    # The error: what int4 is expected to leave (sqrt(D_4) = 9.7 %), then half of it (its
    # unshrunk scale's D / (1 - D): 9.79 %, which a row may pass by a little).
    half = 0.5 * math.sqrt(distortion(4, "unshrunk"))
    assert errors[0] < 0.0975 and max(errors[1:]) < 1.01 * half, errors


def test_gradients_and_rows_without_keys_are_coded_alone_and_cached_nowhere(
    link: tuple[Link, Link],
) -> None:
    up, down = link
    grad = torch.randn(PER_MICRO, SEQ, HIDDEN)
    hidden = torch.randn(PER_MICRO, SEQ, HIDDEN)
    up.send(Frame("gradient", 0, 0, {"grad": grad}), "delta")
    up.send(Frame("eval", 0, 0, {"hidden": hidden}), "delta")
    got_grad = down.recv(timeout=10).tensors["grad"]
    got_hidden = down.recv(timeout=10).tensors["hidden"]
    # The gradient at the default's bits (2) and a bf16 scale a block, the rows without keys
    # at int4's 4 bits and theirs.
    assert up.coded_bytes_sent == grad.numel() * (GRADIENT_BITS + 0.25 + 4.25) / 8
    assert up.payload_bytes_sent <= up.coded_bytes_sent  # deflated only where smaller
    error = float((got_grad - grad).norm() / grad.norm())  # 2-bit Lloyd-Max: ~34 %
    assert error < 1.1 * math.sqrt(distortion(GRADIENT_BITS, "unshrunk")), error
    assert float((got_hidden - hidden).norm() / hidden.norm()) < 0.12  # 4-bit: ~9 %
    assert len(up.codec.sender) == len(down.codec.receiver) == 0


def test_a_row_that_changes_more_gets_more_bits_and_never_a_worse_code(
    link: tuple[Link, Link],
) -> None:
    up, down = link
    base = _rows()
    _epoch(up, down, base, 0)
    gen = torch.Generator().manual_seed(2)
    sizes, errors = [], []
    # From a drift of 10 % of a row's norm to 90 %, and then rows unrelated to the last (a
    # change larger than the row: coded against zero, a full code).
    scale = base.norm() / base.numel() ** 0.5
    for epoch, drift in enumerate([0.1, 0.25, 0.45, 0.9], start=1):
        data = base + drift * scale * torch.randn(base.shape, generator=gen)
        size, error = _epoch(up, down, data, epoch)
        sizes.append(size)
        errors.append(error)
        base = data
    size, error = _epoch(up, down, _rows(seed=7), 5)
    sizes.append(size)
    errors.append(error)
    values = ROWS_TOTAL * SEQ * HIDDEN
    ints = ROWS_TOTAL * SEQ * (1 + 4) + ROWS_TOTAL
    bits = [(size - ints) * 8 / values for size in sizes]
    # (a change is held to a quarter of a full code's error, `boundary.ACTIVATION_ERRORS`)
    assert bits == sorted(bits) and bits[0] < 2.5 and 3.9 < bits[-1] <= 4.25 + 3 / 64, bits
    assert up.codec.full_codes == 2 * ROWS_TOTAL  # the first sight, and the row made anew
    # Never worse than int4 is expected to code the row (its unshrunk scale's D / (1 - D),
    # 9.79 %; the bits' budget is that expectation, which a row may pass by a little).
    assert max(errors) < 1.01 * math.sqrt(distortion(4, "unshrunk")), errors


def test_a_row_that_moved_far_takes_a_fresh_code_at_its_first_codes_error() -> None:
    # A row that moved by half its norm again takes int4's error, a fresh code's, where a
    # row that stayed near its last decode is taken down to half of it (the tests above):
    # held to a quarter of its square whatever it moved, the same change costs a bit more
    # a value (each bit quarters a code's error).
    base = _rows()
    gen = torch.Generator().manual_seed(3)
    moved = base + 0.5 * base.norm() / base.numel() ** 0.5 * torch.randn(base.shape, generator=gen)
    bits, errors = {}, {}
    for name, moved_at in (("moved", CONFIG.moved), ("a quarter always", 0.0)):
        up, down = _pair()
        up.codec = BoundaryCodec(dataclasses.replace(CONFIG, moved=moved_at))
        _epoch(up, down, base, 0)
        size, errors[name] = _epoch(up, down, moved, 1)
        bits[name] = size * 8 / (ROWS_TOTAL * SEQ * HIDDEN)
        assert up.codec.delta_codes == ROWS_TOTAL  # changes, not rows made anew
        up.close()
        down.close()
    assert CONFIG.moved > 0 and bits["a quarter always"] - bits["moved"] > 0.7, bits
    full = math.sqrt(distortion(4, "unshrunk"))
    assert 0.7 * full < errors["moved"] < 1.01 * full, errors
    assert errors["a quarter always"] < 1.05 * 0.5 * full, errors  # a row may pass it a little


def _along(got: torch.Tensor, sent: torch.Tensor) -> float:
    """How long ``got`` is along ``sent``, as a share of ``sent``: 1 where nothing shrank."""
    return float((got.double() * sent.double()).sum() / sent.double().square().sum())


def test_rows_and_gradients_cross_no_shorter_than_they_are(link: tuple[Link, Link]) -> None:
    # A least-squares scale decodes every block shorter by its error: int4's rows about
    # 1 % along themselves, int3's gradients 3.5 %, at every crossing, the same way, which
    # cost a fine-tune at a width of 1024 2.2 % of its held-out loss. The worker's codes are
    # unshrunk: a row's full code, a row without a key and each gradient are as long along
    # themselves as they were sent (up to the bf16 scales' rounding, 2**-8 a block).
    up, down = link
    data = _rows()
    up.send(_frame("activation", 0, 0, data, torch.arange(ROWS_TOTAL)), "delta")
    assert abs(_along(down.recv(timeout=10).tensors["hidden"], data) - 1) < 2**-9
    grad = torch.randn(PER_MICRO, SEQ, HIDDEN)
    grad[1, SEQ // 2 :] = 0  # padding: the tokens' map, and the others' codes
    for name, t in (("hidden", data[:2]), ("grad", torch.randn_like(grad)), ("grad", grad)):
        up.send(Frame("eval" if name == "hidden" else "gradient", 0, 0, {name: t}), "delta")
        assert abs(_along(down.recv(timeout=10).tensors[name], t) - 1) < 2**-9, name


def test_a_held_out_row_and_a_training_row_of_one_index_are_different_samples(
    link: tuple[Link, Link],
) -> None:
    up, down = link
    data = _rows()
    rows = torch.tensor([0, 1])
    up.send(_frame("activation", 0, 0, data[:2], rows), "delta")
    up.send(_frame("eval", 0, 0, data[2:4], rows), "delta")
    down.recv(timeout=10)
    got = down.recv(timeout=10).tensors["hidden"]
    assert up.codec.full_codes == 4  # nothing of the training rows was taken as a base
    assert float((got - data[2:4]).norm() / data[2:4].norm()) < 0.12


def test_a_new_connection_starts_from_full_codes_and_a_stale_delta_breaks_the_link() -> None:
    data = _rows()
    up, down = _pair()
    with up, down:
        _epoch(up, down, data, 0)
        _epoch(up, down, data, 1)
        assert up.codec.delta_codes == ROWS_TOTAL
    # A replaced stage links anew: both ends of the new connection start empty, so every row
    # is a full code again (the cache is rebuilt in one epoch, not restored), and decodes.
    up, down = _pair()
    with up, down:
        size, error = _epoch(up, down, data, 2)
        assert size < ROWS_TOTAL * SEQ * HIDDEN * (4.25 + 3 / 64) / 8 * 1.1
        assert (up.codec.full_codes, up.codec.delta_codes) == (ROWS_TOTAL, 0)
        assert error < 0.12
        # An end that lost its entries while the other kept them is told which sample and
        # which versions, and the link is broken rather than training on a wrong base.
        down.codec.receiver.forget("activation:3")
        up.send(_frame("activation", 3, 0, data[[3]], torch.tensor([3])), "delta")
        with pytest.raises(LinkBroken, match=r"sample 'activation:3' is against cache version 1"):
            down.recv(timeout=10)
