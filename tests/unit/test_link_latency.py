"""A link's emulated one-way latency (`Link.set_latency`, delayline.py): what is sent arrives
whole, in order and not before its time, without holding up the sender."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_worker.pipeline.transport import (
    SEAL_BYTES,
    Frame,
    Link,
    LinkBroken,
    Listener,
    connect,
    listen,
)

pytestmark = pytest.mark.unit

CREDS = stage_credentials(2, job="latency")


@pytest.fixture
def pair() -> Iterator[tuple[Link, Link]]:
    """(stage 0's link down, stage 1's link up), over loopback."""
    lst: Listener = listen("127.0.0.1:0", credentials=CREDS[1], expect=CREDS[0].identity)
    got: list[Link] = []
    t = threading.Thread(target=lambda: got.append(lst.accept(timeout=10)), daemon=True)
    t.start()
    down = connect(f"127.0.0.1:{lst.address[1]}", credentials=CREDS[0], expect=CREDS[1].identity)
    t.join(10)
    lst.close()
    up = got[0]
    yield down, up
    down.close()
    up.close()


def _frame(micro: int, numel: int = 16) -> Frame:
    return Frame("act", 0, micro, {"x": torch.full((numel,), float(micro))}, {})


def test_frames_arrive_in_order_and_never_before_the_latency(pair: tuple[Link, Link]) -> None:
    down, up = pair
    down.set_latency(1.0)
    arrived: list[tuple[Frame, float]] = []

    def read() -> None:
        for _ in range(20):
            frame = up.recv(timeout=30)
            arrived.append((frame, time.monotonic()))

    reader = threading.Thread(target=read)
    reader.start()  # reading all along, as a stage does
    sent_at: list[float] = []
    for micro in range(20):
        sent_at.append(time.monotonic())
        down.send(_frame(micro))
    sends_done = time.monotonic()
    reader.join(60)
    assert [f.micro for f, _ in arrived] == list(range(20))
    assert all(torch.equal(f.tensors["x"], _frame(f.micro).tensors["x"]) for f, _ in arrived)
    # Not before its time: each frame is readable a second after its send began.
    assert all(at >= sent_at[f.micro] + 1.0 for f, at in arrived)
    # The sender was not held: all twenty sends were done before the first frame arrived
    # (a sleep in send would have taken twenty seconds or more).
    assert sends_done < arrived[0][1]


def test_a_paced_link_keeps_its_throughput_with_a_latency_well_below_the_transfer(
    pair: tuple[Link, Link],
) -> None:
    """16 frames of 256 KiB at 8 MiB/s are half a second of transfer; a latency of 0.1 s
    adds 0.1 s to the last arrival, not 0.1 s per frame (1.6 s)."""
    down, up = pair
    rate, latency, frames, numel = 8 << 20, 0.1, 16, 64 << 10
    down.limit_rate(rate)
    down.set_latency(latency)
    got: list[Frame] = []
    reader = threading.Thread(target=lambda: got.extend(up.recv(30) for _ in range(frames)))
    reader.start()
    start = time.monotonic()
    for micro in range(frames):
        down.send(_frame(micro, numel))
    reader.join(60)
    took = time.monotonic() - start
    assert [f.micro for f in got] == list(range(frames))
    transfer = down.bytes_sent / rate
    # The pacing and the latency both hold: the last chunk (a frame's 256 KiB and a TLS
    # record's overhead) leaves when the ones before it have had their time, and is read a
    # latency later.
    assert took >= (down.bytes_sent - SEAL_BYTES - 1024) / rate + latency
    # One latency, not one per frame: a per-frame delay takes at least transfer + 16 x 0.1 s.
    assert took < transfer + latency * (frames - 1)


def test_what_was_sent_before_close_still_arrives(pair: tuple[Link, Link]) -> None:
    down, up = pair
    down.set_latency(0.3)
    for micro in range(3):
        down.send(_frame(micro))
    down.close()  # a closed socket delivers what it was given; so does the delay line
    assert [up.recv(timeout=30).micro for _ in range(3)] == [0, 1, 2]
    with pytest.raises(LinkBroken):
        up.recv(timeout=30)


def test_a_negative_latency_is_refused(pair: tuple[Link, Link]) -> None:
    down, up = pair
    with pytest.raises(ValueError, match="negative"):
        down.set_latency(-0.01)
    down.send(_frame(7))  # the link is still usable
    assert up.recv(timeout=30).micro == 7
