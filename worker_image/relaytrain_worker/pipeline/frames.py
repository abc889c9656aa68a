"""What crosses a link: a `Frame` (a kind, step and micro-batch ids, named tensors and a
little JSON) and its wire encoding.

`prepare` encodes a frame (compression included) into a JSON header and the tensor parts'
bytes, viewed without a copy; `transport.Link` sends a prepared frame and, receiving,
reads the header's layout back (`wire_dtype`, `MAX_HEADER`) straight into new tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from relaytrain_worker.pipeline.boundary import MODE, UNKEYED, BoundaryCodec
from relaytrain_worker.pipeline.compression import Compression, encode

__all__ = ["MAX_HEADER", "Frame", "PreparedFrame", "prepare", "wire_dtype"]

MAX_HEADER = 1 << 20
"""The largest frame header (JSON) a link sends or accepts."""

_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


@dataclass
class Frame:
    """One message between stages."""

    kind: str
    """What it is: ``activation``, ``gradient`` or ``control`` (free-form; the worker decides)."""
    step: int
    """Optimizer step the frame belongs to."""
    micro: int
    """Micro-batch index within the step (-1 for control frames)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named tensors; floating ones are compressed with the mode given to ``send``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Small JSON-serialisable extras."""


@dataclass(frozen=True)
class PreparedFrame:
    """A frame encoded for the wire, not yet sent (see ``prepare``)."""

    head: bytes
    """The JSON header."""
    parts: list[memoryview]
    """Every tensor part's bytes, in header order."""
    raw_bytes: int
    """Bytes of the tensors before compression."""
    payload_bytes: int
    """Bytes of the tensors after compression."""


def prepare(
    frame: Frame, compression: Compression | str = "none", codec: BoundaryCodec | None = None
) -> PreparedFrame:
    """Encode ``frame`` (compression included) without touching any link. The ``delta``
    compression needs the sending link's ``codec`` (`boundary.py`)."""
    coded: dict[str, tuple[dict[str, Any], list[torch.Tensor]]] = {}
    if compression == MODE:
        if codec is None:
            raise ValueError("the delta compression needs the link's BoundaryCodec")
        coded = {
            entry["name"]: (entry, parts)
            for entry, parts in codec.encode(frame.kind, frame.tensors)
        }
    parts: list[memoryview] = []
    layout = []
    payload = 0
    for name, t in frame.tensors.items():
        if name in coded:
            entry, tensors = coded[name]
        else:
            enc = encode(t, UNKEYED if compression == MODE else compression)
            entry = {
                "name": name, "mode": enc.mode, "dtype": str(enc.dtype),
                "shape": list(enc.shape), "data": _nbytes(enc.data),
                "scales": None if enc.scales is None else _nbytes(enc.scales),
                "wire": None if enc.wire_dtype is None else str(enc.wire_dtype),
                "channels": None if enc.channel_scales is None else _nbytes(enc.channel_scales),
            }  # fmt: skip
            tensors = [x for x in (enc.data, enc.scales, enc.channel_scales) if x is not None]
        layout.append(entry)
        for x in tensors:
            parts.append(_bytes_view(x))
            payload += _nbytes(x)
    header = {
        "kind": frame.kind, "step": frame.step, "micro": frame.micro,
        "meta": frame.meta, "tensors": layout,
    }  # fmt: skip
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"frame header is {len(head)} bytes; meta must stay small")
    return PreparedFrame(
        head,
        parts,
        raw_bytes=sum(t.numel() * t.element_size() for t in frame.tensors.values()),
        payload_bytes=payload,
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (CPU, contiguous, 1-D)."""
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype a frame header names (ValueError for one a frame may not carry)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} in frame") from None
