"""The two links of a stage (to the previous and the next stage), with sends off-thread.

In 1F1B a stage sends activations downstream while its neighbour sends gradients
upstream over the same TCP connection; with blocking sends of large frames both could
wait for the other to read. Every send therefore goes through a per-link sender thread
(one queue, order kept); `recv` stays on the calling thread. A failed send is raised
as LinkBroken from the next call on that link, so the schedule notices at once.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

from relaytrain_worker.linkauth import LinkBroken
from relaytrain_worker.transport import Frame

RECV_TIMEOUT = 900.0
"""Longest wait for a neighbour's frame; a live stage never takes this long per frame."""


class LinkLike(Protocol):
    """What the schedule needs from a transport link."""

    def send(self, frame: Frame, compression: str = "none") -> None: ...

    def recv(self, timeout: float | None = None) -> Frame: ...

    def close(self) -> None: ...


class AsyncLink:
    """A link whose sends run on a background thread, in order."""

    def __init__(self, link: LinkLike, name: str) -> None:
        self.link = link
        self.name = name
        self._queue: queue.Queue[tuple[Frame, str] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"send-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                self.link.send(item[0], item[1])
            except BaseException as exc:
                self._error = exc
                self.link.close()

    def _check(self) -> None:
        if self._error is not None:
            raise LinkBroken(f"send to the {self.name} stage failed: {self._error}")

    def send(self, frame: Frame, compression: str = "none") -> None:
        """Queue `frame`; returns at once."""
        self._check()
        self._queue.put((frame, compression))

    def recv(self, kind: str, step: int, micro: int = -1) -> Frame:
        """Receive the next frame and check it is the one the schedule expects."""
        self._check()
        frame = self.link.recv(timeout=RECV_TIMEOUT)
        if (frame.kind, frame.step, frame.micro) != (kind, step, micro):
            self.link.close()
            raise LinkBroken(
                f"out-of-order frame from the {self.name} stage: expected {kind} "
                f"step {step} micro {micro}, got {frame.kind} step {frame.step} "
                f"micro {frame.micro}"
            )
        return frame

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued frame has been handed to the socket."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._check()
        self._thread = threading.Thread(target=self._run, name=self._thread.name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Close the link (the peer sees LinkBroken) and stop the sender thread."""
        self.link.close()
        self._queue.put(None)


class Peers:
    """The previous and next links of one stage (either may be None at the ends)."""

    def __init__(self, prev: LinkLike | None, next_: LinkLike | None) -> None:
        self.prev = AsyncLink(prev, "previous") if prev is not None else None
        self.next = AsyncLink(next_, "next") if next_ is not None else None

    def close(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.close()
