"""Mutually authenticated TLS links that carry tensor frames between neighbouring stages.

Stage k listens, stage k-1 connects (``listen`` / ``connect``); after the TLS 1.3 handshake
of ``linkauth`` (both ends present certificates of the job's CA and check that the other
is exactly the neighbour they expect) a ``Link`` sends and receives ``Frame``s (frames.py): a kind,
the step and micro-batch ids, named tensors (floating ones compressed with the job's
mode) and a little JSON.

Hand-written on plain sockets because no library frames tensors without copying them
through its own message types (gRPC, ZeroMQ), and torch.distributed and gloo carry no
authentication. This stays small: TLS carries a byte stream, frames are laid on it.

Wire format inside TLS: a frame is ``u32 length | header`` (JSON: kind, step, micro, meta
and the layout of every tensor part) followed by each tensor part's bytes (under ``delta``,
all of them deflated as one, where that is smaller: frames.py). Sends encrypt
in chunks of ``SEAL_BYTES`` straight from the tensor's memory; receives decrypt straight
into the output tensor's memory.

Errors: ``LinkBroken`` when the peer is gone (EOF, reset, stalled mid-frame, closed) –
this is how neighbours notice a dead stage; ``FrameRejected`` (a LinkBroken) when a TLS
record fails authentication; ``AuthError`` when the peer is not the expected stage of the
job (or refuses us); ``TimeoutError`` from ``recv``/``accept`` when nothing arrived in time
(the link stays usable).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from typing import Any

import torch

from relaytrain_worker.pipeline.boundary import BoundaryCodec
from relaytrain_worker.pipeline.compression import Compression
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.delayline import DelayLine
from relaytrain_worker.pipeline.frames import (
    MAX_HEADER,
    Frame,
    PreparedFrame,
    parse_head,
    prepare,
    read_tensors,
)
from relaytrain_worker.pipeline.linkauth import (
    AuthError,
    CertificateRefused,
    Expect,
    FrameRejected,
    LinkBroken,
    LinkError,
    PlanReplaced,
    StalePeer,
    TlsSession,
    client_handshake,
    server_handshake,
)

__all__ = [
    "AuthError",
    "CertificateRefused",
    "Frame",
    "FrameRejected",
    "Link",
    "LinkBroken",
    "LinkCredentials",
    "LinkError",
    "Listener",
    "PlanReplaced",
    "PreparedFrame",
    "StalePeer",
    "connect",
    "listen",
    "prepare",
]

log = logging.getLogger("relaytrain.links")

SEAL_BYTES = 256 << 10
"""Plaintext encrypted per call (16 TLS records): bounds the ciphertext held in memory and
how long a send holds the TLS session's lock; pacing (``limit_rate``) works per chunk."""
_RECV_BYTES = 1 << 20
_LEN = struct.Struct(">I")
HANDSHAKE_TIMEOUT = 10.0
STALL_TIMEOUT = 120.0
"""A frame that has started must keep arriving; a peer silent this long mid-frame is gone."""


class Link:
    """A mutually authenticated, encrypted, ordered duplex connection to one neighbour.

    ``send`` and ``recv`` may run on two different threads at once (each direction has its
    own lock); ``close`` from any thread wakes a blocked ``recv`` with LinkBroken.
    """

    def __init__(self, sock: socket.socket, tls: TlsSession, peer: str) -> None:
        self._sock = sock
        self._tls = tls
        self.peer = peer
        """The peer's address, for messages."""
        self.peer_identity = tls.peer_identity
        """The peer's identity, proven by its certificate (``relaytrain://…/p<i>/s<k>``)."""
        self.bytes_sent = 0
        """Bytes written to the socket (TLS records: framing, headers and tags included)."""
        self.bytes_received = 0
        """Bytes read from the socket (TLS records included)."""
        self.raw_bytes_sent = 0
        """Bytes the sent tensors occupy uncompressed (for the compression ratio)."""
        self.payload_bytes_sent = 0
        """Bytes the sent tensors occupy after compression (deflate included, frames.py)."""
        self.coded_bytes_sent = 0
        """Bytes the sent tensors occupy as their codes left them, before deflate."""
        self.frames_sent = 0
        self.frames_received = 0
        self._parts_received = 0
        """Bytes of tensor parts read (plaintext), for each frame's ``wire_bytes``."""
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._rate: float | None = None
        self._paced_until = 0.0
        self._line: DelayLine | None = None
        self._closed = False
        self.codec = BoundaryCodec()
        """What the ``delta`` compression keeps for this connection, both directions."""
        self._rbuf = bytearray(64 << 10)
        self._wire = bytearray(_RECV_BYTES)

    @property
    def closed(self) -> bool:
        return self._closed

    def limit_rate(self, bytes_per_second: float | None) -> None:
        """Cap what this end sends (None: no cap), to emulate a slow link in benchmarks and
        tests on one machine (loopback moves GB/s; the links relaytrain targets 25-125 MB/s)."""
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("rate must be positive")
        self._rate = bytes_per_second
        self._paced_until = time.monotonic()

    def set_latency(self, seconds: float) -> None:
        """Make what this end sends readable at the other end ``seconds`` later (a one-way
        latency, for benchmarks and tests: delayline.py), without holding up this end's
        next sends; 0 sends without delay. Off unless called; combines with ``limit_rate``
        (the pacing decides when a chunk leaves, the delay when it arrives)."""
        if seconds < 0:
            raise ValueError("a latency cannot be negative")
        if self._line is None:
            if seconds == 0:
                return
            self._line = DelayLine(self._sock, seconds, self.peer)
        self._line.delay = seconds

    def send(self, frame: Frame, compression: Compression | str = "none") -> None:
        """Send ``frame``; floating tensors are encoded with ``compression``."""
        self.send_prepared(prepare(frame, compression, self.codec))

    def send_prepared(self, prepared: PreparedFrame) -> None:
        """Send a frame encoded earlier by ``prepare`` (possibly on another thread, so that
        encoding the next frame overlaps sending this one)."""
        with self._send_lock:
            self._check_open()
            try:
                self._send_bytes(_LEN.pack(len(prepared.head)) + prepared.head)
                for part in prepared.parts:
                    for off in range(0, len(part), SEAL_BYTES):
                        self._send_bytes(part[off : off + SEAL_BYTES])
            except OSError as e:
                self._fail()
                raise LinkBroken(f"link to {self.peer} broke while sending: {e}") from e
            except BaseException:
                self._fail()  # a half-sent frame cannot be taken back: the link is unusable
                raise
            self.frames_sent += 1
            self.raw_bytes_sent += prepared.raw_bytes
            self.payload_bytes_sent += prepared.payload_bytes
            self.coded_bytes_sent += prepared.coded_bytes

    def recv(self, timeout: float | None = None) -> Frame:
        """Receive the next frame; TimeoutError if none starts within ``timeout`` seconds."""
        with self._recv_lock:
            self._check_open()
            if not self._wait_readable(timeout):
                raise TimeoutError(f"no frame from {self.peer} within {timeout} s")
            try:
                size = _LEN.unpack(self._recv_bytes(_LEN.size))[0]
                if size > MAX_HEADER:
                    raise ValueError(f"frame header of {size} bytes is out of bounds")
                header = parse_head(bytes(self._recv_bytes(size)))
                parts = self._parts_received
                tensors = read_tensors(header, self.codec, self._recv_part)
            except LinkBroken:
                self._fail()
                raise
            except OSError as e:
                self._fail()
                raise LinkBroken(f"link to {self.peer} broke while receiving: {e}") from e
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                self._fail()
                raise LinkBroken(f"malformed frame from {self.peer}: {e}") from e
            except BaseException:
                self._fail()  # interrupted mid-frame: the stream position is lost
                raise
            self.frames_received += 1
            wire = _LEN.size + size + self._parts_received - parts
            kind, step, micro = header["kind"], header["step"], header["micro"]
            return Frame(kind, step, micro, tensors, header["meta"], wire_bytes=wire)

    def close(self) -> None:
        """Close the link; the peer sees LinkBroken on its next recv. Idempotent. With a
        latency set, what was sent is delivered first (waiting up to the latency and
        `delayline.DRAIN_GRACE`), as a closed socket still sends what it was given."""
        self._close(drain=True)

    def _close(self, drain: bool) -> None:
        if self._closed:
            return
        if self._line is not None:  # what was sent is delivered, as a closed socket's is
            self._line.close(drain=drain)
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LinkBroken(f"link to {self.peer} is closed")

    def _fail(self) -> None:
        self._close(drain=False)

    def _send_bytes(self, plaintext: bytes | memoryview) -> None:
        sealed = self._tls.seal(plaintext)
        if self._rate is not None:
            # Token-bucket pacing: a chunk is handed over when its last byte would have
            # crossed the link, as a link delivers it, not when its first could start (a
            # frame of one chunk then arrived a whole frame's time early).
            now = time.monotonic()
            self._paced_until = max(self._paced_until, now) + len(sealed) / self._rate
            if self._paced_until > now:
                time.sleep(self._paced_until - now)
        if self._line is not None:
            self._line.put(sealed)
        else:
            self._sock.sendall(sealed)
        self.bytes_sent += len(sealed)

    def _recv_bytes(self, n: int) -> memoryview:
        """Read n bytes into the link's reusable buffer; valid until the next call."""
        if len(self._rbuf) < n:
            self._rbuf = bytearray(n)
        view = memoryview(self._rbuf)[:n]
        self._recv_into(view)
        return view

    def _recv_part(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)  # not zero-filled: every byte is written
        self._parts_received += nbytes
        if nbytes:
            array: Any = out.numpy()
            self._recv_into(memoryview(array).cast("B"))
        return out.view(dtype)

    def _recv_into(self, view: memoryview) -> None:
        """Fill ``view`` with plaintext, decrypting straight into it."""
        got = 0
        ended = False
        while got < len(view):
            n = self._tls.read_into(view[got:], self.peer)
            if n:
                got += n
                continue
            if ended:  # the socket ended and the session holds nothing more: it is gone
                raise LinkBroken(f"{self.peer} closed the link mid-frame (stage gone?)")
            # What the session holds is not a whole record: more must come from the socket.
            if not self._wait_readable(STALL_TIMEOUT, socket_only=True):
                raise LinkBroken(f"{self.peer} stalled for {STALL_TIMEOUT:.0f} s mid-frame")
            k = self._sock.recv_into(self._wire)
            self.bytes_received += k
            self._tls.feed(memoryview(self._wire)[:k])
            ended = k == 0

    def peer_gone(self) -> bool:
        """Whether the peer has ended the link with nothing of it left to read: closed here,
        or the socket at its end (EOF or reset) with no record waiting. Seen without a
        `recv` and without taking anything (a peek): how a stage that needs nothing from its
        neighbour right now learns that the neighbour died."""
        if self._closed:
            return True
        try:
            if self._tls.buffered() or not self._wait_readable(0, socket_only=True):
                return False  # a record to read, or open and quiet
        except LinkBroken:  # closed here meanwhile, by another thread
            return True
        try:
            waiting = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:  # reset
            return True
        return waiting == b""

    def _wait_readable(self, timeout: float | None, socket_only: bool = False) -> bool:
        if self._closed:
            raise LinkBroken(f"link to {self.peer} is closed")
        if not socket_only and self._tls.buffered():
            return True
        poller = select.poll()
        try:
            poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        except ValueError:  # closed by another thread since the check above (fileno() is -1)
            raise LinkBroken(f"link to {self.peer} is closed") from None
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


class Listener:
    """A listening socket of stage k; ``accept`` returns authenticated links from stage k-1."""

    def __init__(self, sock: socket.socket, me: LinkCredentials, expect: Expect) -> None:
        self._sock = sock
        self._me = me
        self._expect = expect
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); useful with port 0."""
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def accept(self, timeout: float | None = None) -> Link:
        """Wait for the expected peer; refused peers are logged and skipped, and so is a stage
        of a plan this stage's replaced (`StalePeer`).

        Raises TimeoutError when no good peer arrived within ``timeout`` seconds, and
        PlanReplaced when a stage of a later plan came: this stage's plan is over.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no peer connected within {timeout} s")
            try:
                self._sock.settimeout(left)
                conn, addr = self._sock.accept()
            except TimeoutError:
                raise TimeoutError(f"no peer connected within {timeout} s") from None
            except OSError as e:
                if self._closed:
                    raise LinkBroken("the listener was closed") from None
                raise LinkBroken(f"accepting a link failed: {e}") from e
            peer = _fmt_addr(addr)
            _tune(conn)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            try:
                session = server_handshake(conn, self._me, self._expect, peer)
            except PlanReplaced:  # this stage's plan is over: it stops
                conn.close()
                raise
            except AuthError as e:
                log.warning("Refused link: %s", e)
                conn.close()
                continue
            except (OSError, LinkBroken) as e:
                log.warning("Dropped connection from %s during the handshake: %s", peer, e)
                conn.close()
                continue
            conn.settimeout(None)
            log.info("Accepted link from %s at %s", session.peer_identity, peer)
            return Link(conn, session, peer)

    def close(self) -> None:
        """Stop listening; an ``accept`` blocked in another thread raises LinkBroken."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        self._sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def listen(addr: str, *, credentials: LinkCredentials, expect: Expect) -> Listener:
    """Listen on ``host:port`` with this stage's ``credentials``, for the stage whose
    identity is ``expect`` (the previous stage of the same pipeline), or for any of a set of
    identities (the stages of other pipelines that share its layers; ``Link.peer_identity``
    says which one came)."""
    host, port = _parse_addr(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(8)
    return Listener(sock, credentials, expect)


def connect(
    addr: str,
    *,
    credentials: LinkCredentials,
    expect: str,
    retry_for: float = 60.0,
    refused_for: float = 0.0,
) -> Link:
    """Connect with this stage's ``credentials`` to the stage at ``addr`` whose identity
    must be ``expect`` (the next stage of the same pipeline).

    Unreachable or not-yet-resolvable peers are retried with exponential back-off (0.1 s
    doubling to 5 s) for ``retry_for`` seconds, then LinkBroken. A certificate chain that
    does not verify on one end (CertificateRefused) is tried again for ``refused_for``
    seconds (at most ``retry_for``), each try with the credentials' files read again: a
    renewal of the job's certificates may have reached one end first. Then it is raised,
    as any other AuthError (the wrong stage, the wrong protocol; PlanReplaced: the peer is
    of a later plan, this stage's is over) is at once. A peer of a plan this stage's
    replaced (StalePeer) is tried again, as one not there yet.
    """
    host, port = _parse_addr(addr)
    start = time.monotonic()
    deadline, refused_until = start + retry_for, start + min(refused_for, retry_for)
    delay = 0.1
    while True:
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
            _tune(sock)
            session = client_handshake(sock, credentials, expect, f"stage at {addr}")
            sock.settimeout(None)
            log.info("Connected to %s at %s", session.peer_identity, addr)
            return Link(sock, session, addr)
        except CertificateRefused as e:
            if sock is not None:
                sock.close()
            left = refused_until - time.monotonic()
            if left <= 0:
                log.error("Link refused: %s", e)
                raise
            log.warning("Link refused on the certificate chain (%s); trying again in %.1f s, "
                        "in case a renewal has reached one end first", e, delay)  # fmt: skip
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
        except AuthError as e:
            if sock is not None:
                sock.close()
            log.error("Link refused: %s", e)
            raise
        except (OSError, LinkBroken) as e:
            if sock is not None:
                sock.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkBroken(f"could not reach {addr} within {retry_for:.0f} s: {e}") from e
            level = logging.WARNING if isinstance(e, StalePeer) else logging.DEBUG
            log.log(level, "Connecting to %s failed (%s); retrying in %.1f s", addr, e, delay)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)


def _parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"link address {addr!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def _fmt_addr(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}"


def _tune(sock: socket.socket) -> None:
    """Small frames go out at once; a silently dead host is noticed within about a minute."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
