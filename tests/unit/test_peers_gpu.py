"""A stage's sends on a GPU: the encoder waits for the kernels that made a frame, and for
no kernel queued after it (pipeline/peers.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from relaytrain_worker.pipeline.peers import AsyncLink
from relaytrain_worker.pipeline.transport import Frame, PreparedFrame

pytestmark = [pytest.mark.unit, pytest.mark.gpu]

BEFORE = 1_000_000_000
"""GPU clock cycles spun before the frame's tensor is made (about half a second)."""
AFTER = 10_000_000_000
"""Cycles spun after it is sent (about five seconds): the stage's next micro-batch."""


class Recorder:
    """A link that keeps what it is given (the socket is not what this test is about); its
    first send sets `arrived` and waits for `gate`."""

    codec = None

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.gate = threading.Event()
        self.sent: list[PreparedFrame] = []

    def send_prepared(self, prepared: PreparedFrame) -> None:
        if not self.sent:
            self.arrived.set()
            self.gate.wait(30)
        self.sent.append(prepared)

    def recv(self, timeout: float | None = None) -> Frame:
        raise NotImplementedError

    def close(self) -> None:
        pass


@pytest.mark.parametrize("side_stream", [True, False], ids=["own-stream", "default-stream"])
def test_a_frame_goes_out_before_the_kernels_queued_after_it(side_stream: bool) -> None:
    a = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    link = Recorder()
    # Encoding on the sender thread, held on a first frame until the next kernels are
    # queued: the frame's encoding starts after them, whichever thread runs first. The
    # first frame is a GPU one too: a stream's first use waits for the whole device (on an
    # H200, 2026-11-27), a running stage's does not.
    queued = AsyncLink(link, "gpu-test", overlap_encode=False, side_stream=side_stream)
    try:
        queued.send(Frame("activation", 0, 0, {"x": a * 3}, {}))
        assert link.arrived.wait(60)
        torch.cuda._sleep(BEFORE)
        x = a * 2  # queued behind the spin: the encoder must wait for it
        queued.send(Frame("activation", 0, 1, {"x": x}, {}))
        torch.cuda._sleep(AFTER)
        later = torch.cuda.Event()
        later.record()
        link.gate.set()
        queued.flush(timeout=60)
        # On its own stream the frame is on the wire while the next kernels still run; on
        # the default stream (the baseline) its copy waited for them.
        assert later.query() is not side_stream
        prepared = link.sent[1]
        expected = (torch.arange(1 << 20, dtype=torch.float32) * 2).numpy().tobytes()
        assert b"".join(bytes(part) for part in prepared.parts) == expected
    finally:
        queued.close()
        torch.cuda.synchronize()
