"""What a link carries under one protocol name stays what it was recorded as
(relaytrain_testkit.wire_format, tests/assets/wire_format.json): a change that a stage of the
number before would misread must move `linkauth.ALPN` on, so that such a stage is refused at
the handshake (test_links.py) instead of reading frames wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from relaytrain_testkit import wire_format
from relaytrain_testkit.wire_format import RECORD, decode_changes, field_changes
from relaytrain_worker.pipeline import boundary, linkauth, lowbit

pytestmark = pytest.mark.unit

HOW = (
    "what a link carries changed under {alpn}: a stage of it would misread these frames. "
    "Move linkauth.ALPN on and record it (PYTHONPATH=testkit:worker_image:operator "
    ".venv/bin/python -m relaytrain_testkit.wire_format):\n"
)


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    book = json.loads(RECORD.read_text())
    assert linkauth.ALPN in book, f"{linkauth.ALPN} is not recorded; " + HOW.format(
        alpn=linkauth.ALPN
    )
    return book[linkauth.ALPN]


def test_frames_carry_the_fields_their_protocol_was_recorded_with(
    recorded: dict[str, Any],
) -> None:
    changes = field_changes(recorded)
    assert not changes, HOW.format(alpn=linkauth.ALPN) + "\n".join(changes)


def test_frames_recorded_under_this_protocol_decode_as_they_did(
    recorded: dict[str, Any],
) -> None:
    changes = decode_changes(recorded)
    assert not changes, HOW.format(alpn=linkauth.ALPN) + "\n".join(changes[:10])


def test_a_field_an_older_stage_would_ignore_is_caught(
    recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """relaytrain-link/4 lacked the gradients' ``variant``: a codec that still sends none is
    flagged, as today's would have been against a record of 4; 4's record lacks it."""
    encode = boundary.BoundaryCodec.encode

    def without_variant(self: boundary.BoundaryCodec, *args: Any) -> Any:
        out = encode(self, *args)
        for entry, _ in out:
            entry.pop("variant", None)
        return out

    monkeypatch.setattr(boundary.BoundaryCodec, "encode", without_variant)
    assert field_changes(recorded) == ["- .tensors[].variant: int"]
    book = json.loads(RECORD.read_text())
    assert ".tensors[].variant: int" not in book["relaytrain-link/4"]["fields"]
    assert ".tensors[].variant: int" in book["relaytrain-link/5"]["fields"]


def test_a_decoder_whose_codes_mean_something_else_is_caught(
    recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode in another rotation (a stage of 4 reading 5's gradients, which it takes to be
    in rotation 0) turns every ``delta`` gradient's direction: each is flagged, and so is
    each low-bit outer code (coded in its step's rotation)."""
    rotate = lowbit.rotate
    monkeypatch.setattr(lowbit, "rotate", lambda blocks, variant=0: rotate(blocks, 0))
    changes = decode_changes(recorded)
    flagged = {int(c.split()[1]) for c in changes if "up) grad" in c}
    gradients = {
        i
        for i, frame in enumerate(recorded["frames"])
        if frame.get("link", "").startswith("delta") and frame.get("direction") == "up"
    }
    assert len(gradients) >= 12 and flagged == gradients
    outer = {i for i, frame in enumerate(recorded["frames"]) if frame.get("outer") in (1, 2, 4)}
    assert outer and outer <= {int(c.split()[1]) for c in changes if "outer code" in c}


def test_a_recorded_protocol_is_not_recorded_over(tmp_path: Path) -> None:
    book = tmp_path / "wire_format.json"
    shutil.copy(RECORD, book)
    with pytest.raises(SystemExit, match=f"{linkauth.ALPN} is recorded.*move linkauth.ALPN"):
        wire_format.record(book)
    assert book.read_text() == RECORD.read_text()
