"""A replica link as a group uses it: read by a thread of its own, frames kept by kind and
step (`ReplicaPort`). `group.LinkGroup` holds one per peer stage of the other pipelines."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.peers import AsyncLink, LinkLike
from relaytrain_worker.pipeline.transport import Frame


class ReplicaPort:
    """A link to a stage of another pipeline, read by a thread of its own.

    Sends go through an `AsyncLink` (in order, off-thread). Every frame received goes to
    `on_frame` first, under the group's condition `cond`: it may answer at once (a query,
    a late contribution whose result is known) and return True; otherwise the frame is kept
    in `inbox`, which the group searches by kind and step. When the link ends (EOF, reset,
    a failed send, `close`) the port is `gone` and `cond` is notified: a peer is never
    waited for after its pipeline has left.
    """

    def __init__(
        self,
        link: LinkLike,
        name: str,
        cond: threading.Condition,
        on_frame: Callable[[ReplicaPort, Frame], bool],
    ) -> None:
        self.name = name
        self.out = AsyncLink(link, name)
        self.inbox: list[Frame] = []
        """Frames not consumed yet, in arrival order (read and written under `cond`)."""
        self.gone = False
        """The link has ended; nothing more will arrive."""
        self._cond = cond
        self._on_frame = on_frame
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)

    def start(self) -> None:
        self.out.start()
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                frame = self.out.link.recv(timeout=None)
                with self._cond:
                    if not self._on_frame(self, frame):
                        self.inbox.append(frame)
                    self._cond.notify_all()
        except BaseException:  # EOF, reset, close: the peer's pipeline has left
            self.out.close()
            with self._cond:
                self.gone = True
                self._cond.notify_all()

    def send(self, frame: Frame) -> bool:
        """Queue `frame` uncompressed (sums must be exact); False when the link has failed."""
        try:
            self.out.send(frame, "none")
        except LinkBroken:
            return False
        return True

    def take(self, kind: str, step: int | None) -> Frame | None:
        """Remove and return the first kept frame of `kind` (and `step`, unless None); the
        caller holds `cond`."""
        for i, frame in enumerate(self.inbox):
            if frame.kind == kind and (step is None or frame.step == step):
                return self.inbox.pop(i)
        return None

    def has(self, kind: str, step: int | None) -> bool:
        return any(f.kind == kind and (step is None or f.step == step) for f in self.inbox)

    def drop_before(self, step: int) -> None:
        """Forget kept frames of steps before `step` (answers nobody waits for any more)."""
        self.inbox = [f for f in self.inbox if f.step < 0 or f.step >= step]

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until what was queued is on the socket (a link that has ended: nothing)."""
        if not self.gone:
            with contextlib.suppress(LinkBroken):
                self.out.flush(timeout)

    def close(self) -> None:
        self.out.close()
