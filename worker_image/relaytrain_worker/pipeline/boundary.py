"""The ``delta`` boundary compression: what a link keeps to send each sample's activation as a
low-bit change against what the other end decoded last time (`deltacache.py`), and how those
codes are laid out in a frame.

Per link (`transport.Link`) one `BoundaryCodec`: a `DeltaSender` for what this end sends and a
`DeltaReceiver` for what it receives. They live as long as the connection, so both ends of a
connection start empty together: a replaced stage, or any re-link after a failure, begins with
full codes, and neither end can hold a version the other lacks. The cache is *rebuilt*, not
checkpointed: its entries are re-learned by sending each sample once more as a full code (one
epoch of full codes instead of changes, at most 4.3 bits per value more that epoch),
where a checkpoint of it would write 16 bits per value (bf16) of every sample to the store and
read them back (`deltacache.py`: 42 GB per boundary for Llama-3.1-8B-sized samples).

What is coded how in a frame under ``delta``:

- a floating tensor named ``hidden`` in a frame that carries ``rows`` (the rows' indices in the
  job's training rows, `state/data.py`, or in the held-out rows): one `DeltaMessage` per row,
  keyed by the frame kind and the row (``activation:17``, ``eval:3``), so a training row and a
  held-out row never share an entry. Each block of 64 values gets its own bits, 0 to 4: the
  fewest in total whose expected error stays within what int4 leaves of the row
  (`DeltaConfig.allocate`, `allocation.allocate_bits`), coded against the row's last decode
  (a delta) or, where that is farther than zero, against zero (a full code, as on a row's
  first sight). A block given 0 bits is not sent and keeps its last value. Each block's scale
  is unshrunk (`lowbit.Scale`, `DeltaConfig.scale`): the decoded block is as long along the
  block as the block, where least squares would shorten every row by its error at every
  crossing; its error is a little larger (``D / (1 - D)`` of a block's energy for ``D``),
  and budgets and bits price it so (a block gets 2 bits or none where least squares gave
  it 1, `allocation.hull`). So a row is never coded worse than int4 codes it, unshrunk;
  its first sight costs about int4's 4.25 bits a value (the
  blocks that hold outliers get more, the quiet ones fewer), and later crossings only what
  changed: nothing but the bit map (3 bits a block, 0.05 a value) while the row stays within
  int4's error of its last decode;
- with ``DeltaConfig.transform`` (`transform.py`; ``pipeline.activationBasis: fitted``), the
  same rows coded in a basis fitted to them, 0-8 bits a block: the entry's ``bases`` list
  the bases fitted since the frame before (``[1 for deltas, version, width]``, each a map of
  its vectors' bits, their codes and scales ahead of the rows), which the receiver installs
  (its QR beside the frames) before it decodes rows coded in it, which the sender does from
  `transform.switch_frames` frames later (none under a width of 2048); each row's message
  names its basis last;
- ``hidden`` without ``rows`` (nothing to key it by): a full code at ``FULL_BITS``, cached
  nowhere;
- any other floating tensor (the gradients of a boundary): a rotated code at the job's
  ``pipeline.gradientBits`` (``GRADIENT_BITS`` by default; `lowbit.py`, nearest, each
  block's scale as the rows' are, unshrunk: a gradient no shorter than it is; 3 bits: 4 %
  of its energy in error, 1 bit 57 %). With least squares' scales, which shrank each block
  by its error, 2 bits cost 1.4 points of held-out loss (bench/bench_delta_boundary.py);
  unshrunk, each frame in a rotation of its own (`variant_of`), 1 bit with 0.375 of the
  tokens (`sampling.py`) ended +0.09 % held-out loss where 3 bits with 0.25 ended +0.31 %,
  at 0.6 of their bytes (docs/links-and-checkpoints.md, "Gradients at one bit"). A gradient
  depends on the whole later pipeline and on the labels and changes more between epochs
  than an activation does; a per-sample cache saved nothing on it
  (bench/bench_boundary_codec.py, part d), and bits allocated per block, within the same
  error, cost held-out loss: +9.5 % from a random base with a cache per row, +3.5 % on a
  fine-tune without one (bench_boundary_allocation.py, docs/links-and-checkpoints.md);
  unshrunk, such an allocation of a quarter of the tokens took 2 % more bytes than 3 bits
  each (their blocks are alike). Equal error is not equal learning for gradients. A
  gradient some of whose tokens are zero (`pipeline.gradientTokens` < 1, `sampling.py`, or
  padding) goes as a map of one bit a token and the other tokens' codes (``tokens``);
- integer and bool tensors: lossless and narrowed, as every other mode (`compression.py`);
- then all of a frame's parts, deflated as one stream where that is smaller (frames.py): a
  link keeps deflating a kind of frame while it takes at least ``DEFLATE_PAYS`` off, and
  otherwise tries again every ``DEFLATE_RETRY + 1``-th (`BoundaryCodec.deflate_due`).

The sender encodes in the link's encoder thread and the receiver decodes in the thread that
receives; frames on a link are applied in the order they were encoded, which is the order they
are sent and received, so the two caches stay in step. A delta against a version the receiver
does not hold (`deltacache.StaleCacheError`) cannot happen between two ends of one connection;
if it does, the frame is malformed and the link breaks, naming the sample and versions.

Memory: each end holds one bf16 entry per row it has seen (rows x sequence x hidden x 2 bytes
per boundary), in host memory. The caches are not counted in the plan's GPU memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from relaytrain_contract import GRADIENT_BITS  # the gradients' bits a value, unless a job says

from relaytrain_worker.pipeline import lowbit, transform
from relaytrain_worker.pipeline.deltacache import DeltaConfig, DeltaReceiver, DeltaSender
from relaytrain_worker.pipeline.deltamessage import DeltaMessage
from relaytrain_worker.pipeline.lowbit import Bits
from relaytrain_worker.pipeline.transform import BasisMessage

log = logging.getLogger("relaytrain.links")

MODE = "delta"
"""The `pipeline.compression` value this module implements."""
TOKENS = "tokens"
"""The layout mode of a gradient some of whose tokens are zero (`sampling.py`)."""
CODEC_MODES = ("lowbit", MODE, TOKENS)
"""Layout modes a frame entry has under ``delta`` (besides the lossless ``none``)."""
ROWS = "rows"
"""Name of the frame tensor that holds the rows' indices (the samples' keys)."""
KEYED = "hidden"
"""The tensor coded per row against the cache."""
UNKEYED = "int8"
"""The compression.py code the frame's other tensors travel with under ``delta``: integer
ones (labels, masks, rows) narrowed losslessly as under every code, floating ones as int8."""
FULL_BITS: Bits = 4
"""Bits per value of a row's first code (int4's error: the first epoch trains as int4 does)."""
DEFLATE_PAYS = 0.05
"""The least share of a frame's bytes deflate must take off for a link to keep deflating
frames of that kind (frames.py; it costs some 40 ns a byte of one CPU thread)."""
DEFLATE_RETRY = 16
"""Frames of a kind a link sends as coded after a deflate that did not pay, before it tries
again (the codes' statistics change as training goes on)."""
ACTIVATION_ERRORS: dict[str, tuple[Bits, float, float]] = {
    "int4": (FULL_BITS, 0.25, 16.0),
    "int3": (3, 1.0, 0.0),
}
"""``pipeline.activationError``: the code whose expected error a row's first code is held to, the
share of that squared error its change (a delta, every crossing after its first) is held to
(`DeltaConfig.change_error`), and from how far a row counts as moved, its change then held to
the first code's error (`DeltaConfig.moved`, in that code's expected errors). int4's, the
default, a quarter: a bit finer (each bit quarters a code's error), up to a change of 4 such
errors (twice the code's error in norm), rising to all of it at 16 (since 2026-12-07, later
still: a row that moved that far gets a fresh code's error, not an old one's again; at a width
of 1024 the card run's settings then carried 2.95x fewer bytes than int8 to their target where
they carried 2.37x, and SmolLM2-135M ended where it did, docs/links-and-checkpoints.md, "A moved
row's change at its first code's error"). Held at the first's whatever it moved, a row that
drifted less than that error crossed as its map alone, and the next stage trained on what it was
an epoch or more before: SmolLM2-135M's fine-tune through 4 stages ended +1.36 % and +2.13 %
above uncompressed training (seeds 0 and 1) at 5.72x and 5.77x fewer bytes than bf16, +0.28 %
after its first epoch, all full codes; at a quarter +0.34 % and +0.14 % at 5.14x and 5.19x,
within int8's +0.50 and +0.79 % (bf16's +0.54 % on seed 1). int3's, the setting that trades loss
for bytes on a model without massive activations, its own: the tiny fine-tune's
``delta:int3+basis`` with a quarter of the gradients' tokens is 16.59x at +0.44 % with its
changes held at int3's error, 12.74x at +0.03 % at a quarter of it.
`bench/bench_delta_boundary.py`, 2026-12-07 (docs/links-and-checkpoints.md)."""


def config_for(activation_error: str = "int4", *, transform: bool = False) -> DeltaConfig:
    """The sender's config of a link of a job with ``pipeline.activationError``: each block
    of a row's code gets its own bits (`DeltaConfig.allocate`), within that code's error (a
    change of the row within its ``ACTIVATION_ERRORS`` share of it), its scale unshrunk
    (`lowbit.Scale`: a row crosses the boundary no shorter than it is); ``transform``: rows
    coded in fitted bases (`DeltaConfig.transform`)."""
    if activation_error not in ACTIVATION_ERRORS:
        valid = ", ".join(ACTIVATION_ERRORS)
        raise ValueError(f"activation_error must be one of {valid}, got {activation_error!r}")
    bits, change, moved = ACTIVATION_ERRORS[activation_error]
    return DeltaConfig(
        full_bits=bits, allocate=True, transform=transform, scale="unshrunk",
        change_error=change, moved=moved,
    )  # fmt: skip


CONFIG = config_for()
"""A link's default: int4's error, no basis."""


def codec_for(
    activation_error: str = "int4", *, transform: bool = False, gradient_bits: int = GRADIENT_BITS
) -> BoundaryCodec:
    """The codec a link of a job with ``pipeline.activationError`` keeps (`config_for`), its
    gradients coded at ``pipeline.gradientBits``. Only the sender reads its config (every code
    says how it was made), so the two ends of a link need not agree on it."""
    return BoundaryCodec(config_for(activation_error, transform=transform), gradient_bits)


def bytes_per_value(bits: int) -> float:
    """Wire bytes per value of a code of ``bits`` bits (codes and one bf16 scale per block)."""
    return lowbit.bits_per_value(bits) / 8


class BoundaryCodec:
    """One link's delta state: what this end sent and what it received, per sample."""

    def __init__(self, config: DeltaConfig = CONFIG, gradient_bits: int = GRADIENT_BITS) -> None:
        self.sender = DeltaSender(config)
        self.receiver = DeltaReceiver(config)
        self.gradient_bits = lowbit.check_bits(gradient_bits)
        self.device: torch.device | None = None
        """Where this end decodes what it receives (the stage's card; None: the CPU, where
        the frame arrives). A GPU stage sets it as it receives (`peers.AsyncLink.recv`): one
        gather, multiplication and rotation a value there, against some 70 ns a value on one
        CPU thread (bench/bench_codec_speed.py), and the tensor is where the stage needs it."""
        self.full_codes = 0
        """Rows sent as full codes."""
        self.delta_codes = 0
        """Rows sent as deltas."""
        self._undeflated: dict[str, int] = {}
        """Per frame kind, how many more of its frames go without trying deflate."""

    def deflate_due(self, kind: str) -> bool:
        """Whether to try deflating this link's next frame of ``kind`` (frames.py): yes,
        unless the last one tried shrank by less than ``DEFLATE_PAYS``, then not for the next
        ``DEFLATE_RETRY`` of that kind (gradient codes barely shrink: 2 % in
        bench_delta_boundary.py, where an activation frame loses 11-16 %)."""
        left = self._undeflated.get(kind, 0)
        self._undeflated[kind] = max(0, left - 1)
        return left == 0

    def deflated(self, kind: str, coded: int, deflated: int) -> None:
        """What deflating a frame of ``kind`` made of its ``coded`` bytes."""
        if deflated > (1 - DEFLATE_PAYS) * coded:
            self._undeflated[kind] = DEFLATE_RETRY

    def encode(
        self, kind: str, tensors: dict[str, torch.Tensor], step: int = 0, micro: int = 0
    ) -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
        """The floating tensors of a frame of ``kind`` (of ``step`` and ``micro``) as layout
        entries and their parts (integer tensors are left to the caller). Those not cached
        (the gradient) are coded in the frame's own rotation, `variant_of`."""
        variant = variant_of(step, micro)
        rows = tensors.get(ROWS)
        out = []
        for name, t in tensors.items():
            if not t.is_floating_point() or t.numel() == 0:
                continue
            live = _live_tokens(t) if name != KEYED and t.dim() >= 2 else None
            if name == KEYED and rows is not None:
                out.append(self._encode_rows(name, kind, t, rows))
            elif live is not None and not bool(live.all()):
                out.append(self._encode_tokens(name, t, live, variant))
            else:
                bits = FULL_BITS if name == KEYED else self.gradient_bits
                enc = lowbit.encode(t, bits, scale=self.sender.config.scale, variant=variant)
                entry = {
                    "name": name, "mode": "lowbit", "bits": enc.bits, "dtype": str(t.dtype),
                    "shape": list(enc.shape), "data": enc.codes.numel(),
                    "scales": enc.scales.numel(), "variant": enc.variant,
                }  # fmt: skip
                out.append((entry, [enc.codes, enc.scales]))
        return out

    def _encode_tokens(
        self, name: str, t: torch.Tensor, live: torch.Tensor, variant: int
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """A gradient with zero tokens (``live``: `_live_tokens`): a map of one bit a token
        (set: sent), then the tokens that are not zero, coded as every gradient is."""
        tokens = t.detach().reshape(live.numel(), -1)[live]
        token_map = lowbit.pack_bits(torch.nn.functional.pad(live, (0, (-live.numel()) % 8)), 1)
        entry = {"name": name, "mode": TOKENS, "bits": self.gradient_bits, "dtype": str(t.dtype),
                 "shape": list(t.shape), "map": token_map.numel()}  # fmt: skip
        if tokens.numel() == 0:
            return {**entry, "data": 0, "scales": 0}, [token_map]
        enc = lowbit.encode(
            tokens, self.gradient_bits, scale=self.sender.config.scale, variant=variant
        )
        entry.update(data=enc.codes.numel(), scales=enc.scales.numel(), variant=enc.variant)
        return entry, [token_map, enc.codes, enc.scales]

    def _encode_rows(
        self, name: str, kind: str, t: torch.Tensor, rows: torch.Tensor
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if rows.dim() != 1 or rows.numel() != t.shape[0]:
            raise ValueError(
                f"frame tensor {ROWS!r} must hold one index per row of {name!r} "
                f"({t.shape[0]}), got shape {list(rows.shape)}"
            )
        messages = []
        parts: list[torch.Tensor] = []
        # Bases fitted from earlier frames go first: this frame's rows are coded in them.
        bases = self.sender.fitter.due(self.sender.bases)
        for against in self.sender.fitter.switched:
            kinds, version = "deltas" if against else "full codes", self.sender.bases.held(against)
            log.info("coding the %s in basis %d from this %s frame on", kinds, version, kind)
        for b in bases:  # one every `transform.REFIT` frames of a kind at most
            parts += [b.packed, b.codes, b.scales]
            log.info(
                "sending basis %d of the %s (%d values a token, %d bytes) with %s rows",
                b.version, "deltas" if b.against else "full codes", b.values.shape[0],
                b.nbytes, kind,
            )  # fmt: skip
        for i, row in enumerate(rows.tolist()):
            msg = self.sender.encode(t[i], f"{kind}:{int(row)}")
            if msg.kind == "full":
                self.full_codes += 1
            else:
                self.delta_codes += 1
            sent = None if msg.sent is None else msg.sent.numel()
            # [row, 1 for a full code, version, bits, sent blocks, bitmap bytes]: a delta is
            # always against the version before, and the codes are 8 * bits bytes a block.
            # An allocated code has bits 0: its bit map comes first and sizes the rest.
            full = int(msg.kind == "full")
            if msg.block_bits is not None:
                # A transformed code names its basis last (its bit map is 4 bits a block).
                named = [] if msg.basis is None else [msg.basis]
                messages.append([int(row), full, msg.version, 0, msg.scales.numel(), None, *named])
                parts += [msg.block_bits, msg.codes, msg.scales]
                continue
            messages.append([int(row), full, msg.version, msg.bits, msg.scales.numel(), sent])
            parts += [msg.codes, msg.scales] + ([] if msg.sent is None else [msg.sent])
        self.sender.fitter.end_frame()
        entry = {
            "name": name, "mode": MODE, "dtype": str(t.dtype), "shape": list(t.shape),
            "messages": messages,
        }  # fmt: skip
        if bases:  # [1 for the deltas' basis, version, width] each
            entry["bases"] = [[int(b.against), b.version, b.values.shape[0]] for b in bases]
        return entry, parts

    def decode(
        self,
        kind: str,
        entry: dict[str, Any],
        dtype: torch.dtype,
        read: Callable[[int, torch.dtype], torch.Tensor],
    ) -> torch.Tensor:
        """The tensor a ``lowbit`` or ``delta`` layout entry of a frame of ``kind`` stands for;
        ``read(n, dtype)`` reads the next part of ``n`` elements of ``dtype`` from the frame."""
        shape = tuple(int(d) for d in entry["shape"])
        if entry["mode"] == "lowbit":
            codes = read(int(entry["data"]), torch.uint8)
            scales = read(int(entry["scales"]), torch.bfloat16)
            enc = lowbit.LowBitTensor(
                lowbit.check_bits(entry["bits"]), dtype, shape, codes, scales,
                int(entry.get("variant", 0)),
            )  # fmt: skip
            return lowbit.decode(enc, self.device)
        if entry["mode"] == TOKENS:
            return self._decode_tokens(entry, shape, dtype, read)
        messages = entry["messages"]
        if len(shape) < 1 or len(messages) != shape[0]:
            raise ValueError(f"{len(messages)} row codes for a tensor of shape {list(shape)}")
        for against, version, width in entry.get("bases", []):
            basis = BasisMessage.read(bool(against), int(version), int(width), read)
            self.receiver.bases.install(basis)
            kinds = "deltas" if against else "full codes"
            log.info("installed basis %d of the %s (%d values a token)", version, kinds, width)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        row_blocks = -(-math.prod(shape[1:]) // lowbit.BLOCK)
        for i, (row, full, at, given_bits, blocks, nsent, *basis) in enumerate(messages):
            version, block_bits = int(at), None
            if basis:  # transformed: a bit map of 0-8 bits a block
                bits = self.receiver.config.full_bits
                block_bits = read(transform.MAP_BITS * -(-row_blocks // 8), torch.uint8)
                each = transform.unpack_map(block_bits, row_blocks)
                codes = read(8 * int(each.sum()), torch.uint8)
            elif given_bits == 0:  # allocated: the bit map says how many code bytes follow
                bits = self.receiver.config.full_bits
                block_bits = read(3 * -(-row_blocks // 8), torch.uint8)
                each = lowbit.unpack_bits(block_bits, 3)[:row_blocks]
                codes = read(8 * int(each.sum()), torch.uint8)
            else:
                bits = lowbit.check_bits(given_bits)
                codes = read(8 * bits * int(blocks), torch.uint8)
            scales = read(int(blocks), torch.bfloat16)
            sent = None if nsent is None else read(int(nsent), torch.uint8)
            msg = DeltaMessage(
                f"{kind}:{int(row)}", "full" if full else "delta", version,
                None if full else version - 1, bits, dtype, shape[1:], codes, scales, sent,
                block_bits, int(basis[0]) if basis else None,
            )  # fmt: skip
            out[i] = self.receiver.decode(msg, self.device)
        return out

    def _decode_tokens(
        self,
        entry: dict[str, Any],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        read: Callable[[int, torch.dtype], torch.Tensor],
    ) -> torch.Tensor:
        """The tensor of a ``tokens`` layout entry: zeros but for the tokens its map sends."""
        width = shape[-1] if shape else 1
        count = math.prod(shape) // max(width, 1)
        live = lowbit.unpack_bits(read(int(entry["map"]), torch.uint8), 1)[:count].bool()
        if live.numel() != count:
            raise ValueError(f"token map of {live.numel()} tokens for a tensor of {count}")
        out = torch.zeros(count, width, dtype=dtype, device=self.device)
        sent = int(live.sum())
        codes = read(int(entry["data"]), torch.uint8)
        scales = read(int(entry["scales"]), torch.bfloat16)
        if sent:
            bits = lowbit.check_bits(entry["bits"])
            variant = int(entry.get("variant", 0))
            enc = lowbit.LowBitTensor(bits, dtype, (sent, width), codes, scales, variant)
            out[live.to(out.device)] = lowbit.decode(enc, self.device)
        return out.reshape(shape)


def variant_of(step: int, micro: int) -> int:
    """The rotation (`lowbit.rotate`) a frame's uncached tensors (its gradient) are coded in:
    one of the step's and micro-batch's own, named in each entry. A fixed rotation makes a
    code's error a function of the tensor's direction, the same step after step on
    gradients that change little; one a frame makes the errors of steps unrelated, so they
    average out in the adapters as the draw's noise does (tests/unit/test_gradient_bits.py;
    what it did to held-out loss, within what seeds move a run: docs/links-and-checkpoints.md,
    "Gradients at one bit"). A step redone after a rollback codes as it did."""
    return (step << 16) + micro + 1


def _live_tokens(t: torch.Tensor) -> torch.Tensor:
    """Per token (every index but the last dimension's), whether any of its values is not 0."""
    return t.detach().reshape(-1, t.shape[-1]).ne(0).any(dim=1).cpu()
