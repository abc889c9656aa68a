"""Transform coding of a boundary's rows (`DeltaConfig.transform`): each token's change against
its reference is coded in a basis fitted to such changes (a Karhunen-Loeve transform), where a
few coordinates hold most of the energy, instead of in Hadamard-rotated blocks, where energy
is spread evenly on purpose (right for a uniform code, wrong for an allocation).

The sender keeps the second moment of what it coded, ``sum c^T c`` over the tokens ``c`` of
each row's change, one for rows coded against zero (full codes) and one for rows coded against
their cache (deltas): the two differ (a row against zero holds the model's large fixed
directions, a delta the adapters' small moving ones). After `FIRST_FIT` frames with rows of a
kind, and every ``refit`` such frames after, it fits that kind's basis: the eigenvectors of
the moment, largest eigenvalue first, sent as a `BasisMessage` ahead of the rows coded in it.
Each vector is coded in the bits its eigenvalue asks (`vector_bits`: 0-8, the energetic ones
at 7-8, those of next to no energy not at all), which took a basis from 16 bits a value (bf16,
until 2026-11-30) to about 3.7 on the tiny fine-tune measured, its rows costing 1 % more.
Both ends turn what was sent into the basis they use the same way: a QR in float64 on the
CPU (`Bases.install`), so the decoded vectors are orthonormal again, the QR completes those
not sent, and the two ends hold the same float32 values. The QR runs in a thread beside the
frames (5.4-8.6 s of one CPU thread an end at 4096): the sender codes rows in a basis from
`switch_frames` frames after the one that carries it (8 at 4096, none under 2048), each end
waiting for its QR only where it has not ended by then (since 2026-12-06; until then both ran
it in the frame that carried the basis). A code names its basis by version
(`DeltaMessage.basis`); version 0 is the identity, which both ends hold from the start, so two
ends that start again (a replaced stage, a re-link) code in the identity until the first fit.
A code naming a basis this end does not hold is a broken link (`StaleBasisError`).

In a basis, each block of 64 coordinates gets 0-8 bits (`allocation.deep`): up to 4 a
rotated Lloyd-Max code of the block (`lowbit.py`), above 4 that code and a 1-4-bit code of
what it left (variants ``2 v`` and ``2 v + 1`` of the entry's version ``v``), within the same
expected error as the allocated code without a basis. On a fine-tune's boundary this gave the
same held-out loss at fewer bits a value (docs/links-and-checkpoints.md, "Design experiment:
transform coding").

Equality of the two ends. Codes and their decode in coordinates are bit-exact as in
`deltacache.py`; the change is ``coordinates @ basis^T``, a matrix product, which two devices
of different kinds may round differently in float32's last bit. Both ends of a CPU link
agree bit for bit (tests/unit/test_transform_coding.py); two cards of one kind run the same
kernels (tests/unit/test_boundary_delta_gpu.py, `gpu`, checks both that and a card against
the CPU, where a GPU host runs it). Otherwise the entries can differ by that rounding,
which the next full code of the row clears and which a delta carries forward without growing
it beyond a few float32 ulps an epoch: far below the codes' error (int4: about 10 % of a
row's norm).

Memory: on the sender two moments of ``h x h`` float64 where the rows are coded (256 MiB on a
4096-wide boundary), and on each end two bases of ``h x h`` float32 on the CPU and on the
device that codes or decodes (64 MiB each at 4096), and on the CPU, for the `SWITCH` frames
after one is sent, the newest of its kind and its QR's float64 work. A basis on the wire is at
most ``(8.5 h^2 + 4 h) / 8`` bytes (every vector at 8 bits), at 4096 about 17 MiB.

Hand-written: the fit is torch's ``eigh`` and ``qr`` (the QR in a `concurrent.futures` thread
pool); what is written here is which frames fit, when the rows switch to a basis and the
message that carries a basis, which no library has (the two-stage code of 5-8 bits:
`allocation.quantise_deep`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from relaytrain_worker.pipeline.allocation import (
    DEEP,
    DEEP_COST,
    allocate_bits,
    deep,
    dequantise_deep,
    quantise_deep,
)
from relaytrain_worker.pipeline.lowbit import (
    BLOCK,
    Scale,
    from_blocks,
    pack_bits,
    to_blocks,
    unpack_bits,
)

FIRST_FIT = 4
"""Frames with rows of a kind coded in the identity before that kind's first basis."""
REFIT = 96
"""Frames with rows of a kind between two bases of it (after the first)."""
SWITCH = 8
"""Frames after the one that carries a basis of width 4096 before its rows are coded in it:
each end's QR of it runs beside them (`Bases.install`, `switch_frames`)."""


def switch_frames(width: int) -> int:
    """Frames between the one that carries a basis of ``width`` and the first coded in it: none
    under 2048, where a QR takes a fifth of a second of one thread and the rows switch at once
    (as all did until 2026-12-06); from 2048 growing with the width, ``SWITCH`` at 4096."""
    return 0 if width < 2048 else SWITCH * width // 4096


MAX_BITS = 8
"""The most bits a block of coordinates gets."""
MAP_BITS = 4
"""Bits a block's allocation (0-8) takes in a transformed code's bit map."""
CPU = torch.device("cpu")
_COST = torch.tensor(DEEP_COST, dtype=torch.float64)
_QR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="relaytrain-basis")
"""Where the bases' QRs run, beside the frames (a process's links share it)."""


class StaleBasisError(ValueError):
    """A code names a basis this end does not hold."""

    def __init__(self, key: str, against: bool, version: int, held: int) -> None:
        kind = "deltas" if against else "full codes"
        super().__init__(
            f"code for sample {key!r} is in basis {version} of the {kind}, but this end holds "
            f"basis {held} of them; the ends must start again (a reset) from the identity"
        )


@dataclass(frozen=True)
class BasisMessage:
    """One basis on the wire: its kind, its version, its code and the vectors the code
    decodes to (what both ends install)."""

    against: bool
    """True: the basis of deltas (rows coded against their cache); False: of full codes."""
    version: int
    """1, 2, ...: the name codes in it carry (0, the identity, is never sent)."""
    values: torch.Tensor
    """``[h, h]`` float32 CPU: the basis vectors as columns, largest eigenvalue first, as
    decoded from the code (a vector of 0 bits decodes to zeros)."""
    bits: torch.Tensor
    """int64 ``[h]``: bits a value of each vector's code (`vector_bits`)."""
    codes: torch.Tensor
    """uint8 CPU: the vectors' code, one after the other (`allocation.quantise_deep`)."""
    scales: torch.Tensor
    """bf16 CPU: its scales."""

    @property
    def packed(self) -> torch.Tensor:
        """The vectors' bits on the wire (``MAP_BITS`` a vector)."""
        return pack_map(self.bits)

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire."""
        return self.packed.numel() + self.codes.numel() + 2 * self.scales.numel()

    @classmethod
    def code(
        cls, against: bool, version: int, vectors: torch.Tensor, energies: torch.Tensor
    ) -> BasisMessage:
        """The message of a basis whose float ``[h, h]`` ``vectors`` are columns, each vector
        coded in the bits its share of the moment's ``energies`` (eigenvalues) asks. Coded
        and decoded where ``vectors`` are (the sender's card, where it fitted them; decoding
        is bit-exact on any device), the code and the decoded vectors brought to the CPU."""
        bits = vector_bits(energies)
        blocks = to_blocks(vectors.T.float())  # vector after vector
        each = _block_bits(bits).to(blocks.device)
        codes, scales = quantise_deep(blocks, each, version)
        values = _vectors(each, bits.numel(), codes, scales, version, device=blocks.device)
        return cls(against, version, values, bits, codes, scales)

    @classmethod
    def read(
        cls, against: bool, version: int, width: int, read: Callable[..., torch.Tensor]
    ) -> BasisMessage:
        """The message a frame entry's ``[against, version, width]`` names, its bit map and
        code taken from ``read(count, dtype)`` (the frame's next parts)."""
        if width < 1:
            raise ValueError(f"a basis of width {width} cannot be read")
        bits = unpack_map(read(MAP_BITS * -(-width // 8), torch.uint8), width).to(torch.int64)
        each = _block_bits(bits)
        codes = read(8 * int(each.sum()), torch.uint8)
        scales = read(int((each > 0).sum() + (each > 4).sum()), torch.bfloat16)
        values = _vectors(each, width, codes, scales, version)
        return cls(against, version, values, bits, codes, scales)


def vector_bits(energies: torch.Tensor) -> torch.Tensor:
    """Bits a value of each basis vector gets (0-8): the fewest whose expected error, times
    the vector's energy (its eigenvalue), stays within int4's error of a coordinate of mean
    energy. An imprecise vector leaks that much of its energy into the others, where it
    costs bits; a vector of 0 bits (next to no energy) is not sent, and the QR that installs
    the basis completes it, the same on both ends."""
    e = energies.to(torch.float64).clamp_min(0).cpu()
    room = DEEP[4] * float(e.mean())
    table = torch.tensor(DEEP, dtype=torch.float64)
    # the fewest bits b with e * DEEP[b] <= room (DEEP falls with b)
    return (e[:, None] * table[None, :] > room).sum(dim=1).clamp_max(MAX_BITS)


def _block_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bits of each block of 64 values of the vectors laid one after the other: its vector's
    (the most of those it holds, where a width is not a multiple of 64)."""
    width = bits.numel()
    each = bits.to(torch.uint8).repeat_interleave(width)
    each = torch.nn.functional.pad(each, (0, (-each.numel()) % BLOCK))
    return each.reshape(-1, BLOCK).amax(dim=1).to(torch.int64)


def _vectors(
    each: torch.Tensor,
    width: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    version: int,
    *,
    device: torch.device = CPU,
) -> torch.Tensor:
    """The ``[width, width]`` float32 columns a basis's code decodes to (``each``, its blocks'
    bits: `_block_bits`), decoded on ``device`` (the same bits anywhere) and returned on the
    CPU."""
    each = each.to(device)
    key = f"basis {version}"
    flat = dequantise_deep(key, each, codes=codes, scales=scales, version=version, device=device)
    return from_blocks(flat, (width, width), torch.float32).T.contiguous().cpu()


@dataclass
class _Held:
    version: int = 0
    basis: torch.Tensor | None = None
    """``[h, h]`` float32 CPU, orthonormal; None: the identity."""
    on: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    """The basis copied to each device that used it."""


def orthonormal(values: torch.Tensor) -> torch.Tensor:
    """A basis's decoded vectors orthonormalised, and those not sent completed: a float64 QR
    on the CPU, cast to float32 (the same values on both ends)."""
    q: torch.Tensor = torch.linalg.qr(values.to(torch.float64).cpu()).Q
    return q.to(torch.float32)


class Bases:
    """The bases one end of a link holds: per kind, the identity or the last one switched to,
    and the newest installed, whose QR runs beside the frames until it is switched to."""

    def __init__(self) -> None:
        self._held = {False: _Held(), True: _Held()}
        self._pending: dict[bool, tuple[int, Future[torch.Tensor]]] = {}

    def reset(self) -> None:
        """Back to the identity for both kinds (what a restarted end holds); a QR still
        running is left to end unread."""
        self._held = {False: _Held(), True: _Held()}
        self._pending = {}

    def install(self, msg: BasisMessage) -> None:
        """Take ``msg``'s basis (`orthonormal`), its QR in a thread beside the frames: rows
        are coded in it once `switch`ed to, and a code naming it switches to it (`use`),
        either waiting for the QR where it has not ended."""
        newest = self.held(msg.against)
        if msg.version <= newest:
            raise ValueError(
                f"basis {msg.version} arrived after basis {newest} of its kind: "
                "bases are numbered in the order they are sent"
            )
        if msg.values.dim() != 2 or msg.values.shape[0] != msg.values.shape[1]:
            raise ValueError(f"a basis must be square, got shape {list(msg.values.shape)}")
        self.switch(msg.against)  # one installed before and never used: held from now
        self._pending[msg.against] = (msg.version, _QR.submit(orthonormal, msg.values))

    def switch(self, against: bool) -> None:
        """Hold the newest basis installed of a kind, once its QR has ended (if one is)."""
        pending = self._pending.pop(against, None)
        if pending is not None:
            self._held[against] = _Held(pending[0], pending[1].result())

    def current(self, against: bool, width: int) -> int:
        """The version a row of ``width`` values a token is coded in: the held basis where it
        has that width, else the identity (0)."""
        held = self._held[against]
        return held.version if held.basis is not None and held.basis.shape[0] == width else 0

    def candidates(
        self, key: str, against: bool, width: int, device: torch.device
    ) -> list[tuple[int, torch.Tensor | None]]:
        """What a row of ``width`` values a token may be coded in (`code_row`): the held basis
        of its kind where it has that width, and the identity, which both ends always hold."""
        held = self.current(against, width)
        if held == 0:
            return [(0, None)]
        return [(held, self.use(key, against, held, device)), (0, None)]

    def held(self, against: bool) -> int:
        """The newest version of a kind this end holds (its QR perhaps still running)."""
        pending = self._pending.get(against)
        return self._held[against].version if pending is None else pending[0]

    def use(
        self, key: str, against: bool, version: int, device: torch.device
    ) -> torch.Tensor | None:
        """The basis ``version`` of a kind on ``device`` (None: the identity); raises
        StaleBasisError where this end holds another."""
        if version == 0:
            return None
        if version == self.held(against):
            self.switch(against)
        held = self._held[against]
        if held.version != version or held.basis is None:
            raise StaleBasisError(key, against, version, self.held(against))
        if device not in held.on:
            held.on[device] = held.basis.to(device)
        return held.on[device]


class Fitter:
    """The sender's moments per kind and when each kind's next basis is due."""

    def __init__(self, refit: int = REFIT, first_fit: int = FIRST_FIT) -> None:
        if refit < 1 or first_fit < 1:
            raise ValueError(f"refit and first_fit must be >= 1, got {refit} and {first_fit}")
        self.refit = refit
        self.first_fit = first_fit
        self.switch: int | None = None
        """Frames after the one that carries a basis before its rows are coded in it (None:
        `switch_frames` of its width; a test may set its own)."""
        self._moments: dict[bool, torch.Tensor | None] = {}
        self._frames: dict[bool, int] = {}
        self._in_frame: set[bool] = set()
        self._due: set[bool] = set()
        self._switch_in: dict[bool, int] = {}
        self.switched: list[bool] = []
        """The kinds whose rows the last `due` switched to their newest basis."""
        self.reset()

    def reset(self) -> None:
        """Forget the moments and the counts (a restarted link starts from the identity)."""
        self._moments = {False: None, True: None}
        self._frames = {False: 0, True: 0}
        self._in_frame.clear()
        self._due.clear()
        self._switch_in = {}

    def add(self, against: bool, change: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Count one row's change (``[tokens, h]`` float32, where it was coded), each block of
        it (`lowbit.to_blocks`) weighed by ``weight`` as the allocation weighs it
        (`allocation.token_weights`): the basis that best codes a row is the eigenvectors of
        its tokens' moment weighed so, not one that a token of massive activations decides."""
        weighed = change
        if weight is not None:
            each = weight.to(change.dtype).repeat_interleave(BLOCK)[: change.numel()]
            weighed = change * each.reshape(change.shape)
        m = (weighed.T @ change).to(torch.float64)
        held = self._moments[against]
        if held is not None and held.shape != m.shape:
            held = None  # a row of another width: start the moment again
        self._moments[against] = m if held is None else held.add_(m)
        self._in_frame.add(against)

    def end_frame(self) -> None:
        """A frame's rows are coded: count it for each kind it held."""
        for against in self._in_frame:
            self._frames[against] += 1
            n = self._frames[against]
            if n == self.first_fit or (n > self.first_fit and n % self.refit == 0):
                self._due.add(against)
        self._in_frame.clear()

    def lag(self, width: int) -> int:
        """Frames after the one that carries a basis of ``width`` before its rows are in it."""
        return switch_frames(width) if self.switch is None else self.switch

    def due(self, bases: Bases) -> list[BasisMessage]:
        """Called as a frame's rows are about to be coded: the bases due, fitted from their
        moments (which start again), numbered after what ``bases`` holds and installed there,
        for the caller to send in this frame (the receiver `Bases.install`s each before it
        decodes the rows); `lag` frames later their rows are coded in them (the QR of
        both ends has run beside those frames)."""
        self.switched = []
        for against in list(self._switch_in):
            self._switch_in[against] -= 1
            if self._switch_in[against] <= 0:
                del self._switch_in[against]
                bases.switch(against)
                self.switched.append(against)
        out = []
        for against in sorted(self._due):
            m = self._moments[against]
            if m is None:
                continue
            # float64 on the CPU; a card's float32 (a consumer card's float64 is slow):
            # a basis is sent in at most 8 bits a value anyway.
            work = m if m.device.type == "cpu" else (m / m.diagonal().sum().clamp_min(1e-30))
            dtype = torch.float64 if m.device.type == "cpu" else torch.float32
            energies, vectors = torch.linalg.eigh(work.to(dtype))
            version = bases.held(against) + 1
            msg = BasisMessage.code(against, version, vectors.flip(1), energies.flip(0))
            bases.install(msg)
            lag = self.lag(msg.values.shape[0])
            if lag == 0:
                bases.switch(against)
                self.switched.append(against)
            else:
                self._switch_in[against] = lag
            out.append(msg)
            self._moments[against] = None
        self._due.clear()
        return out


def pack_map(bits: torch.Tensor) -> torch.Tensor:
    """A transformed code's bit map: ``MAP_BITS`` bits a block, zero-padded to 8 blocks."""
    return pack_bits(torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8)), MAP_BITS)


def unpack_map(packed: torch.Tensor, blocks: int) -> torch.Tensor:
    """The bits of ``blocks`` blocks from a map `pack_map` made."""
    return unpack_bits(packed, MAP_BITS)[:blocks]


def width(shape: tuple[int, ...]) -> int:
    """Values a token of a row of ``shape`` has (its last dimension; 1 for a scalar)."""
    return shape[-1] if shape else 1


def code_row(
    change: torch.Tensor,
    candidates: list[tuple[int, torch.Tensor | None]],
    budget: float,
    version: int,
    scale: Scale = "least-squares",
    *,
    weight: torch.Tensor | None = None,
    massive: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row's change (``[tokens, h]`` float32) in the cheapest of ``candidates`` (a basis's
    version and its vectors; None: the identity), its blocks' bits the fewest within ``budget``
    of expected error, each block's weighed by ``weight`` (`allocation.token_weights`: its
    token's, which a basis, orthonormal, keeps), the blocks ``massive`` marks at the most bits
    (a basis keeps a token's blocks its own): the version it is coded in, the packed bit map,
    codes, scales.

    Why a choice: a basis is fitted to what was sent before, and a row that changed otherwise
    (a delta of an epoch whose drift turned) may cost more in it than in the identity, which
    both ends always hold. Only the allocation runs per candidate (a sort of the blocks'
    energies, where the rows are: a GPU stage's card); the cheapest is quantised. Ties go to
    the earlier candidate."""
    best: tuple[float, int, torch.Tensor, torch.Tensor] | None = None
    table = deep(scale)
    for at, basis in candidates:
        blocks = to_blocks(change if basis is None else change @ basis)
        energy = blocks.square().sum(dim=1) * (1.0 if weight is None else weight)
        bits = allocate_bits(energy, budget, table=table, cost=DEEP_COST)
        if massive is not None:
            bits[massive] = MAX_BITS
        wire = wire_bits(bits)
        if best is None or wire < best[0]:
            best = (wire, at, blocks, bits)
    assert best is not None, "code_row needs a candidate"
    _, at, blocks, bits = best
    codes, scales = quantise_deep(blocks, bits, version, scale)
    return at, pack_map(bits.cpu()), codes, scales


def wire_bits(bits: torch.Tensor) -> float:
    """Wire bits of a code whose blocks got ``bits`` (0-8 each, on any device): a count of
    each, brought to the CPU, times `DEEP_COST` (exact: the costs are quarters)."""
    counts = torch.bincount(bits.reshape(-1), minlength=MAX_BITS + 1).cpu()
    return float((counts.to(torch.float64) * _COST).sum())


def decode_row(
    key: str,
    packed: torch.Tensor,
    *,
    codes: torch.Tensor,
    scales: torch.Tensor,
    version: int,
    shape: tuple[int, ...],
    basis: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """The change a `code_row` code stands for, as float32 ``[tokens, h]`` on ``device``."""
    bits = unpack_map(packed, -(-math.prod(shape) // BLOCK))
    blocks = dequantise_deep(key, bits, codes=codes, scales=scales, version=version, device=device)
    coords = from_blocks(blocks, shape, torch.float32).reshape(-1, width(shape))
    return coords if basis is None else coords @ basis.T
