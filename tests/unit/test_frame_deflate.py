"""Frames under ``delta`` travel deflated where that is smaller (frames.py): losslessly, the
caches at both ends in step, never under another code, and a deflated frame that does not
agree with its header is refused naming why."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from relaytrain_testkit.wire_format import Parts
from relaytrain_worker.pipeline import boundary, frames
from relaytrain_worker.pipeline.boundary import ROWS, BoundaryCodec
from relaytrain_worker.pipeline.frames import Frame, prepare, read_tensors

pytestmark = pytest.mark.unit

ROWS_N, SEQ, HIDDEN = 4, 32, 128


def _reader(parts: Iterable[memoryview]) -> frames.Read:
    """Reads the parts' bytes in order, as a link reads them off the wire."""
    return Parts(parts).read


def _activation(step: int, hidden: torch.Tensor) -> Frame:
    tensors = {
        "hidden": hidden,
        "attention_mask": torch.ones(ROWS_N, SEQ, dtype=torch.long),
        "position_ids": torch.arange(SEQ).repeat(ROWS_N, 1),
        "labels": torch.randint(
            0, 49152, (ROWS_N, SEQ), generator=torch.Generator().manual_seed(step)
        ),
        ROWS: torch.arange(ROWS_N),
    }
    return Frame("activation", step, 0, tensors, {"items": 3})


def test_a_delta_frame_travels_deflated_and_decodes_as_its_codes_do() -> None:
    sender, receiver = BoundaryCodec(), BoundaryCodec()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS_N, SEQ, HIDDEN, generator=gen)
    # A row's first code, that code's error taken down to a quarter (`boundary.ACTIVATION_ERRORS`),
    # then its change (here: none, a map of zeros).
    for step in range(3):
        sent = _activation(step, hidden)
        prepared = prepare(sent, "delta", sender)
        header = frames.parse_head(prepared.head)
        assert header["deflated"] == [prepared.coded_bytes, prepared.payload_bytes]
        assert prepared.payload_bytes < prepared.coded_bytes
        got = read_tensors(header, receiver, _reader(prepared.parts))
        for name in ("attention_mask", "position_ids", "labels", ROWS):  # lossless
            assert torch.equal(got[name], sent.tensors[name]), name
        for row in range(ROWS_N):  # the two caches hold the same bits, the row decodes to them
            key = f"activation:{row}"
            theirs = receiver.receiver.cached(key)
            assert theirs is not None
            assert torch.equal(sender.sender.cached(key), theirs)  # type: ignore[arg-type]
            assert torch.equal(got["hidden"][row], theirs.float())
    # The third frame's codes are bit maps of zeros and its masks ones: on the wire they take
    # next to nothing, and what is left is mostly the random labels.
    assert prepared.payload_bytes < 0.6 * prepared.coded_bytes


def test_bytes_that_do_not_deflate_go_as_they_are() -> None:
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))
    prepared = prepare(Frame("control", 0, -1, {"noise": noise}), "delta", BoundaryCodec())
    header = frames.parse_head(prepared.head)
    assert "deflated" not in header
    assert prepared.payload_bytes == prepared.coded_bytes == noise.numel()  # narrowed to uint8
    got = read_tensors(header, BoundaryCodec(), _reader(prepared.parts))
    assert torch.equal(got["noise"], noise)


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_no_other_code_deflates(mode: str) -> None:
    quiet = torch.zeros(ROWS_N, SEQ, HIDDEN)  # as compressible as a tensor gets
    prepared = prepare(Frame("activation", 0, 0, {"hidden": quiet}), mode)
    assert "deflated" not in json.loads(prepared.head)  # and the header is plain JSON
    assert prepared.payload_bytes == prepared.coded_bytes


def test_a_delta_frames_header_goes_deflated_a_fraction_of_its_json() -> None:
    """Its words repeat from frame to frame (`frames.HEAD_WORDS`): an activation frame's
    header, about 800 bytes of JSON, goes in under a fifth of that, and reads back whole."""
    gen = torch.Generator().manual_seed(3)
    codec = BoundaryCodec()
    for frame in (
        _activation(0, torch.randn(ROWS_N, SEQ, HIDDEN, generator=gen)),
        Frame("gradient", 0, 0, {"grad": torch.randn(ROWS_N, SEQ, HIDDEN, generator=gen)}),
    ):
        prepared = prepare(frame, "delta", codec)
        header = frames.parse_head(prepared.head)
        plain = frames.head_bytes(header, deflated=False)
        assert prepared.head[:1] == frames.DEFLATED_HEAD and plain[:1] == b"{"
        assert len(prepared.head) < len(plain) / 3, (len(prepared.head), len(plain))
        assert (header["kind"], header["step"], header["micro"]) == (frame.kind, 0, 0)
        assert frames.parse_head(plain) == header


GRADIENT_HEAD = frames.deflate_head(b'{"kind":"gradient"}')


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (frames.DEFLATED_HEAD + b"\xff" * 40, "does not inflate"),
        (GRADIENT_HEAD[:-2], "does not end where its length says"),
        (GRADIENT_HEAD + b"\x00", "does not end where its length says"),
        (frames.deflate_head(b" " * (frames.MAX_HEADER + 1)), "inflates past"),
        (frames.deflate_head(b"[1, 2]"), "a JSON list, not an object"),
        (b"[1, 2]", "a JSON list, not an object"),
    ],
)
def test_a_header_that_does_not_read_back_is_refused_naming_why(head: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        frames.parse_head(head)


def _deflated() -> tuple[dict[str, Any], list[memoryview]]:
    prepared = prepare(_activation(0, torch.randn(ROWS_N, SEQ, HIDDEN)), "delta", BoundaryCodec())
    return frames.parse_head(prepared.head), prepared.parts


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda raw, packed: [raw + 1, packed], r"inflates to \d+ bytes, not the \d+ named"),
        (lambda raw, packed: [raw - 1, packed], r"inflates to \d+ bytes, not the \d+ named"),
        (lambda raw, packed: [0, packed], r"deflated frame of 0 bytes is out of bounds"),
        (lambda raw, packed: [2**40, packed], r"deflated frame of \d+ bytes is out of bounds"),
        (lambda raw, packed: [raw, packed - 9], r"inflates to|does not inflate"),
    ],
)
def test_a_deflated_frame_that_disagrees_with_its_header_is_refused(
    tamper: Callable[[int, int], list[int]], message: str
) -> None:
    header, parts = _deflated()
    header["deflated"] = tamper(*header["deflated"])
    with pytest.raises(ValueError, match=message):
        read_tensors(header, BoundaryCodec(), _reader(parts))


def test_a_deflated_frame_of_garbage_or_with_bytes_no_part_names_is_refused() -> None:
    header, parts = _deflated()
    garbage = memoryview(bytes(255 - b for b in bytes(parts[0])))
    with pytest.raises(ValueError, match=r"does not inflate|inflates to"):
        read_tensors(header, BoundaryCodec(), _reader([garbage]))
    header, parts = _deflated()
    header["tensors"] = [t for t in header["tensors"] if t["name"] != "labels"]
    with pytest.raises(ValueError, match=r"holds \d+ bytes its layout does not name"):
        read_tensors(header, BoundaryCodec(), _reader(parts))


def test_a_kind_whose_frames_do_not_shrink_is_tried_again_only_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deflate costs CPU time a byte; where a kind's frames do not shrink by DEFLATE_PAYS a
    link sends the next DEFLATE_RETRY of them as coded, then tries again. Activation frames
    on the same link, which do shrink, are tried every time."""
    tries = 0
    real = frames.deflate

    def counted(parts: list[memoryview]) -> bytes:
        nonlocal tries
        tries += 1
        return real(parts)

    monkeypatch.setattr(frames, "deflate", counted)
    codec = BoundaryCodec()
    gen = torch.Generator().manual_seed(2)
    gradient_tried, activation_tried = [], []
    for i in range(2 * boundary.DEFLATE_RETRY + 3):
        noise = torch.randint(0, 256, (4096,), generator=gen)  # nothing for deflate to find
        before = tries
        sent = prepare(Frame("gradient", i, 0, {"noise": noise}), "delta", codec)
        assert sent.payload_bytes == sent.coded_bytes
        if tries > before:
            gradient_tried.append(i)
        before = tries
        hidden = torch.randn(ROWS_N, SEQ, HIDDEN, generator=gen)
        prepare(_activation(i, hidden), "delta", codec)
        if tries > before:
            activation_tried.append(i)
    retry = boundary.DEFLATE_RETRY + 1
    assert gradient_tried == [0, retry, 2 * retry]
    assert activation_tried == list(range(2 * boundary.DEFLATE_RETRY + 3))
