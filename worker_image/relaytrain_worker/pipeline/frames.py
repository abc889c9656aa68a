"""What crosses a link: a `Frame` (a kind, step and micro-batch ids, named tensors and a
little JSON) and its wire encoding.

`prepare` encodes a frame (compression included) into a JSON header and the tensor parts'
bytes, viewed without a copy; `transport.Link` sends a prepared frame and, receiving, reads
the header (`MAX_HEADER`) and hands `read_tensors` a reader of the parts that follow, which
it reads straight into new tensors by the header's layout (`wire_dtype`).

Under ``delta`` (`boundary.py`, the codec for slow links) the parts go **deflated** as one
stream (zlib's raw DEFLATE at ``DEFLATE_LEVEL``; the header's ``deflated`` names its size
before and after) wherever that is smaller. The codes, maps, scales, masks, positions and
labels of a frame are not uniform bytes: codes of quiet coordinates repeat, a row's bit map is
mostly runs, scales share their exponent bytes and a 0/1 mask is all ones, so DEFLATE's
matches and Huffman codes take 11-16 % off an activation frame (bench/bench_delta_boundary.py,
docs/links-and-checkpoints.md); a gradient's Lloyd-Max codes hardly shrink, and a link stops
trying them (`BoundaryCodec.deflate_due`). It is lossless: the delta caches at both ends see
the same codes as without it. zlib is the standard library's; a link's encoder thread
deflates a frame while its sender sends the one before, which on the slow links ``delta`` is
for takes longer (`link_cost.DEFLATE_SECONDS_PER_BYTE`).

A ``delta`` frame's header goes deflated too (`head_bytes`: a zero byte, then raw DEFLATE
primed with `HEAD_WORDS`, the words every such header repeats), which takes an activation
header from about 800 bytes to under 100 and a gradient's from about 200 to about 50: at a
tiny model's frames of 256 tokens that is 3 bytes a token of the 64 or so ``delta`` leaves;
at a real model's width, noise. A JSON header begins with ``{``, so the receiver tells the
two apart by the first byte (`parse_head`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relaytrain_worker.pipeline.boundary import CODEC_MODES, MODE, UNKEYED, BoundaryCodec
from relaytrain_worker.pipeline.compression import (
    Compression,
    EncodedTensor,
    check_mode,
    decode,
    encode,
)

__all__ = [
    "MAX_HEADER", "Frame", "Inflated", "PreparedFrame", "bytes_view", "deflate", "deflate_head",
    "head_bytes", "parse_head", "prepare", "read_tensors", "wire_dtype",
]  # fmt: skip

MAX_HEADER = 1 << 20
"""The largest frame header (JSON) a link sends or accepts."""
DEFLATE_LEVEL = 1
"""zlib's level for a ``delta`` frame's parts (1-9): on bench_delta_boundary.py's frames 1
takes 13.0 % off, 6 and 9 13.2 %, at the same speed on one CPU thread (25 MB/s on the 2-core
dev VM; `link_cost.DEFLATE_SECONDS_PER_BYTE`)."""
HEAD_WORDS = (
    b'"mode":"lowbit","bits":3,"dtype":"torch.float32","shape":[],"data":,"scales":}],'
    b'"tensors":[{"name":"grad","mode":"tokens","bits":3,"dtype":"torch.float32","shape":[],'
    b'"map":,"data":,"scales":}],"deflated":[]}'
    b'{"kind":"gradient","step":,"micro":,"meta":{},'
    b'{"name":"rows","mode":"none","dtype":"torch.int64","shape":[],"data":,"scales":null,'
    b'"wire":"torch.uint8","channels":null},'
    b'{"name":"labels","mode":"none","dtype":"torch.int64","shape":[],"data":,"scales":null,'
    b'"wire":"torch.uint8","channels":null},'
    b'{"name":"position_ids","mode":"none","dtype":"torch.int64","shape":[],"data":,'
    b'"scales":null,"wire":"torch.uint8","channels":null},'
    b'{"name":"attention_mask","mode":"none","dtype":"torch.int64","shape":[],"data":,'
    b'"scales":null,"wire":"torch.uint8","channels":null}],'
    b'{"kind":"activation","step":,"micro":,"meta":{"items":},"tensors":[{"name":"hidden",'
    b'"mode":"delta","dtype":"torch.float32","shape":[],"messages":[[,,,,,null,],[,,,,,null,]]},'
)
"""zlib's preset dictionary for a deflated header (`head_bytes`): what ``delta`` frames'
headers say every time, the likeliest last (DEFLATE reaches back 32 KiB; nearer matches cost
fewer bits). Both ends must hold the same bytes: a change is a change of the wire format."""
DEFLATED_HEAD = b"\x00"
"""The first byte of a deflated header (a JSON one begins with ``{``)."""
HEAD_LEVEL = 9
"""zlib's level for a deflated header: a header is a few hundred bytes, so the best level
costs microseconds (58 µs for an activation header against 37 µs for its JSON alone)."""
WBITS = -15
"""zlib's window for raw DEFLATE (no zlib header or checksum: TLS already checks the bytes),
32 KiB: parts and headers alike."""
MAX_INFLATED = 1 << 31
"""The most bytes a deflated frame may say it holds (a frame of 2 GiB is a malformed one)."""

Read = Callable[[int, torch.dtype], torch.Tensor]
"""``read(nbytes, dtype)``: the frame's next part, ``nbytes`` bytes viewed as ``dtype``."""

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
    wire_bytes: int = 0
    """What the frame took on the link (its length word, header and parts, before TLS), set
    by the link that received it; 0 on a frame not received."""


@dataclass(frozen=True)
class PreparedFrame:
    """A frame encoded for the wire, not yet sent (see ``prepare``)."""

    head: bytes
    """The header: JSON, deflated under ``delta`` (`head_bytes`)."""
    parts: list[memoryview]
    """Every tensor part's bytes, in header order."""
    raw_bytes: int
    """Bytes of the tensors before compression."""
    payload_bytes: int
    """Bytes of the tensors after compression (deflate included): what ``parts`` hold."""
    coded_bytes: int
    """Bytes of the tensors as their codes left them, before any deflate (``delta``'s own
    bytes; ``payload_bytes`` where the frame is not deflated)."""


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
            for entry, parts in codec.encode(frame.kind, frame.tensors, frame.step, frame.micro)
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
            parts.append(bytes_view(x))
            payload += _nbytes(x)
    header: dict[str, Any] = {
        "kind": frame.kind, "step": frame.step, "micro": frame.micro,
        "meta": frame.meta, "tensors": layout,
    }  # fmt: skip
    coded_bytes = payload
    if compression == MODE and codec is not None and payload and codec.deflate_due(frame.kind):
        deflated = deflate(parts)
        codec.deflated(frame.kind, payload, len(deflated))
        if len(deflated) < payload:
            header["deflated"] = [payload, len(deflated)]
            parts, payload = [memoryview(deflated)], len(deflated)
    head = head_bytes(header, deflated=compression == MODE)
    return PreparedFrame(
        head,
        parts,
        raw_bytes=sum(t.numel() * t.element_size() for t in frame.tensors.values()),
        payload_bytes=payload,
        coded_bytes=coded_bytes,
    )


def read_tensors(
    header: dict[str, Any], codec: BoundaryCodec, read: Read
) -> dict[str, torch.Tensor]:
    """The tensors of a frame whose ``header`` was read, from the parts ``read`` reads next
    (inflating them first where the header says they were deflated). ValueError, KeyError or
    TypeError where the header and the parts disagree."""
    inflated = None
    if header.get("deflated") is not None:
        raw, packed = (int(n) for n in header["deflated"])
        inflated = Inflated(read(packed, torch.uint8), raw)
        read = inflated.read

    def elements(count: int, dtype: torch.dtype) -> torch.Tensor:
        return read(count * torch.empty((), dtype=dtype).element_size(), dtype)

    tensors: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        if entry["mode"] in CODEC_MODES:
            dtype = wire_dtype(entry["dtype"])
            tensors[entry["name"]] = codec.decode(header["kind"], entry, dtype, elements)
            continue
        data = read(entry["data"], torch.uint8)
        scales = None if entry["scales"] is None else read(entry["scales"], torch.bfloat16)
        channels = entry.get("channels")
        channels = None if channels is None else read(channels, torch.bfloat16)
        wire = entry.get("wire")
        enc = EncodedTensor(
            check_mode(entry["mode"]), wire_dtype(entry["dtype"]), tuple(entry["shape"]),
            data, scales, None if wire is None else wire_dtype(wire), channels,
        )  # fmt: skip
        tensors[entry["name"]] = decode(enc)
    if inflated is not None:
        inflated.check_read()
    return tensors


def head_bytes(header: dict[str, Any], *, deflated: bool) -> bytes:
    """``header`` as a link sends it: JSON, or (``deflated``) `DEFLATED_HEAD` and its JSON
    deflated against `HEAD_WORDS`. ValueError where the JSON is over `MAX_HEADER`."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"frame header is {len(head)} bytes; meta must stay small")
    return deflate_head(head) if deflated else head


def deflate_head(head: bytes) -> bytes:
    """``head`` (a header's JSON) as a deflated header: `DEFLATED_HEAD`, then raw DEFLATE
    against `HEAD_WORDS`. `parse_head` reads it back."""
    z = zlib.compressobj(HEAD_LEVEL, zlib.DEFLATED, WBITS, zdict=HEAD_WORDS)
    return DEFLATED_HEAD + z.compress(head) + z.flush()


def parse_head(head: bytes) -> dict[str, Any]:
    """The header a link received (`head_bytes`). ValueError where it is not JSON, does not
    inflate, or inflates past `MAX_HEADER`."""
    if head[:1] == DEFLATED_HEAD:
        z = zlib.decompressobj(WBITS, zdict=HEAD_WORDS)
        try:
            head = z.decompress(head[1:], MAX_HEADER + 1)
        except zlib.error as e:
            raise ValueError(f"deflated frame header does not inflate: {e}") from None
        if len(head) > MAX_HEADER:
            raise ValueError(f"deflated frame header inflates past {MAX_HEADER} bytes")
        if not z.eof or z.unused_data or z.unconsumed_tail:
            raise ValueError("deflated frame header does not end where its length says")
    header = json.loads(head)
    if not isinstance(header, dict):
        raise ValueError(f"frame header is a JSON {type(header).__name__}, not an object")
    return header


def deflate(parts: list[memoryview]) -> bytes:
    """The parts as one raw DEFLATE stream (no zlib header or checksum: TLS already
    authenticates every byte)."""
    z = zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, WBITS)
    return b"".join([*(z.compress(p) for p in parts), z.flush()])


class Inflated:
    """A deflated frame's parts, inflated, read in order (`Read`)."""

    def __init__(self, packed: torch.Tensor, raw: int) -> None:
        if not 0 < raw <= MAX_INFLATED:
            raise ValueError(f"deflated frame of {raw} bytes is out of bounds")
        z = zlib.decompressobj(WBITS)
        try:
            data = z.decompress(bytes_view(packed), raw)
        except zlib.error as e:
            raise ValueError(f"deflated frame does not inflate: {e}") from None
        if len(data) != raw or not z.eof or z.unconsumed_tail:
            raise ValueError(f"deflated frame inflates to {len(data)} bytes, not the {raw} named")
        self._data = memoryview(data)
        self._at = 0

    def read(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        end = self._at + nbytes
        if nbytes < 0 or end > len(self._data):
            raise ValueError(f"frame part of {nbytes} bytes past the deflated frame's end")
        # One copy, into storage of the part's own (aligned for any dtype); torch.frombuffer
        # refuses an empty buffer.
        part = (
            torch.frombuffer(bytearray(self._data[self._at : end]), dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        self._at = end
        return part.view(dtype)

    def check_read(self) -> None:
        if self._at != len(self._data):
            left = len(self._data) - self._at
            raise ValueError(f"deflated frame holds {left} bytes its layout does not name")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a CPU tensor, contiguous): what `deflate` takes."""
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
