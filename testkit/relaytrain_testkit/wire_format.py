"""What a link carries, recorded under its protocol's name (`linkauth.ALPN`).

Two stages that speak one ALPN protocol must read each other's frames; its number moves
with any change a stage of the number before would misread (a replaced stage on a newer
image beside older ones, where the job named no image). Nothing but this record notices a
change that forgets to move it, so tests/unit/test_wire_format.py checks two things against
`RECORD` (tests/assets/wire_format.json):

- **the fields**: every header field the frames of `sample_frames` carry (each codec, the
  ``delta`` codec's full codes, deltas, bases, sampled gradients at 1 and 3 bits), a
  string field's value where it names a kind, mode or dtype, the type of the rest, and the
  wire constants outside the header. A field an older stage does not know is one it would
  ignore or trip on (as it would have ignored a gradient's rotation, ``variant``).
- **the decoding**: the frames recorded when the protocol was recorded (their bytes) still
  decode to what they decoded to then, so the codes' meaning (levels, rotations, scales)
  has not moved under the same number; and so do the outer steps' codes that pipelines
  exchange (`replicas.outer_codec`, each low-bit code in the rotation of its step, and the
  float64 rows of the exact LoRA merge), whose bytes travel as a frame's tensor.

When either differs, move `linkauth.ALPN` on and record the new protocol:
``PYTHONPATH=testkit:worker_image:operator .venv/bin/python -m relaytrain_testkit.wire_format``,
which refuses to record over a protocol already recorded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from relaytrain_worker.pipeline import frames, linkauth, transport
from relaytrain_worker.pipeline.boundary import ROWS, BoundaryCodec, codec_for
from relaytrain_worker.pipeline.compression import COMPRESSIONS
from relaytrain_worker.pipeline.frames import Frame, prepare, read_tensors
from relaytrain_worker.pipeline.sampling import sample_tokens
from relaytrain_worker.replicas import outer_codec

from relaytrain_testkit import REPO

__all__ = [
    "RECORD", "Parts", "constants", "current", "decode_all", "decode_changes", "field_changes",
    "fields", "record", "sample_frames", "summary",
]  # fmt: skip

RECORD = REPO / "tests" / "assets" / "wire_format.json"
NAMED = frozenset({"kind", "mode", "dtype", "wire", "name"})
"""Header fields whose string value is part of the format (what a reader dispatches on)."""
ROWS_N, SEQ, HIDDEN, MICROS = 2, 4, 64, 6
OUTER = ((4, 24), (2, 48), (1, 72))
"""The outer codes recorded: (bits, the outer step whose rotation codes it)."""


def sample_frames() -> Iterator[tuple[str, str, Frame, frames.PreparedFrame]]:
    """(link, direction, frame, prepared): an activation and a gradient frame under each
    code, a control frame, a frame that deflates, then two ``delta`` links' frames over two
    epochs in the order sent, each link's codec at both ends carrying its state from frame to
    frame. A link's ``down`` frames are decoded by its far end, ``up`` ones (gradients) by
    its near end."""
    gen = torch.Generator().manual_seed(0)
    mixing = torch.randn(HIDDEN, HIDDEN, generator=gen) * torch.logspace(0, -2, HIDDEN)
    data = torch.randn(MICROS * ROWS_N, SEQ, HIDDEN, generator=gen) @ mixing.T

    def activation(epoch: int, m: int) -> Frame:
        rows = torch.arange(m * ROWS_N, (m + 1) * ROWS_N)
        tensors = {
            "hidden": data[rows] * (1 + 0.05 * epoch) + 0.01 * epoch,
            "attention_mask": torch.ones(ROWS_N, SEQ, dtype=torch.long),
            "position_ids": torch.arange(SEQ).repeat(ROWS_N, 1),
            "labels": torch.randint(0, 49152, (ROWS_N, SEQ), generator=gen),
            ROWS: rows,
        }
        return Frame("activation", epoch, m, tensors, {"items": ROWS_N})

    def gradient(epoch: int, m: int, share: float) -> Frame:
        grad = torch.randn(ROWS_N, SEQ, HIDDEN, generator=gen) * 1e-3
        if share < 1:
            grad = sample_tokens(grad, share, 1000 * epoch + m)
        return Frame("gradient", epoch, m, {"grad": grad})

    for mode in COMPRESSIONS:
        yield mode, "down", (f := activation(0, 0)), prepare(f, mode)
        yield mode, "up", (f := gradient(0, 0, 1.0)), prepare(f, mode)
    control = Frame("step_end", 0, -1, {"loss": torch.tensor([2.5])}, {"short": False})
    yield "none", "down", control, prepare(control, "none")
    quiet = Frame("eval", 0, 0, {"labels": torch.zeros(4 * SEQ * HIDDEN, dtype=torch.long)})
    yield "delta", "down", quiet, prepare(quiet, "delta", BoundaryCodec())  # deflated
    links = {
        "delta:int3+basis,1bit": (codec_for("int3", transform=True, gradient_bits=1), 0.375),
        "delta": (codec_for(), 1.0),
    }
    for link, (near, share) in links.items():
        far = codec_for()
        for epoch in range(2):
            for m in range(MICROS):
                yield link, "down", (f := activation(epoch, m)), prepare(f, "delta", near)
                yield link, "up", (f := gradient(epoch, m, share)), prepare(f, "delta", far)


def decode_all(
    recorded: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Each recorded frame (`record`'s ``frames``) decoded in order as a link's two ends
    would, summarised (`summary`)."""
    ends: dict[tuple[str, str], BoundaryCodec] = {}
    out = []
    for item in recorded:
        if "outer" in item:
            out.append(_outer(item))
            continue
        codec = ends.setdefault((item["link"], item["direction"]), BoundaryCodec())
        header = frames.parse_head(base64.b64decode(item["head"]))
        parts = Parts(base64.b64decode(item["parts"]))
        out.append(summary(read_tensors(header, codec, parts.read)))
        if parts.at != len(parts.data):
            raise ValueError(f"{len(parts.data) - parts.at} bytes of a frame were left unread")
    return out


def sample_outer() -> Iterator[dict[str, Any]]:
    """An outer step's update coded as each `OUTER` code, and as a float64 row, recorded."""
    gen = torch.Generator().manual_seed(1)
    update = torch.randn(3, 100, generator=gen) * 1e-3  # not a whole number of blocks
    for bits, step in OUTER:
        code, _ = outer_codec.encode(update, 1234.0, bits, step)
        yield {"outer": bits, "step": step, "numel": update.numel(), "code": _b64(code)}
    raw = outer_codec.raw(update, 1234.0)
    yield {"outer": "float64", "step": 0, "numel": update.numel(), "code": _b64(raw)}


def _outer(item: dict[str, Any]) -> dict[str, Any]:
    code = torch.frombuffer(bytearray(base64.b64decode(item["code"])), dtype=torch.uint8)
    if item["outer"] == "float64":
        weight, values = outer_codec.unraw(code, item["numel"])
    else:
        weight, values = outer_codec.decode(code, item["numel"], item["outer"], item["step"])
    return {"weight": weight, **summary({"update": values})}


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


class Parts:
    """A frame's parts (their bytes, or the views `frames.prepare` made) read in order, as a
    link reads them off the wire (`frames.Read`: ``Parts(...).read``)."""

    def __init__(self, data: bytes | Iterable[memoryview]) -> None:
        self.data = data if isinstance(data, bytes) else b"".join(bytes(p) for p in data)
        self.at = 0

    def read(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        if nbytes < 0 or self.at + nbytes > len(self.data):
            raise ValueError("past the frame's end")
        part = torch.tensor(list(self.data[self.at : self.at + nbytes]), dtype=torch.uint8)
        self.at += nbytes
        return part.view(dtype)


def summary(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A decoded frame in a few numbers: a floating tensor's norm and its projection on a
    fixed direction (a decoder whose levels, rotation or scales moved changes both far
    beyond float rounding), an integer one's digest."""
    out: dict[str, Any] = {}
    for name, t in sorted(tensors.items()):
        if t.is_floating_point():
            x = t.double().flatten()
            probe = torch.randn(x.numel(), generator=torch.Generator().manual_seed(7)).double()
            out[name] = [float(x.norm()), float(x @ probe)]
        else:
            out[name] = hashlib.sha256(t.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    return out


def fields(value: Any, path: str = "") -> set[str]:
    """A header's fields: a path per leaf (``[]`` for any element of a list of lists or
    objects, ``[i]`` for a place in a list of numbers) with its type, or its value where
    the field is `NAMED`."""
    if isinstance(value, dict):
        out = {f"{path}: {{}}"} if not value else set()
        for key, v in value.items():
            named = key in NAMED and isinstance(v, str)
            out |= {f"{path}.{key} = {v}"} if named else fields(v, f"{path}.{key}")
        return out
    if isinstance(value, list):
        if all(isinstance(v, dict | list) for v in value):
            return set().union(*(fields(v, f"{path}[]") for v in value)) or {f"{path}: []"}
        return set().union(*(fields(v, f"{path}[{i}]") for i, v in enumerate(value)))
    return {f"{path}: {type(value).__name__}"}


def constants() -> set[str]:
    """What a link's bytes depend on outside the headers' JSON."""
    return {
        f"linkauth.verdict = {linkauth._VERDICT}",
        f"transport.length = {transport._LEN.format}",
        f"frames.WBITS = {frames.WBITS}",
        f"frames.DEFLATED_HEAD = {frames.DEFLATED_HEAD.hex()}",
        f"frames.HEAD_WORDS sha256 = {hashlib.sha256(frames.HEAD_WORDS).hexdigest()[:16]}",
    }


def current() -> tuple[list[str], list[dict[str, Any]]]:
    """(The fields and constants the frames carry now, sorted; the frames as recorded.)"""
    seen = constants()
    recorded = []
    for link, direction, _frame, prepared in sample_frames():
        seen |= fields(frames.parse_head(prepared.head))
        recorded.append({
            "link": link, "direction": direction,
            "head": base64.b64encode(prepared.head).decode(),
            "parts": base64.b64encode(b"".join(bytes(p) for p in prepared.parts)).decode(),
        })  # fmt: skip
    recorded += sample_outer()
    return sorted(seen), recorded


def field_changes(recorded: dict[str, Any]) -> list[str]:
    """The fields and constants the frames carry now that a protocol's record lacks (``+``)
    or that it has and they no longer carry (``-``)."""
    now, was = set(current()[0]), set(recorded["fields"])
    return [f"+ {f}" for f in sorted(now - was)] + [f"- {f}" for f in sorted(was - now)]


def decode_changes(recorded: dict[str, Any], rel: float = 1e-4) -> list[str]:
    """The recorded frames that no longer decode to what they did (a float beyond ``rel``
    of float rounding, an integer tensor at all), or that no longer decode."""
    try:
        got = decode_all(recorded["frames"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        return [f"the recorded frames no longer decode: {e}"]
    out = []
    for i, (now, was) in enumerate(zip(got, recorded["decoded"], strict=True)):
        frame = recorded["frames"][i]
        where = (
            f"outer code {frame['outer']}"
            if "outer" in frame
            else f"{frame['link']}, {frame['direction']}"
        )
        for name in sorted(set(now) | set(was)):
            a, b = now.get(name), was.get(name)
            same = (
                a == b
                if not isinstance(a, list) or not isinstance(b, list)
                else all(abs(x - y) <= rel * max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))
            )
            if not same:
                out.append(f"frame {i} ({where}) {name}: {a} not {b}")
    return out


def record(path: Path = RECORD) -> str:
    """Record the current protocol (`linkauth.ALPN`): its fields, its frames and what they
    decode to. Refuses a protocol already recorded: a changed format needs a new number."""
    book = json.loads(path.read_text()) if path.exists() else {}
    if linkauth.ALPN in book:
        raise SystemExit(
            f"{linkauth.ALPN} is recorded in {path}: what a link carries under one protocol "
            "does not change; move linkauth.ALPN on first"
        )
    for older in book.values():  # older protocols keep their fields, for the record
        older.pop("frames", None)
        older.pop("decoded", None)
    seen, recorded = current()
    book[linkauth.ALPN] = {"fields": seen, "frames": recorded, "decoded": decode_all(recorded)}
    path.write_text(json.dumps(book, indent=1) + "\n")
    return f"recorded {linkauth.ALPN} in {path}: {len(seen)} fields, {len(recorded)} frames"


if __name__ == "__main__":
    print(record(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORD))
