"""Mutual TLS 1.3 on the links between stages (Python's ssl), and the errors links raise.

Every stage holds a certificate issued by its job's CA (minted by the operator, one CA per
job) whose identity is a URI SAN, `relaytrain://<namespace>/<job>/p<pipeline>/s<stage>`.
On every link both ends present their certificate and require the other's
(`CERT_REQUIRED` on both sides), each verifies the other's chain against the job's CA
alone (no system CAs), and then each checks that the peer's identity is exactly the
neighbour it expects: the listening stage k accepts only stage k-1, the connecting stage
k-1 talks only to stage k. A stage of another job fails the chain; a stage of the same job
in the wrong place fails the identity check. Both ends then tell each other their verdict
(a refusal carries its reason), so the refused side raises an AuthError that says why.
The credentials each end brings (loaded, and reloaded when renewed) are credentials.py's.

The verdicts also carry each end's plan (`LinkCredentials.plan`, the stage document's
`job.planEpoch`): a link joins stages of one plan only. A stage of a plan the operator
replaced (every stage re-created: a re-split, a suspension) may still run where its pod was
deleted, on a node cut off, and its identity is the same as its replacement's. When it
dials or answers a stage of the later plan, it learns that its plan is over
(`PlanReplaced`, an AuthError: it stops) and the later stage drops it as a peer that is
not there (`StalePeer`, a LinkBroken: a dial is tried again, a listener waits for the next).

Host names are not checked (`check_hostname = False`): a stage is reached by its Service
DNS name in a cluster and by 127.0.0.1 in local runs, and neither says *which stage of
which job* answers. The URI SAN does, under a CA that only this job's stages trust.

The ssl work runs on memory BIOs (`SSLContext.wrap_bio`), not on an SSLSocket: a link sends
on one thread while it receives on another, and OpenSSL does not allow one SSL object to
be used by two threads at once. `TlsSession` makes every call into the SSL object under one
lock, each on a bounded amount of data in memory; the blocking socket I/O stays with the
caller, outside the lock.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # credentials.py imports this module's errors and ALPN
    from relaytrain_worker.pipeline.credentials import LinkCredentials

ALPN = "relaytrain-link/5"
"""The link protocol (TLS application protocol); a peer that does not speak it is refused.
Its number moves with any change a peer of the last number would misread: 3, the plan in
the verdicts; 4, ``delta`` frames' parts and headers deflated (frames.py); 5, each frame's
gradient coded in a rotation of its own (`boundary.variant_of`, the entry's ``variant``),
which a stage of 4 would decode in rotation 0: a gradient of the right norm in the wrong
direction. tests/unit/test_wire_format.py holds each number to what it was recorded with."""
_HANDSHAKE_READ = 16 << 10
_MAX_REASON = 1024
_OK = 0
_REFUSED = 1
_VERDICT = ">BQH"
"""A verdict: accepted or refused, the sender's plan, the length of the reason that follows."""
_VERDICT_SIZE = struct.calcsize(_VERDICT)

Expect = str | frozenset[str]
"""The identity a link's peer must prove, or the set of identities it may prove."""


class LinkError(Exception):
    """Base of every error a link raises."""


class LinkBroken(LinkError, ConnectionError):  # noqa: N818 - name of the worker interface
    """The peer is gone (EOF, reset, stalled, closed) or the link can no longer be trusted."""


class FrameRejected(LinkBroken):
    """A TLS record failed authentication (tampered, replayed or reordered). The link is closed."""


class AuthError(LinkError):
    """The peer could not prove it is the expected stage of this job (or refused us)."""


class PlanReplaced(AuthError):  # noqa: N818 - a refusal, like CertificateRefused
    """The peer is a stage of a later plan of this job: this stage's plan was replaced, and
    it stops (a process that outlived its pod)."""


class StalePeer(LinkBroken):
    """The peer is a stage of a plan of this job that a later one (this stage's) replaced:
    not the peer this link waits for."""


class CertificateRefused(AuthError):  # noqa: N818 - a refusal, like LinkBroken
    """A certificate chain did not verify, on this end or on the peer's: a stage of another
    job or of an earlier link Secret — or a renewal that has reached one end and not yet the
    other (`transport.connect` tries again for a while, reading its files again)."""


class TlsSession:
    """An established TLS session over a socket the caller reads and writes.

    `seal` turns plaintext into the bytes to write; `feed` takes bytes read from the socket
    and `read_into` returns the plaintext they held. Only one thread may seal at a time
    and it must write what `seal` returned before the next `seal` (the link's send lock);
    another thread may feed and read meanwhile.
    """

    def __init__(self, obj: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 peer_identity: str) -> None:  # fmt: skip
        self._obj = obj
        self._in = incoming
        self._out = outgoing
        self._lock = threading.Lock()
        self.peer_identity = peer_identity
        """The peer's verified identity (URI SAN)."""

    def seal(self, plaintext: bytes | memoryview) -> bytes:
        """The TLS records carrying `plaintext` (plus anything else the session must send)."""
        with self._lock:
            self._obj.write(plaintext)
            return self._out.read()

    def feed(self, ciphertext: bytes | memoryview) -> None:
        """Bytes read from the socket; an empty one means the peer closed the connection."""
        with self._lock:
            if ciphertext:
                self._in.write(ciphertext)
            else:
                self._in.write_eof()

    def read_into(self, view: memoryview, peer: str) -> int:
        """Decrypt buffered records into `view`; 0 when more bytes must be fed first.

        Raises LinkBroken when the peer closed the link, FrameRejected when a record fails
        authentication (tampering on the wire).
        """
        got = 0
        with self._lock:
            while got < len(view):
                try:
                    # With a buffer, read() returns a count (typeshed says bytes).
                    n = cast(int, self._obj.read(len(view) - got, view[got:]))
                except ssl.SSLWantReadError:
                    break
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    if got:
                        break
                    raise LinkBroken(f"{peer} closed the link (stage gone?)") from None
                except ssl.SSLError as e:
                    raise _record_error(e, peer) from None
                if n == 0:
                    break
                got += n
        return got

    def buffered(self) -> bool:
        """Whether bytes wait inside the session (a recv may find a frame without the socket)."""
        with self._lock:
            return self._obj.pending() > 0 or self._in.pending > 0


def client_handshake(
    sock: socket.socket, me: LinkCredentials, expect: str, peer_name: str
) -> TlsSession:
    """TLS as the connecting stage; `expect` is the identity the listener must have.

    AuthError when the peer is not `expect` of this job or refuses us; LinkBroken (or
    OSError) when the connection failed on the way, which is worth retrying.
    """
    return _handshake(sock, me, expect, peer_name, server=False)


def server_handshake(
    sock: socket.socket, me: LinkCredentials, expect: Expect, peer_name: str
) -> TlsSession:
    """TLS as the listening stage; `expect` is the identity the connecting stage must have,
    or a set of identities any one of which it may have (a stage's replica listener accepts
    each stage of the other pipelines that shares its layers; the session's
    `peer_identity` says which one came).

    AuthError (the listener logs it and waits for the next peer) when the peer is not
    `expect` of this job, does not speak this protocol, or refuses us.
    """
    return _handshake(sock, me, expect, f"peer {peer_name}", server=True)


# -- handshake internals -----------------------------------------------------------------


def _handshake(
    sock: socket.socket, me: LinkCredentials, expected: Expect, who: str, *, server: bool
) -> TlsSession:
    allowed = {expected} if isinstance(expected, str) else set(expected)
    expect = " or ".join(sorted(allowed))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    contexts = me.contexts()  # the folder's current files, for this new link
    context = contexts.server if server else contexts.client
    obj = context.wrap_bio(incoming, outgoing, server_side=server)
    try:
        _drive(sock, obj, incoming, outgoing)
    except ssl.SSLCertVerificationError as e:
        raise CertificateRefused(
            f"refused {who}: its certificate does not verify against this job's link CA "
            f"({e.verify_message}); expected {expect} (a stage of another job, or of an "
            "earlier link Secret?)"
        ) from None
    except ssl.SSLError as e:
        raise _handshake_error(e, who, me, expect) from None
    rule = f"{me.identity} {'accepts only' if server else 'connects only to'} {expect}"
    problem, got = _check_peer(obj, rule, allowed)
    _send_verdict(sock, obj, outgoing, problem, me.plan)
    if problem:
        raise AuthError(f"refused {who}: {problem}")
    why, plan = _recv_verdict(sock, obj, incoming, who, me=me, expect=expect)
    if why is not None:
        raise AuthError(f"{who} refused the link: {why}")
    if plan > me.plan:
        raise PlanReplaced(
            f"{who} ({got}) is a stage of plan {plan} of this job, which replaced every "
            f"stage of plan {me.plan}, this one's"
        )
    if plan < me.plan:
        raise StalePeer(
            f"{who} ({got}) is a stage of plan {plan}, which this stage's plan {me.plan} "
            "replaced (a process that outlived its pod?)"
        )
    return TlsSession(obj, incoming, outgoing, got)


def _drive(sock: socket.socket, obj: ssl.SSLObject, inc: ssl.MemoryBIO, out: ssl.MemoryBIO) -> None:
    """Run the TLS handshake over the socket (which has a timeout set)."""
    while True:
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError:
            with contextlib.suppress(OSError):  # tell the peer why (an alert), if it listens
                _flush(sock, out)
            raise
        else:
            _flush(sock, out)
            return
        _flush(sock, out)
        _pull(sock, inc)


def _flush(sock: socket.socket, out: ssl.MemoryBIO) -> None:
    if out.pending:
        sock.sendall(out.read())


def _pull(sock: socket.socket, inc: ssl.MemoryBIO) -> None:
    data = sock.recv(_HANDSHAKE_READ)
    if data:
        inc.write(data)
    else:
        inc.write_eof()


def _check_peer(obj: ssl.SSLObject, rule: str, allowed: set[str]) -> tuple[str, str]:
    """('', identity) when the verified peer is one of `allowed` speaking our protocol, else
    (what is wrong, '')."""
    if obj.selected_alpn_protocol() != ALPN:  # None: the two offered none in common
        return (
            f"the peer does not speak {ALPN}: a relaytrain stage of another version (the "
            "stages of one job must run one worker image) or not a relaytrain stage",
            "",
        )
    names: Any = (obj.getpeercert() or {}).get("subjectAltName", ())
    uris = [value for kind, value in names if kind == "URI"]
    got = uris[0] if len(uris) == 1 else f"a certificate with URI names {uris}"
    return ("", got) if got in allowed else (f"the peer is {got}, but {rule}", "")


def _send_verdict(
    sock: socket.socket, obj: ssl.SSLObject, out: ssl.MemoryBIO, problem: str, plan: int
) -> None:
    reason = problem.encode()[:_MAX_REASON]
    verdict = struct.pack(_VERDICT, _REFUSED if problem else _OK, plan, len(reason))
    obj.write(verdict + reason)
    with contextlib.suppress(OSError):  # a peer that already left is found out on reading
        _flush(sock, out)


def _recv_verdict(
    sock: socket.socket, obj: ssl.SSLObject, inc: ssl.MemoryBIO, peer_name: str, *,
    me: LinkCredentials, expect: str,
) -> tuple[str | None, int]:  # fmt: skip
    """(None when the peer accepted us, else its reason; the peer's plan)."""
    try:
        status, plan, n = struct.unpack(_VERDICT, _read_exact(sock, obj, inc, _VERDICT_SIZE))
        if n > _MAX_REASON:
            raise AuthError(f"{peer_name} sent a malformed verdict")
        reason = _read_exact(sock, obj, inc, n).decode(errors="replace")
    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
        raise LinkBroken(f"{peer_name} closed the connection during the handshake") from None
    except ssl.SSLError as e:
        raise _handshake_error(e, peer_name, me, expect) from None
    return (None if status == _OK else reason), plan


def _read_exact(sock: socket.socket, obj: ssl.SSLObject, inc: ssl.MemoryBIO, n: int) -> bytes:
    """Exactly n bytes of plaintext (what follows, e.g. the peer's first frame, stays put)."""
    buf = b""
    while len(buf) < n:
        try:
            buf += obj.read(n - len(buf))
        except ssl.SSLWantReadError:
            _pull(sock, inc)
    return buf


def _handshake_error(
    e: ssl.SSLError, peer_name: str, me: LinkCredentials, expect: str
) -> LinkError:
    reason = e.reason or str(e)
    if isinstance(e, ssl.SSLZeroReturnError | ssl.SSLEOFError):
        return LinkBroken(f"{peer_name} closed the connection during the TLS handshake")
    if "ALERT" in reason and ("UNKNOWN_CA" in reason or "CERTIFICATE" in reason):
        return CertificateRefused(
            f"{peer_name} refused this stage's certificate (TLS alert: {reason}): it does not "
            f"trust {me.identity} (another job's CA, or an earlier link Secret?); expected "
            f"it to be {expect}"
        )
    if "ALERT" in reason:
        return AuthError(
            f"{peer_name} ended the TLS handshake (alert: {reason}); expected {expect}"
        )
    if "CERTIFICATE" in reason:  # e.g. PEER_DID_NOT_RETURN_A_CERTIFICATE
        return AuthError(
            f"{peer_name} presented no usable certificate ({reason}); expected {expect}"
        )
    return AuthError(
        f"{peer_name} does not speak TLS 1.3 with {ALPN} ({reason}): not a relaytrain stage "
        f"of this version; expected {expect}"
    )


def _record_error(e: ssl.SSLError, peer: str) -> LinkBroken:
    reason = e.reason or str(e)
    if "ALERT" in reason:
        return LinkBroken(f"{peer} ended the link with a TLS alert ({reason})")
    return FrameRejected(
        f"a TLS record from {peer} failed authentication ({reason}): tampered with, replayed "
        "or reordered on the way; link dropped"
    )
