"""A sample's boundary tensor in wire form under ``delta``: a full code or a delta against a
version of what the receiver decoded for it (`deltacache.py` codes and applies them; `boundary.py`
puts them in frames)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from relaytrain_worker.pipeline.lowbit import BLOCK, Bits


@dataclass(frozen=True)
class DeltaMessage:
    """One sample's boundary tensor in wire form: a full code or a delta against a version."""

    key: str
    """The sample's key (the same on every epoch)."""
    kind: Literal["full", "delta"]
    """``full``: decode alone; ``delta``: add to the cache entry at ``base_version``."""
    version: int
    """The entry's version once this message is applied (full codes start at 1)."""
    base_version: int | None
    """For a delta, the version it is against; None for a full code."""
    bits: Bits
    """Bits per code."""
    dtype: torch.dtype
    """dtype of the original tensor; decode returns this dtype."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    codes: torch.Tensor
    """1-D uint8 CPU tensor: packed codes of the sent blocks (lowbit.pack_bits)."""
    scales: torch.Tensor
    """1-D bf16 CPU tensor: one scale per sent block."""
    sent: torch.Tensor | None
    """1-D uint8 CPU bitmap, one bit per block (set = sent, little-endian bit order), or
    None when every block was sent."""
    block_bits: torch.Tensor | None = None
    """An allocated code (`DeltaConfig.allocate`): 1-D uint8 CPU tensor, each block's bits
    (0-4) packed 3 bits a block (lowbit.pack_bits, zero-padded to a multiple of 8 blocks);
    ``codes`` and ``scales`` then hold the sent blocks grouped by bits, 1 to 4, in block order
    within a group, and ``bits`` and ``sent`` are not used. None: every code has ``bits``."""
    basis: int | None = None
    """A transformed code (`DeltaConfig.transform`, or a full code with a massive token): the
    version of the basis it is in (0: the identity) of its kind (a delta's or a full code's);
    ``block_bits`` then holds 0-8 bits a block, 4 a block (`transform.pack_map`), and ``codes``
    and ``scales`` the two stages' codes (`allocation.quantise_deep`). None: not transformed."""

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (codes, scales, bitmap or bit map; not the header)."""
        n = self.codes.numel() + 2 * self.scales.numel()
        n += 0 if self.block_bits is None else self.block_bits.numel()
        return n + (0 if self.sent is None else self.sent.numel())

    @property
    def numel(self) -> int:
        """Number of values of the original tensor."""
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        """Number of BLOCK-value blocks the tensor is cut into."""
        return -(-self.numel // BLOCK)

    @property
    def sent_blocks(self) -> int:
        """Number of blocks whose code is in the message."""
        return self.scales.numel()
