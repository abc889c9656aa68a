"""A one-way latency for a link's sends, emulated in user space: a delay line.

Benchmarks and tests run stages on one machine, where loopback answers in microseconds;
the links relaytrain targets answer in tens of milliseconds. The kernel's latency emulator
(`tc qdisc … netem`) is not available everywhere (a kernel without `sch_netem`), so a
`Link` can instead hold what it sends for ``delay`` seconds before writing it to its
socket (`Link.set_latency`). The sender hands a chunk over and goes on at once, as it would
on a real link, whose frames are in flight while the next ones are sent: the line is a
queue written by its own thread, each chunk at the time it was handed over plus ``delay``
(a pipe of that many seconds, not a sleep in ``send``). Order is kept; throughput is not
changed as long as the socket drains faster than chunks are handed over.

What it does not emulate: TCP under the line sees a loopback round trip, so a congestion
window limited by a long round trip (a bandwidth-delay product above the socket buffers)
does not slow it down, and nothing is lost (loss needs netem too).
"""

from __future__ import annotations

import collections
import socket
import threading
import time

HOLD_BYTES = 64 << 20
"""The most a line holds before ``put`` waits (a socket buffer's role: a sender far ahead of
the link it writes to is held back rather than growing memory without end)."""
DRAIN_GRACE = 10.0
"""How long ``close`` waits, past the delay, for what is held to reach the socket."""


class DelayLine:
    """Writes byte chunks to ``sock`` ``delay`` seconds after each was handed to ``put``,
    in order, from a thread of its own."""

    def __init__(self, sock: socket.socket, delay: float, name: str = "") -> None:
        self._sock = sock
        self._delay = 0.0
        self.delay = delay
        self._held: collections.deque[tuple[float, bytes]] = collections.deque()
        self._held_bytes = 0
        self._last_due = 0.0
        self._cond = threading.Condition()
        self._stopping = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name=f"delay-line {name}", daemon=True)
        self._thread.start()

    @property
    def delay(self) -> float:
        """Seconds a chunk is held before it is written (may change; order is kept)."""
        return self._delay

    @delay.setter
    def delay(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a latency cannot be negative")
        self._delay = seconds

    def put(self, chunk: bytes) -> None:
        """Hand ``chunk`` over; it is written ``delay`` seconds from now (never before an
        earlier chunk). OSError if writing an earlier chunk failed (the peer is gone)."""
        with self._cond:
            while self._held_bytes >= HOLD_BYTES and not self._stopped():
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if self._stopping:
                raise OSError("the link's delay line is closed")
            due = max(time.monotonic() + self._delay, self._last_due)
            self._last_due = due
            self._held.append((due, bytes(chunk)))
            self._held_bytes += len(chunk)
            self._cond.notify_all()

    def close(self, drain: bool) -> None:
        """Stop the line; with ``drain``, first wait (up to the delay plus `DRAIN_GRACE`) until
        what it holds is written, as a closed socket still sends what it was given."""
        with self._cond:
            if drain:
                deadline = time.monotonic() + self._delay + DRAIN_GRACE
                while self._held and not self._stopped() and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._stopping = True
            self._held.clear()
            self._held_bytes = 0
            self._cond.notify_all()

    def _stopped(self) -> bool:
        return self._stopping or self._error is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._held and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                due, chunk = self._held[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)  # a close may come meanwhile
                    continue
            try:
                self._sock.sendall(chunk)  # outside the lock: this may block on the socket
            except OSError as e:
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                if self._held and self._held[0][1] is chunk:
                    self._held.popleft()
                    self._held_bytes -= len(chunk)
                self._cond.notify_all()
