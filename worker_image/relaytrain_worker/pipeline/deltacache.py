"""Delta coding of a sample's boundary activation against what the receiver decoded last time.

In fine-tuning the base model is frozen and the adapters move slowly, so the activation a
sample produces at a stage boundary changes little from one epoch to the next (AQ-SGD,
arXiv 2206.01299). Both ends of a link keep, per sample key, the value the receiver
*decoded* last time and its version (the sender mirrors the receiver: it decodes its own
message with the same code). The first time a key is seen (or its shape changed, or either
the input or the cached value holds NaN/inf) the sender sends a full code (lowbit.py at
``full_bits``); afterwards a delta ``x - cache`` at ``delta_bits``, against the cached version.
Both sides set their entry to ``cache + decode(delta)`` and bump the version. What a decode
left out is part of the next delta, so quantisation error never accumulates. Each code is
rotated with the rotation variant of the version it creates (lowbit.sign_bits): the part a
code left out is not Gaussian in that code's own basis, but it is in a fresh one. So on a
static sample the error shrinks by ``sqrt(D_b)`` an epoch (lowbit.DISTORTION), and on one
drifting by ``d`` (RMS) an epoch, as ``e_k <= sqrt(D_b) (d + e_(k-1))``, it settles at most
at ``d sqrt(D_b) / (1 - sqrt(D_b))``: 1.5 d at 1 bit, 0.52 d at 2 (1.1 d and 0.4 d measured
on Gaussian data).

Allocated codes (``allocate``, what the worker's ``delta`` compression uses;
`DeltaConfig.allocate`): unlike ``adaptive``, the error does not shrink epoch after epoch:
a full code's is held at its bits' (each token's against its own energy, in the row's mean; a
massive token, `allocation.MASSIVE`, at the code's most bits: 8 on a full code, its row's
blocks then 0-8), a change's at ``change_error`` of that (the worker's default: a quarter,
a bit finer) up to all of it for a row that moved far (``moved``, `change_share`), a row that
drifts less than that costs only its map, and the next code carries the error.

Block skipping (``skip_below``): a block (64 values, as in lowbit.py) whose delta RMS is at
most ``skip_below`` times the cached block's is not sent; a bitmap of a bit a block (set =
sent; left out when every block is) says which were, and the skipped part is in the next
delta. Wire cost: ``ceil(blocks / 8)`` bitmap bytes plus ``8 * bits + 2`` bytes per sent
block (``nbytes``; an allocated code: ``3 ceil(blocks / 8)`` map bytes plus ``8 b_i + 2``
per sent block), and a frame's key, kind, versions, bits and shape (``DeltaMessage``).

The decoded value is the cache entry, which is why both must be bit-identical: decode is
adds, subtracts and multiplications by powers of two and by the block scales (lowbit.py),
and the cache update one float32 add and a cast, all elementwise IEEE operations, so sender
and receiver agree bit for bit. The receiver raises ``StaleCacheError`` when a delta refers to a
version it does not hold (it restarted, was reset, or missed a message); ``reset()`` on both
sides (what a replaced stage or a reconnect does) makes the next messages full codes again.
The sender commits its entry when it encodes: a message that is lost must end in
``forget(key)`` or ``reset()`` on the sender.

Cache dtype: bf16 by default: half the memory, and its rounding does not accumulate either
(both ends hold the same rounded value; the rounding is in the next delta), only a floor of
bf16's own precision (0.1-0.2 % RMS) under the error. float32 is for tests and for measuring
the codec without that floor.

Memory: one entry per sample per boundary, on each side. Llama-3.1-8B-sized boundaries, 4096
wide, 512 tokens a sample, 10k samples: 4 MiB a sample, **42 GB** in bf16 on the sender and
again on the receiver of every boundary: host memory or a memory-mapped file on local disk
(each entry is read and written once an epoch), never GPU memory. Entries are CPU tensors
here. The sender codes where the tensor is (a GPU stage's card, the row's entry copied
there: the rotations, trial scales and each block's bits, 217 ns a value on one CPU thread)
and brings only the codes to the CPU; its mirror decodes them where it coded, the receiver
where it is asked (`boundary.BoundaryCodec.device`). A decode is a gather, one
multiplication, the rotation's butterflies and an addition, no division and no reduction, so
every device gets the same bits and the two ends stay in step
(tests/unit/test_boundary_delta_gpu.py checks it on a card).

Hand-written for the same reason as lowbit.py: a self-describing byte format whose decode is
bit-exact on both ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from relaytrain_worker.pipeline import transform
from relaytrain_worker.pipeline.allocation import (
    allocate_bits,
    dequantise_grouped,
    quantise_grouped,
    shallow,
    token_weights,
)
from relaytrain_worker.pipeline.deltamessage import DeltaMessage
from relaytrain_worker.pipeline.lowbit import (
    BLOCK,
    Bits,
    Scale,
    check_bits,
    check_scale,
    dequantise_blocks,
    distortion,
    from_blocks,
    pack_bits,
    quantise_blocks,
    to_blocks,
    unpack_bits,
)

CacheDtype = Literal["bfloat16", "float32"]


class StaleCacheError(RuntimeError):
    """A delta refers to a cache version the receiver does not hold."""

    def __init__(self, key: str, base_version: int, held_version: int | None) -> None:
        held = "no entry" if held_version is None else f"version {held_version}"
        super().__init__(
            f"delta for sample {key!r} is against cache version {base_version}, but the "
            f"receiver holds {held}; reset the sender (or forget the key) to send full codes"
        )
        self.key = key
        self.base_version = base_version
        self.held_version = held_version


@dataclass(frozen=True)
class DeltaConfig:
    """How a link's delta codec codes; sender and receiver must use the same one."""

    full_bits: Bits = 2
    """Bits per value of a full code (first sight of a sample)."""
    delta_bits: Bits = 1
    """Bits per value of a delta code (the fewest, with ``adaptive``)."""
    adaptive: bool = False
    """Choose each delta's bits from the change itself: the fewest bits from ``delta_bits``
    up to ``full_bits`` whose expected error, ``D_b * ||x - cache||^2`` (lowbit.DISTORTION),
    is at most a full code's, ``D_full * ||x||^2``; a change larger than that at
    ``full_bits`` is sent as a full code. So no row is coded worse than its first sight was,
    and a row that drifts little costs ``delta_bits``."""
    skip_below: float = 0.0
    """Skip a block whose delta RMS is at most this times the cached block's RMS (0: skip
    only blocks whose delta is exactly zero)."""
    cache_dtype: CacheDtype = "bfloat16"
    """dtype the cache entries are kept in (both sides must agree)."""
    allocate: bool = False
    """Give each block of a code its own bits, 0-4 (`allocation.allocate_bits`): the fewest
    whose expected error, ``sum_i D_(b_i) ||r_i||^2 / ||x_t||^2`` over the blocks ``r_i`` coded
    (``x_t`` its token, `allocation.token_weights`), is within a full code's, ``D_full`` a token
    (each ``D`` as ``scale`` fits: unshrunk, ``D / (1 - D)``, no 1-bit blocks). A row is coded
    against its last decode where that is nearer than zero (a delta), else against zero (a full
    code), both allocated; a block given 0 bits is not sent and keeps its reference's value.
    A full code of a row with a massive token (`allocation.MASSIVE`) is coded as ``transform``
    codes, in the identity: its blocks 0-8 bits, the token's 8 (a delta: 0-4, the token's 4).
    Instead of ``adaptive`` and ``skip_below``."""
    floor: int = 0
    """With ``allocate``: the fewest bits a block gets (1: every block is sent)."""
    change_error: float = 1.0
    """With ``allocate``: a change's (a delta's) error budget as a share of a full code's, each
    token's against its own energy alike (the worker's: `boundary.ACTIVATION_ERRORS`)."""
    moved: float = 0.0
    """With ``change_error`` below 1: the change, in full codes' expected errors of the row
    (its energy weighed as the budget's), at which a row counts as moved and its change takes
    a full code's budget; ``change_error`` up to ``change_error * moved`` of them, rising in
    proportion between (`change_share`). 0: ``change_error`` whatever the change."""
    transform: bool = False
    """With ``allocate``: code each row's change in a basis fitted to such changes, its blocks
    0-8 bits, within the same error (`transform.py`); the sender's `DeltaSender.fitter`
    says which bases to send ahead of the rows coded in them."""
    scale: Scale = "least-squares"
    """How each block's scale is fitted (`lowbit.Scale`; the worker's ``delta``: unshrunk,
    `boundary.config_for`). Only the sender reads it: the receiver multiplies by whatever
    scale it is sent."""

    def __post_init__(self) -> None:
        check_bits(self.full_bits)
        check_scale(self.scale)
        check_bits(self.delta_bits)
        if self.allocate and (self.adaptive or self.skip_below):
            raise ValueError("allocate replaces adaptive and skip_below: set only allocate")
        if self.floor not in range(0, 5) or (self.floor and not self.allocate):
            raise ValueError(f"floor must be 0-4 and needs allocate, got {self.floor}")
        if not 0.0 < self.change_error <= 1.0 or (self.change_error < 1 and not self.allocate):
            raise ValueError(
                f"change_error must be above 0 and at most 1, below 1 only with allocate, "
                f"got {self.change_error}"
            )
        if not (0.0 <= self.moved < math.inf) or (self.moved and self.change_error >= 1):
            raise ValueError(
                f"moved must be finite and >= 0, above 0 only with change_error below 1, "
                f"got {self.moved}"
            )
        if self.transform and (not self.allocate or self.floor):
            raise ValueError("transform needs allocate and no floor")
        if not (self.skip_below >= 0.0 and math.isfinite(self.skip_below)):
            raise ValueError(f"skip_below must be finite and >= 0, got {self.skip_below}")
        if self.cache_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"cache_dtype must be bfloat16 or float32, got {self.cache_dtype}")

    @property
    def torch_cache_dtype(self) -> torch.dtype:
        """The cache dtype as a torch dtype."""
        return torch.bfloat16 if self.cache_dtype == "bfloat16" else torch.float32


@dataclass
class _Entry:
    version: int
    value: torch.Tensor
    """``[blocks, BLOCK]`` CPU tensor in the cache dtype: what the receiver decoded."""
    shape: tuple[int, ...]


class _Side:
    """What sender and receiver share: the entries and the rule that updates them."""

    def __init__(self, config: DeltaConfig | None = None) -> None:
        self.config = config or DeltaConfig()
        self._entries: dict[str, _Entry] = {}
        self.bases = transform.Bases()
        """The bases transformed codes are in (`DeltaConfig.transform`); a receiver
        `transform.Bases.install`s each the sender sends before the codes in it."""

    def reset(self) -> None:
        """Drop every entry and basis (a replaced stage or a reconnect): next messages are
        full, in the identity."""
        self._entries.clear()
        self.bases.reset()

    def forget(self, key: str) -> None:
        """Drop one sample's entry."""
        self._entries.pop(key, None)

    def version(self, key: str) -> int | None:
        """The version held for ``key``, or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.version

    def cached(self, key: str) -> torch.Tensor | None:
        """The cached value for ``key`` in its original shape (cache dtype), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return from_blocks(entry.value, entry.shape, entry.value.dtype)

    @property
    def cache_nbytes(self) -> int:
        """Bytes the entries' values occupy."""
        return sum(e.value.numel() * e.value.element_size() for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def _apply(
        self, msg: DeltaMessage, base: _Entry | None, device: torch.device | None = None,
        base_value: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Apply ``msg`` and store the new entry (on the CPU); returns its float32 blocks,
        decoded on ``device`` (default the CPU): a gather, one multiplication, the rotation's
        butterflies and an addition, the same bits on any device (`lowbit.dequantise_blocks`).
        ``base_value``: ``base``'s value in float32 on ``device``, where the sender has it."""
        device = device or torch.device("cpu")
        if msg.basis is not None:
            assert msg.block_bits is not None
            against = msg.kind == "delta"
            basis = self.bases.use(msg.key, against, msg.basis, device)
            change = transform.decode_row(
                msg.key, msg.block_bits, codes=msg.codes, scales=msg.scales,
                version=msg.version, shape=msg.shape, basis=basis, device=device,
            )  # fmt: skip
            decoded = to_blocks(change)
        elif msg.block_bits is not None:
            decoded = _dequantise_allocated(msg, device)
        else:
            codes, scales = msg.codes.to(device), msg.scales.to(device)
            decoded = dequantise_blocks(codes, scales, msg.bits, msg.version)
        if msg.kind == "full" or base is None:
            new = decoded
        else:
            new = base.value.to(device, torch.float32) if base_value is None else base_value
            if msg.sent is None:
                new = new + decoded
            else:
                idx = _sent_index(msg.sent, msg.blocks).to(device)
                new[idx] = new[idx] + decoded
        value = new.to(self.config.torch_cache_dtype)
        self._entries[msg.key] = _Entry(msg.version, value.cpu(), msg.shape)
        return value.to(torch.float32)


class DeltaSender(_Side):
    """The sending end of a link: encodes each sample against its mirror of the receiver."""

    def __init__(self, config: DeltaConfig | None = None) -> None:
        super().__init__(config)
        self.fitter = transform.Fitter()
        """When each kind's next basis is due, and the moments it is fitted from: the caller
        ends each frame (`transform.Fitter.end_frame`) and sends what ``fitter.due(bases)``
        fits, which this end already holds, ahead of the rows coded in it."""

    def reset(self) -> None:
        super().reset()
        self.fitter.reset()

    def encode(self, x: torch.Tensor, key: str) -> DeltaMessage:
        """Encode floating ``x`` for sample ``key`` and update the mirror entry."""
        if not x.is_floating_point():
            raise TypeError(f"delta coding needs a floating tensor, got {x.dtype}")
        cfg = self.config
        blocks = to_blocks(x.detach())  # coded where x is (a GPU stage's card); the codes,
        shape = tuple(x.shape)  # the mirror and the cache are on the CPU
        entry = self._entries.get(key)
        finite = bool(torch.isfinite(blocks).all())
        full = (entry is None or entry.shape != shape or not finite
                or not bool(torch.isfinite(entry.value).all()))  # fmt: skip
        version = 1 if entry is None else entry.version + 1
        if cfg.allocate and finite:
            # (a non-finite input takes the uniform full code below, so that it decodes NaN)
            usable = entry if entry is not None and not full else None
            return self._encode_allocated(
                key=key, dtype=x.dtype, shape=shape, blocks=blocks, entry=usable, version=version
            )
        bits: Bits | None = None
        if not full:
            assert entry is not None
            cached = entry.value.to(blocks.device, torch.float32)
            delta = blocks - cached
            bits = self._bits(delta, blocks) if cfg.adaptive else cfg.delta_bits
        if bits is None:  # first sight, or changed as much as the row: a full code, no dearer
            codes, scales = _quantise(blocks, cfg.full_bits, version, cfg.scale)
            msg = DeltaMessage(
                key, "full", version, None, cfg.full_bits, x.dtype, shape, codes, scales, None
            )
            self._apply(msg, None, blocks.device)
            return msg
        assert entry is not None
        delta_rms = delta.square().mean(dim=1).sqrt_()
        keep = delta_rms > cached.square().mean(dim=1).sqrt_() * cfg.skip_below
        if bool(keep.all()):
            sent = None
        else:
            delta = delta[keep]
            keep = keep.cpu()
            sent = pack_bits(torch.nn.functional.pad(keep, (0, (-keep.numel()) % 8)), 1)
        codes, scales = _quantise(delta, bits, version, cfg.scale)
        msg = DeltaMessage(
            key, "delta", entry.version + 1, entry.version, bits, x.dtype, shape, codes, scales,
            sent,
        )  # fmt: skip
        self._apply(msg, entry, blocks.device)
        return msg

    def _encode_allocated(
        self,
        *,
        key: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        blocks: torch.Tensor,
        entry: _Entry | None,
        version: int,
    ) -> DeltaMessage:
        """An allocated code (DeltaConfig.allocate) of finite ``blocks``, against ``entry``
        (of the same shape, finite, or None) where it is nearer than zero; with
        ``DeltaConfig.transform``, in the held basis of its kind (`transform.py`)."""
        cfg = self.config
        value = blocks.square().sum(dim=1)
        change, change_value = blocks, value
        base = cached = None
        if entry is not None:  # same shape, finite
            cached = entry.value.to(blocks.device, torch.float32)
            delta = blocks - cached
            delta_value = delta.square().sum(dim=1)
            if float(delta_value.sum()) < float(value.sum()):
                change, change_value, base = delta, delta_value, entry
        h, at = transform.width(shape), None
        weighed = token_weights(value, h)  # each token's error against its own energy
        budget, weight = distortion(cfg.full_bits, cfg.scale) * weighed.energy, weighed.weight
        energy = change_value * weight  # each block's, weighed as the budget weighs it
        if base is not None:
            budget *= change_share(cfg, float(energy.sum()) / max(budget, _TINY))
        if cfg.transform or (base is None and not cfg.floor and bool(weighed.massive.any())):
            # In a basis; or a full code of a row with a massive token (a sink, which 4 bits
            # left at up to 5 % of its norm: SmolLM2-135M's loss +0.68 %, at 8 +0.27 %) in the
            # identity at 0-8. Its change, small against it, takes 4 in the identity's deltas.
            tokens = from_blocks(change, shape, torch.float32).reshape(-1, h)
            candidates: list[tuple[int, torch.Tensor | None]] = [(0, None)]  # the identity
            if cfg.transform:
                against = base is not None
                self.fitter.add(against, tokens, weight)
                candidates = self.bases.candidates(key, against, h, blocks.device)
            at, packed, code, scale = transform.code_row(tokens, candidates, budget, version,
                cfg.scale, weight=weight, massive=weighed.massive)  # fmt: skip
        else:
            table = shallow(cfg.scale)
            bits = allocate_bits(energy, budget, cfg.floor, table=table)
            bits[weighed.massive] = len(table) - 1  # a massive token at the code's most bits
            codes, scales = quantise_grouped(change, bits, version, cfg.scale)
            code = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.uint8)
            scale = torch.cat(scales) if scales else torch.zeros(0, dtype=torch.bfloat16)
            bits = bits.cpu()
            packed = pack_bits(torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8)), 3)
        msg = DeltaMessage(
            key, "full" if base is None else "delta", version,
            None if base is None else base.version, cfg.full_bits, dtype, shape, code, scale,
            None, packed, at,
        )  # fmt: skip
        self._apply(msg, base, blocks.device, None if base is None else cached)
        return msg

    def _bits(self, delta: torch.Tensor, blocks: torch.Tensor) -> Bits | None:
        """The fewest bits whose expected error on ``delta`` is within a full code's on
        ``blocks`` (see DeltaConfig.adaptive); None when not even ``full_bits`` are."""
        cfg = self.config
        change, whole = float(delta.square().sum()), float(blocks.square().sum())
        budget = distortion(cfg.full_bits, cfg.scale) * whole
        for bits in range(cfg.delta_bits, cfg.full_bits + 1):
            if distortion(bits, cfg.scale) * change <= budget:
                return check_bits(bits)
        return None


class DeltaReceiver(_Side):
    """The receiving end of a link: decodes messages against its cache."""

    def decode(self, msg: DeltaMessage, device: torch.device | str | None = None) -> torch.Tensor:
        """The tensor ``msg`` stands for (original shape and dtype), updating the cache.

        Raises StaleCacheError when a delta is against a version this side does not hold."""
        entry = self._entries.get(msg.key)
        if msg.kind == "delta":
            if msg.base_version is None:
                raise ValueError(f"delta for sample {msg.key!r} without a base version")
            if entry is None or entry.version != msg.base_version:
                held = None if entry is None else entry.version
                raise StaleCacheError(msg.key, msg.base_version, held)
            if entry.shape != msg.shape:
                raise ValueError(
                    f"delta for sample {msg.key!r} has shape {msg.shape}, cache {entry.shape}"
                )
        value = self._apply(msg, entry, None if device is None else torch.device(device))
        return from_blocks(value, msg.shape, msg.dtype)


def change_share(config: DeltaConfig, errors: float) -> float:
    """The share of a full code's error budget a row's change is held to, where the change
    is ``errors`` full codes' expected errors of the row (`DeltaConfig.moved`): the row's
    ``change_error`` while it stayed near its last decode, where the receiver would otherwise
    keep an old code's error, the same each epoch; a full code's once it moved so far that
    its new code's error is fresh; in proportion between."""
    if not config.moved:
        return config.change_error
    return min(1.0, max(config.change_error, errors / config.moved))


_TINY = 1e-30
"""A budget's least divisor (a row of zeros has none)."""


def _quantise(
    blocks: torch.Tensor, bits: int, version: int, scale: Scale
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantise_blocks` where ``blocks`` are (on a GPU stage, its card: 5 trial scales a
    block are cheap there), the codes and scales brought to the CPU, for the wire."""
    codes, scales = quantise_blocks(blocks, check_bits(bits), variant=version, scale=scale)
    return codes.cpu(), scales.cpu()


def _sent_index(bitmap: torch.Tensor, blocks: int) -> torch.Tensor:
    """Indices of the blocks whose bit is set."""
    bits = unpack_bits(bitmap, 1)[:blocks]
    return bits.nonzero().reshape(-1)


def _dequantise_allocated(msg: DeltaMessage, device: torch.device) -> torch.Tensor:
    """Float32 ``[blocks, BLOCK]`` of an allocated code, on ``device``: 0 where a block got
    no bits."""
    assert msg.block_bits is not None
    bits = unpack_bits(msg.block_bits, 3)[: msg.blocks]
    want_codes = 8 * int(bits.sum())
    want_scales = int((bits > 0).sum())
    if (
        bits.numel() != msg.blocks
        or bool((bits > 4).any())
        or ((want_codes, want_scales) != (msg.codes.numel(), msg.scales.numel()))
    ):
        raise ValueError(
            f"allocated code for sample {msg.key!r}: its bit map asks {want_codes} code bytes "
            f"and {want_scales} scales for {msg.blocks} blocks, the message holds "
            f"{msg.codes.numel()} and {msg.scales.numel()}"
        )
    out = torch.zeros(msg.blocks, BLOCK, dtype=torch.float32, device=device)
    dequantise_grouped(bits, msg.codes, msg.scales, msg.version, out)
    return out
