"""A stage's send queues: one encoder and one sender per link for its whole life."""

from __future__ import annotations

import threading

import pytest
from relaytrain_worker.pipeline.frames import parse_head
from relaytrain_worker.pipeline.peers import AsyncLink
from relaytrain_worker.pipeline.transport import Frame, PreparedFrame

pytestmark = pytest.mark.unit


class SlowLink:
    """A link whose first send blocks until `gate` is set; records the steps it sent."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent: list[int] = []

    def send_prepared(self, prepared: PreparedFrame) -> None:
        if not self.sent:
            self.gate.wait(30)
        self.sent.append(parse_head(prepared.head)["step"])

    def recv(self, timeout: float | None = None) -> Frame:
        raise NotImplementedError

    def close(self) -> None:
        self.gate.set()


def _senders(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"send-{name}" and t.is_alive()]


def test_a_flush_that_times_out_starts_no_second_consumer() -> None:
    link = SlowLink()
    queued = AsyncLink(link, "flush-test")
    queued.start()
    try:
        for step in range(3):
            queued.send(Frame("activation", step, 0, {}, {}))
        # The socket is stuck on the first frame: the flush gives up ...
        timed_out: TimeoutError | None = None
        try:
            queued.flush(timeout=0.2)
        except TimeoutError as exc:
            timed_out = exc
        # ... and leaves the one sender in charge (a second one would take frames from the
        # same queue and could put them on the wire out of order) ...
        assert len(_senders("flush-test")) == 1
        # ... and says so, rather than returning as if the frames were out.
        assert timed_out is not None and "3 frames to the flush-test stage" in str(timed_out)
        for step in range(3, 6):
            queued.send(Frame("activation", step, 0, {}, {}))
        link.gate.set()
        queued.flush(timeout=10)
        assert link.sent == list(range(6))
        assert len(_senders("flush-test")) == 1
    finally:
        queued.close()


def test_a_flush_returns_once_every_frame_is_on_the_socket() -> None:
    link = SlowLink()
    link.gate.set()
    queued = AsyncLink(link, "drain-test")
    queued.start()
    try:
        for step in range(50):
            queued.send(Frame("activation", step, 0, {}, {}))
        queued.flush(timeout=10)
        assert link.sent == list(range(50))  # all of them, in order, before flush returned
        queued.flush(timeout=0.1)  # nothing pending: returns at once
    finally:
        queued.close()
