"""Transform-coded boundary rows (`DeltaConfig.transform`, pipeline/transform.py): bases fitted
from what was coded, sent ahead of the rows coded in them, the same on both ends, named by the
codes; the identity after a restart; a code in a basis the receiver lacks breaks the link; and
the 0-8-bit allocation against its definition."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
import torch
from relaytrain_testkit.linkcreds import link_pair, stage_credentials
from relaytrain_worker.pipeline import allocation, transform
from relaytrain_worker.pipeline.allocation import DEEP, DEEP_COST, allocate_bits
from relaytrain_worker.pipeline.boundary import FULL_BITS, ROWS, BoundaryCodec
from relaytrain_worker.pipeline.deltacache import DeltaConfig, DeltaSender
from relaytrain_worker.pipeline.lowbit import BLOCK, DISTORTION
from relaytrain_worker.pipeline.transport import Frame, Link, LinkBroken

pytestmark = pytest.mark.unit

CREDS = stage_credentials(2, job="transform")
TRANSFORMED = DeltaConfig(full_bits=FULL_BITS, allocate=True, transform=True)
ALLOCATED = DeltaConfig(full_bits=FULL_BITS, allocate=True)
ROWS_TOTAL, PER_MICRO, SEQ, HIDDEN = 16, 2, 16, 128
FRAMES = ROWS_TOTAL // PER_MICRO


def _pair(config: DeltaConfig, switch: int | None = None) -> tuple[Link, Link]:
    """A link whose sender codes rows in a basis ``switch`` frames after the one that carries
    it (None: the worker's rule, `transform.switch_frames`, which at this width is at once)."""
    up, down = link_pair(CREDS, "transform")
    up.codec, down.codec = BoundaryCodec(config), BoundaryCodec(config)
    up.codec.sender.fitter.switch = switch
    return up, down


@pytest.fixture
def transformed() -> Iterator[tuple[Link, Link]]:
    up, down = _pair(TRANSFORMED)
    yield up, down
    up.close()
    down.close()


def _rows(seed: int = 0, count: int = ROWS_TOTAL) -> torch.Tensor:
    """Rows whose tokens live mostly in a few directions, as a model's hidden states do: a
    fixed mixing with a spectrum falling a hundredfold."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(99))
    mixing *= torch.logspace(0, -2, HIDDEN)[None, :]
    return torch.randn(count, SEQ, HIDDEN, generator=gen) @ mixing.T


def _epoch(up: Link, down: Link, data: torch.Tensor, step: int, first_row: int = 0) -> float:
    """Send every row of ``data`` once, PER_MICRO a frame; returns the largest relative error
    of a decoded row, checking that both ends hold the same bits for each."""
    worst = 0.0
    for m in range(len(data) // PER_MICRO):
        rows = torch.arange(m * PER_MICRO, (m + 1) * PER_MICRO)
        tensors = {"hidden": data[rows], ROWS: rows + first_row}
        up.send(Frame("activation", step, m, tensors), "delta")
        got = down.recv(timeout=10).tensors["hidden"]
        for i, row in enumerate((rows + first_row).tolist()):
            mine = up.codec.sender.cached(f"activation:{row}")
            theirs = down.codec.receiver.cached(f"activation:{row}")
            assert mine is not None and theirs is not None
            assert torch.equal(mine, theirs)
            assert torch.equal(got[i], theirs.to(torch.float32))
            error = (got[i] - data[rows[i]]).norm() / data[rows[i]].norm()
            worst = max(worst, float(error))
    return worst


def test_bases_are_fitted_sent_once_held_alike_and_cut_the_bits_of_new_rows(
    transformed: tuple[Link, Link],
) -> None:
    up, down = transformed
    data = _rows()
    errors = [_epoch(up, down, data, 0)]
    # After FIRST_FIT frames of full codes the sender fitted a basis for them; it went ahead
    # of the next frame's rows and both ends hold it, the same orthonormal values.
    sender, receiver = up.codec.sender.bases, down.codec.receiver.bases
    assert transform.FIRST_FIT < FRAMES
    assert sender.held(False) == receiver.held(False) == 1
    basis = receiver.use("test", False, 1, torch.device("cpu"))
    assert basis is not None
    assert torch.equal(basis, sender.use("test", False, 1, torch.device("cpu")))
    assert torch.allclose(basis.T @ basis, torch.eye(HIDDEN), atol=1e-5)
    # Its first vector is the rows' largest direction (the definition: the top eigenvector
    # of the second moment of what was coded in the first FIRST_FIT frames, each token
    # weighed as the allocation weighs it, by its row's mean token energy over its own).
    first = data[: transform.FIRST_FIT * PER_MICRO].double()
    energy = first.square().sum(dim=-1, keepdim=True)
    weighed = first * (energy.mean(dim=1, keepdim=True) / energy)
    top = torch.linalg.eigh(weighed.reshape(-1, HIDDEN).T @ first.reshape(-1, HIDDEN)).eigenvectors[
        :, -1
    ]
    assert abs(float(basis[:, 0].double() @ top)) > 0.99
    # New rows coded in it cost fewer bits than the same rows coded without a basis, at
    # the same error bound.
    fresh = _rows(seed=1)
    before = up.coded_bytes_sent  # the codes, before deflate
    errors.append(_epoch(up, down, fresh, 1, first_row=ROWS_TOTAL))
    in_basis = up.coded_bytes_sent - before
    plain_up, plain_down = _pair(ALLOCATED)
    with plain_up, plain_down:
        _epoch(plain_up, plain_down, data, 0)
        before = plain_up.coded_bytes_sent
        errors.append(_epoch(plain_up, plain_down, fresh, 1, first_row=ROWS_TOTAL))
        plain = plain_up.coded_bytes_sent - before
    assert in_basis < 0.8 * plain, (in_basis, plain)
    assert max(errors) < 0.11, errors  # int4's expected error: sqrt(D_4) = 9.7 %


def test_rows_are_coded_in_a_basis_some_frames_after_it_and_its_qr_runs_beside_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each end's QR of a basis runs beside the frames: the frame that carries it and the
    `transform.SWITCH` - 1 after it (at a width of 4096; set here at this one) cross while the
    QR has not ended, coded in the identity; from the next the rows are coded in it at both
    ends, the same bits. Under a width of 2048 the rows switch at once."""
    assert transform.switch_frames(HIDDEN) == 0 == transform.switch_frames(2047)
    assert transform.switch_frames(4096) == transform.SWITCH
    released = threading.Event()
    started: list[int] = []

    def held_back(values: torch.Tensor) -> torch.Tensor:
        started.append(values.shape[0])
        assert released.wait(timeout=60), "the test never released the QR"
        return orthonormal(values)

    orthonormal = transform.orthonormal
    monkeypatch.setattr(transform, "orthonormal", held_back)
    up, down = _pair(TRANSFORMED, switch=transform.SWITCH)
    data = _rows(count=PER_MICRO * (transform.FIRST_FIT + transform.SWITCH + 2))
    sender, receiver = up.codec.sender.bases, down.codec.receiver.bases
    seen = []
    with up, down:
        for m in range(len(data) // PER_MICRO):
            if m == transform.FIRST_FIT + transform.SWITCH:
                # both ends' QRs are still held back here: the frames crossed without them
                assert started == [HIDDEN, HIDDEN]
                released.set()
            _epoch(up, down, data[m * PER_MICRO : (m + 1) * PER_MICRO], m, m * PER_MICRO)
            seen.append((sender.held(False), sender.current(False, HIDDEN)))
            assert receiver.current(False, HIDDEN) == sender.current(False, HIDDEN)
    carried = transform.FIRST_FIT  # the frame after FIRST_FIT frames of full codes
    assert seen[carried - 1] == (0, 0) and seen[carried] == (1, 0)
    assert seen[carried + transform.SWITCH - 1] == (1, 0)
    assert seen[carried + transform.SWITCH] == (1, 1)


def test_a_restarted_link_codes_in_the_identity_and_a_missing_basis_breaks_the_link() -> None:
    data = _rows()
    up, down = _pair(TRANSFORMED)
    with up, down:
        _epoch(up, down, data, 0)
        assert down.codec.receiver.bases.held(False) == 1
    # A replaced stage links anew: both ends start from the identity and full codes.
    up, down = _pair(TRANSFORMED)
    with up, down:
        assert _epoch(up, down, data[:PER_MICRO], 2) < 0.11
        msg = up.codec.sender.encode(data[0], "probe")
        assert (msg.kind, msg.basis) == ("full", 0)
        _epoch(up, down, data, 3)  # fits and sends a basis again
        assert down.codec.receiver.bases.held(False) == 1
        # An end that lost its bases while the other kept them is told which sample and
        # which basis, and the link breaks rather than decoding in the wrong coordinates.
        down.codec.receiver.bases.reset()
        fresh = _rows(seed=2, count=PER_MICRO)
        tensors = {"hidden": fresh, ROWS: torch.arange(100, 100 + PER_MICRO)}
        up.send(Frame("activation", 4, 0, tensors), "delta")
        with pytest.raises(LinkBroken, match=r"sample 'activation:100' is in basis 1 of the full"):
            down.recv(timeout=10)


def test_deltas_get_their_own_basis_and_stay_within_the_error_bound() -> None:
    sender = DeltaSender(TRANSFORMED)
    data = _rows()
    drift = torch.Generator().manual_seed(3)
    squared = []
    for epoch in range(3):
        moved = data + 0.05 * data.std() * torch.randn(data.shape, generator=drift) * epoch
        for m in range(FRAMES):
            sender.fitter.due(sender.bases)
            for row in range(m * PER_MICRO, (m + 1) * PER_MICRO):
                msg = sender.encode(moved[row], str(row))
                decoded = sender.cached(str(row))
                assert decoded is not None
                error = (decoded.float() - moved[row]).square().sum() / moved[row].square().sum()
                squared.append(float(error))
                assert msg.kind == ("full" if epoch == 0 else "delta")
            sender.fitter.end_frame()
    # The allocation holds each row's expected error to int4's (D_4); a row's realised error
    # scatters around it, their mean stays within it.
    assert max(squared) < 1.3 * DISTORTION[4], max(squared)
    assert sum(squared) / len(squared) <= DISTORTION[4], squared
    # Deltas were counted apart from full codes: a basis of each kind, each its own version.
    assert sender.bases.held(True) == 1
    assert sender.bases.held(False) == 1
    assert msg.basis == 1  # the last delta was coded in the deltas' basis


def test_a_row_is_coded_in_the_identity_where_the_held_basis_codes_it_worse() -> None:
    """A basis is fitted to rows sent before; a row whose change lies elsewhere (a delta of an
    epoch whose drift turned) is coded in the identity, which both ends hold, at the bytes it
    costs without a basis; a row like those the basis was fitted to is coded in the basis."""
    up, down = _pair(TRANSFORMED)
    with up, down:
        _epoch(up, down, _rows(), 0)  # fits the full codes' basis to these rows' directions
        assert up.codec.sender.bases.held(False) == 1
        gen = torch.Generator().manual_seed(5)
        # Energy on a few coordinates of the identity: the fitted basis spreads it widely.
        spiky = torch.zeros(PER_MICRO, SEQ, HIDDEN)
        spiky[..., :3] = torch.randn(PER_MICRO, SEQ, 3, generator=gen) * 10
        like = _rows(seed=6, count=PER_MICRO)  # the fitted basis's own kind of row
        sent = {}
        for name, data, first in (("spiky", spiky, 200), ("like", like, 300)):
            before = up.coded_bytes_sent  # the codes' bytes: what deflate then takes is apart
            _epoch(up, down, data, 1, first_row=first)
            sent[name] = up.coded_bytes_sent - before
            msg = up.codec.sender.encode(data[0], f"probe-{name}")
            assert msg.basis == (0 if name == "spiky" else 1), name
    plain_up, plain_down = _pair(ALLOCATED)
    with plain_up, plain_down:
        before = plain_up.coded_bytes_sent
        _epoch(plain_up, plain_down, spiky, 1, first_row=200)
        plain = plain_up.coded_bytes_sent - before
    # In the identity the spiky rows cost about what the allocated code without a basis
    # costs (its bit map is a bit a block wider, its allocation weighs the scales), and less
    # than the same row's code in the basis.
    assert 0.9 * plain <= sent["spiky"] <= 1.1 * plain, (sent, plain)
    tokens = spiky[0].reshape(-1, HIDDEN)
    budget = DISTORTION[FULL_BITS] * float(tokens.square().sum())
    basis = up.codec.sender.bases.use("probe", False, 1, torch.device("cpu"))
    sizes = {
        at: sum(
            t.numel() * t.element_size()
            for t in transform.code_row(tokens, [(at, b)], budget, 1)[1:]
        )
        for at, b in ((0, None), (1, basis))
    }
    assert sizes[0] < 0.8 * sizes[1], sizes


def test_a_basis_travels_in_the_bits_each_vectors_energy_asks_and_reads_back_the_same() -> None:
    """Each vector of a basis gets the fewest bits (0-8) whose error, times its eigenvalue,
    stays within int4's error of a coordinate of mean energy; one of next to no energy is
    not sent (0 bits), and what is read back from the wire is what the sender installed."""
    energies = torch.logspace(2, -6, 48, dtype=torch.float64)
    bits = transform.vector_bits(energies)
    room = DEEP[4] * float(energies.mean())
    for e, b in zip(energies.tolist(), bits.tolist(), strict=True):
        assert e * DEEP[b] <= room or b == transform.MAX_BITS, (e, b)
        assert b == 0 or e * DEEP[b - 1] > room, (e, b)  # the fewest
    assert bits[0] > 4 and bits[-1] == 0 and bool((bits[:-1] >= bits[1:]).all())
    # A width that is not a multiple of a block (64): blocks hold parts of two vectors.
    vectors = torch.linalg.qr(torch.randn(48, 48, generator=torch.Generator().manual_seed(4))).Q
    msg = transform.BasisMessage.code(True, 3, vectors, energies)
    parts = iter([msg.packed, msg.codes, msg.scales])
    got = transform.BasisMessage.read(True, 3, 48, lambda n, dtype: next(parts)[:n])
    assert torch.equal(got.values, msg.values) and torch.equal(got.bits, bits)
    assert msg.nbytes < 0.5 * 2 * 48 * 48  # under half of bf16's bytes
    # Vectors of 0 bits are not sent where their blocks hold no other (here the last ones;
    # at a width that is a multiple of 64, every one); those sent point where they did.
    assert not bool(msg.values[:, -1].any())
    sent = msg.values.norm(dim=0) > 0
    assert int(sent.sum()) < 48 and bool(sent[bits > 0].all())
    cosine = (msg.values * vectors).sum(dim=0) / msg.values.norm(dim=0).clamp_min(1e-30)
    assert float(cosine[bits >= 4].min()) > 0.99, cosine  # the energetic ones precisely
    assert float(cosine[sent].min()) > 0.7, cosine
    wide = transform.BasisMessage.code(False, 1, torch.eye(64), torch.logspace(2, -6, 64))
    assert torch.equal(wide.values.norm(dim=0) > 0, wide.bits > 0)
    held = transform.Bases()
    held.install(got)
    basis = held.use("probe", True, 3, torch.device("cpu"))
    assert basis is not None and torch.allclose(basis.T @ basis, torch.eye(48), atol=1e-5)


def _deep_error(bits: tuple[int, ...] | torch.Tensor, energy: torch.Tensor) -> float:
    return sum(DEEP[int(b)] * float(e) for b, e in zip(bits, energy, strict=True))


def test_the_0_to_8_bit_allocation_is_a_lagrangian_optimum_of_its_table() -> None:
    assert DEEP[5:] == tuple(DISTORTION[4] * DISTORTION[b] for b in (1, 2, 3, 4))
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        energy = torch.exp(2 * torch.randn(4, generator=gen, dtype=torch.float64))
        budget = [DEEP[6], DEEP[4], 0.2][trial % 3] * float(energy.sum())
        bits = allocate_bits(energy, budget, table=DEEP, cost=DEEP_COST)
        got = _deep_error(bits, energy)
        assert got <= budget * (1 + 1e-9)
        # Against every one of the 9^4 allocations: none that costs no more on the wire
        # (codes and scales) leaves less error.
        total = sum(DEEP_COST[int(b)] for b in bits)
        for other in itertools.product(range(9), repeat=4):
            if sum(DEEP_COST[b] for b in other) <= total + 1e-12:
                assert _deep_error(other, energy) >= got * (1 - 1e-9), (trial, other, bits)


def test_a_two_stage_code_decodes_to_its_expected_error_and_a_short_one_is_refused() -> None:
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randn(400, BLOCK, generator=gen)
    for b in (2, 4, 6, 8):
        bits = torch.full((400,), b, dtype=torch.int64)
        codes, scales = allocation.quantise_deep(blocks, bits, version=3)
        assert codes.numel() == 8 * b * 400
        out = allocation.dequantise_deep(
            "x", bits, codes=codes, scales=scales, version=3, device=torch.device("cpu")
        )
        relative = float((out - blocks).square().sum() / blocks.square().sum())
        assert relative < 1.2 * DEEP[b], (b, relative)
    with pytest.raises(ValueError, match=r"sample 'x'.*asks 3200 code bytes"):
        allocation.dequantise_deep(
            "x", bits[:50], codes=codes, scales=scales, version=3, device=torch.device("cpu")
        )
