"""The two links of a stage (to the previous and the next stage), with sends off-thread.

In 1F1B a stage sends activations downstream while its neighbour sends gradients
upstream over the same TCP connection; with blocking sends of large frames both could
wait for the other to read. Every send therefore goes through per-link threads (order
kept); `recv` stays on the calling thread. A failed send is raised as LinkBroken from
the next call on that link, so the schedule notices at once.

Each link has two threads in a row: an encoder (`transport.prepare`: compression and
framing) and a sender (`Link.send_prepared`: encryption and the socket). On a slow link
the next frame is compressed while the current one is on the wire, so compression costs
no link time; encoding on the sender thread would leave the link idle for every encode.

On a GPU the encoder works on a stream of its own, after an event `send` records on the
sending thread's stream: its copy to the host waits for the kernels that made the frame,
not for the kernels queued after it (on the default stream, which every thread shares, the
copy waited for both, and a neighbour for this frame while the stage computed the next).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

import torch
from relaytrain_contract import StageConfig

from relaytrain_worker.pipeline.boundary import MODE, BoundaryCodec, codec_for
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.transport import (
    Frame,
    Link,
    Listener,
    PreparedFrame,
    connect,
    prepare,
)

RECV_TIMEOUT = 900.0
"""Longest wait for a neighbour's frame; a live stage never takes this long per frame."""

_Ready = tuple[torch.device, torch.cuda.Event] | None
"""What a GPU frame's encoding waits for (`AsyncLink._ready`); None on the CPU."""


class LinkLike(Protocol):
    """What the schedule needs from a transport link."""

    codec: BoundaryCodec
    """The connection's delta state (only the ``delta`` compression reads it)."""

    def send_prepared(self, prepared: PreparedFrame) -> None: ...

    def recv(self, timeout: float | None = None) -> Frame: ...

    def close(self) -> None: ...


class AsyncLink:
    """A link whose sends are encoded and sent on two background threads, in order."""

    def __init__(
        self, link: LinkLike, name: str, *, overlap_encode: bool = True, side_stream: bool = True
    ) -> None:
        self.link = link
        self.name = name
        self.overlap_encode = overlap_encode
        """False encodes on the sender thread (no overlap; kept for the benchmark)."""
        self.side_stream = side_stream
        """False encodes a GPU frame on the default stream (kept for the GPU check)."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        """The encoding thread's stream per GPU (only that thread touches it)."""
        self._frames: queue.Queue[tuple[Frame, str, _Ready] | None] = queue.Queue()
        self._prepared: queue.Queue[PreparedFrame | _Deferred | None] = queue.Queue()
        self._error: BaseException | None = None
        self._pending = 0
        """Frames queued by `send` and not yet handed to the socket (or dropped on error)."""
        self._idle = threading.Condition()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the encoder and the sender, once: they are the queues' only consumers for
        the link's life (a second pair could take frames out of order)."""
        if self._threads:
            return
        self._threads = [
            threading.Thread(target=self._encode_loop, name=f"encode-{self.name}", daemon=True),
            threading.Thread(target=self._send_loop, name=f"send-{self.name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _done_one(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _encode_loop(self) -> None:
        while True:
            item = self._frames.get()
            if item is None:
                self._prepared.put(None)
                return
            if self._error is not None:
                self._done_one()
                continue
            if not self.overlap_encode:
                self._prepared.put(_Deferred(*item))
                continue
            try:
                self._prepared.put(self._prepare(*item))
            except BaseException as exc:
                self._fail(exc)
                self._done_one()

    def _send_loop(self) -> None:
        while True:
            item = self._prepared.get()
            if item is None:
                return
            try:
                if self._error is None:
                    if isinstance(item, _Deferred):
                        item = self._prepare(item.frame, item.compression, item.ready)
                    self.link.send_prepared(item)
            except BaseException as exc:
                self._fail(exc)
            finally:
                self._done_one()

    def _prepare(self, frame: Frame, compression: str, ready: _Ready) -> PreparedFrame:
        """Encode on this thread; only ``delta`` needs the link's per-connection codec.

        A GPU frame is encoded on this thread's own stream once the sender's kernels up to
        `send` (`ready`) are done. `prepare` ends with a blocking copy to the host, so when
        it returns nothing of this stream still reads the frame's tensors, and the memory
        the sender frees after is safe to reuse on its stream."""
        codec = self.link.codec if compression == MODE else None
        if ready is None:
            return prepare(frame, compression, codec)
        device, event = ready
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            return prepare(frame, compression, codec)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self.link.close()
        with self._idle:
            self._idle.notify_all()

    def gone(self) -> bool:
        """Whether the link has ended (a send failed, or the peer closed its end with
        nothing left to read: `transport.Link.peer_gone`), seen without receiving."""
        peer_gone = getattr(self.link, "peer_gone", None)
        return self._error is not None or (peer_gone is not None and bool(peer_gone()))

    def _check(self) -> None:
        if self._error is not None:
            raise LinkBroken(f"send to the {self.name} stage failed: {self._error}")

    def send(self, frame: Frame, compression: str = "none") -> None:
        """Queue `frame`; returns at once."""
        self._check()
        self.start()
        with self._idle:
            self._pending += 1
        self._frames.put((frame, compression, self._ready(frame)))

    def _ready(self, frame: Frame) -> _Ready:
        """For a frame on a GPU (and a side stream): an event on the sending thread's
        current stream, marking the kernels the frame's tensors wait for."""
        if not self.side_stream:
            return None
        device = next((t.device for t in frame.tensors.values() if t.is_cuda), None)
        if device is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return device, event

    def recv(
        self, kind: str, step: int, micro: int = -1, device: torch.device | None = None
    ) -> Frame:
        """Receive the next frame and check it is the one the schedule expects. ``device``:
        a GPU stage's card, where the ``delta`` codes are decoded (`BoundaryCodec.device`;
        on this thread's stream, so in order with the stage's kernels); the other codes
        decode on the CPU."""
        self._check()
        if device is not None and device.type != "cpu":
            self.link.codec.device = device
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
        """Wait until every queued frame has been handed to the socket.

        The threads keep running: flushing only waits for the queues to drain. TimeoutError
        if they do not within `timeout`; LinkBroken if a send failed.
        """
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self._pending} frames to the {self.name} stage were not sent "
                        f"within {timeout:g} s"
                    )
                self._idle.wait(left)
        self._check()

    def close(self) -> None:
        """Close the link (the peer sees LinkBroken) and stop the sender thread."""
        self.link.close()
        self._frames.put(None)
        with self._idle:
            self._idle.notify_all()


class _Deferred:
    """A frame the sender thread encodes itself (``overlap_encode=False``)."""

    def __init__(self, frame: Frame, compression: str, ready: _Ready) -> None:
        self.frame = frame
        self.compression = compression
        self.ready = ready


class Peers:
    """The previous and next links of one stage (either may be None at the ends)."""

    def __init__(
        self,
        prev: LinkLike | None,
        next_: LinkLike | None,
        *,
        overlap_encode: bool = True,
        side_stream: bool = True,
    ) -> None:
        def wrap(link: LinkLike | None, name: str) -> AsyncLink | None:
            if link is None:
                return None
            wrapped = AsyncLink(link, name, overlap_encode=overlap_encode, side_stream=side_stream)
            wrapped.start()
            return wrapped

        self.prev = wrap(prev, "previous")
        self.next = wrap(next_, "next")

    def flush(self) -> None:
        """Wait until both links have handed every frame given to them to the socket."""
        for link in (self.prev, self.next):
            if link is not None:
                link.flush()

    def broken(self) -> str | None:
        """Why this stage's pipeline is broken (a neighbour's link has ended), else None: a
        wait for other pipelines asks this, so that a stage whose neighbour died leaves
        rather than hold them up (`replicas/star.py`, "A broken pipeline")."""
        for link in (self.prev, self.next):
            if link is not None and link.gone():
                return f"the link to the {link.name} stage of this pipeline ended"
        return None

    def close(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.close()


def link_chain(
    cfg: StageConfig, tls: LinkCredentials, listener: Listener | None, timeout: float
) -> Peers:
    """A stage's two links: connect to the next stage (retrying for `timeout` seconds: a
    replacement pod takes time), then accept the previous one on `listener`. On any error
    the link made so far is closed."""
    prev: Link | None = None
    nxt: Link | None = None
    try:
        links = cfg.links
        if links.next is not None:
            assert links.next_identity is not None  # the config checks both are set
            nxt = connect(
                links.next, credentials=tls, expect=links.next_identity, retry_for=timeout,
                refused_for=links.renewal_grace_seconds,
            )  # fmt: skip
        if listener is not None:
            prev = listener.accept(timeout=timeout)
    except BaseException:
        for link in (prev, nxt):
            if link is not None:
                link.close()
        raise
    for link in (prev, nxt):
        if link is not None:  # what this end sends under delta (`boundary.codec_for`)
            link.codec = codec_for(
                cfg.pipeline.activation_error,
                transform=cfg.pipeline.activation_basis == "fitted",
                gradient_bits=cfg.pipeline.gradient_bits,
            )
    return Peers(prev, nxt)
