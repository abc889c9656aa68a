"""Authentication and encryption of the links between stages, with a per-job secret.

Every link starts with a mutual challenge-response handshake: both ends send a fresh
random nonce, and each proves it holds the job's secret with an HMAC over the whole
hello transcript (both nonces, the job id, both stage indices). Neither the secret nor
anything replayable crosses the wire. Both ends then derive two session keys (one per
direction) with HKDF from the secret and the transcript, and every record after that is
sealed with AES-GCM under a counter nonce: a tampered, replayed, dropped or reordered
record fails its tag and the link is dropped.

Why not TLS: a pre-shared-key TLS 1.3 setup is not reachable from Python's ssl module
(no external PSK API), and certificates per stage would need a CA the operator does not
have. This is a small, standard construction (HMAC-SHA256 proofs + HKDF + AEAD) built
from the `cryptography` package's primitives; nothing here invents cryptography.

Wire format of the handshake (all integers big-endian):
  client hello  MAGIC | u8 version | nonce(32) | i32 stage | u16 n | job id (n bytes)
  server hello  MAGIC | u8 version | nonce(32) | i32 stage | u8 status | u16 n | reason
  client proof  HMAC(auth key, "client" | transcript)                       (32 bytes)
  server finish u8 status | HMAC(auth key, "server" | transcript) or u16 n | reason
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"RTL1"
VERSION = 1
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
_MAX_JOB_ID = 1024
_OK = 0
_REJECTED = 1


class LinkError(Exception):
    """Base of every error a link raises."""


class LinkBroken(LinkError, ConnectionError):  # noqa: N818 - name of the worker interface
    """The peer is gone (EOF, reset, stalled, closed) or the link can no longer be trusted."""


class FrameRejected(LinkBroken):
    """A record failed authentication: tampered, replayed or reordered. The link is closed."""


class AuthError(LinkError):
    """The peer could not prove it belongs to this job (wrong secret, job or neighbour)."""


@dataclass(frozen=True)
class Identity:
    """Who one end of a link is."""

    secret: bytes
    """The per-job secret shared by every stage of the job."""
    job_id: str
    """The job's identity, e.g. ``namespace/name`` or its uid; both ends must agree."""
    stage: int
    """This end's own stage index. A listener at stage k accepts only stage k-1."""

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"link secret has {len(self.secret)} bytes; at least {MIN_SECRET_BYTES} needed"
            )
        if not self.job_id or len(self.job_id.encode()) > _MAX_JOB_ID:
            raise ValueError(f"job id must have 1..{_MAX_JOB_ID} bytes")
        if self.stage < 0:
            raise ValueError(f"stage index must be >= 0, got {self.stage}")


class RecordCipher:
    """AES-GCM in one direction with a counter nonce; decrypts only the next record in order."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._counter = 0

    def seal(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        """Encrypt the next record; returns ciphertext + 16-byte tag."""
        nonce = self._next_nonce()
        return self._aead.encrypt(nonce, plaintext, aad)

    def open(self, ciphertext: bytes | memoryview, aad: bytes) -> bytes:
        """Decrypt the next record, or raise FrameRejected if it is not the expected one."""
        nonce = self._next_nonce()
        try:
            return self._aead.decrypt(nonce, ciphertext, aad)
        except InvalidTag:
            raise FrameRejected(
                f"record {self._counter - 1} failed authentication "
                "(tampered, replayed or reordered); link dropped"
            ) from None

    def _next_nonce(self) -> bytes:
        nonce = b"\0\0\0\0" + self._counter.to_bytes(8, "big")
        self._counter += 1
        return nonce


@dataclass
class Session:
    """The outcome of a successful handshake."""

    sender: RecordCipher
    receiver: RecordCipher
    peer_stage: int


def client_handshake(sock: socket.socket, me: Identity, peer_name: str) -> Session:
    """Run the connecting side of the handshake on a connected socket."""
    nonce_c = os.urandom(NONCE_BYTES)
    job = me.job_id.encode()
    hello_c = MAGIC + struct.pack(">B", VERSION) + nonce_c + struct.pack(">iH", me.stage, len(job))
    hello_c += job
    sock.sendall(hello_c)

    head = _recv_exact(sock, len(MAGIC) + 1 + NONCE_BYTES + 4 + 1 + 2)
    if head[:4] != MAGIC:
        raise AuthError(f"{peer_name} is not a relaytrain stage (bad handshake magic)")
    nonce_s = head[5 : 5 + NONCE_BYTES]
    peer_stage, status, n = struct.unpack(">iBH", head[5 + NONCE_BYTES :])
    reason = _recv_exact(sock, n)
    if status != _OK:
        raise AuthError(f"{peer_name} refused the link: {reason.decode(errors='replace')}")
    hello_s = head + reason
    transcript = hashlib.sha256(hello_c + hello_s).digest()
    auth_key = _auth_key(me)
    sock.sendall(_proof(auth_key, b"client", transcript))

    status = _recv_exact(sock, 1)[0]
    if status != _OK:
        n = struct.unpack(">H", _recv_exact(sock, 2))[0]
        why = _recv_exact(sock, n).decode(errors="replace")
        raise AuthError(f"{peer_name} refused the link: {why}")
    if not hmac.compare_digest(_recv_exact(sock, 32), _proof(auth_key, b"server", transcript)):
        raise AuthError(
            f"{peer_name} could not prove it holds the secret of job {me.job_id!r}; "
            "refusing to send it anything"
        )
    c2s, s2c = _session_keys(me, nonce_c + nonce_s, transcript)
    return Session(RecordCipher(c2s), RecordCipher(s2c), peer_stage)


def server_handshake(sock: socket.socket, me: Identity, peer_name: str) -> Session:
    """Run the listening side of the handshake on an accepted socket."""
    head = _recv_exact(sock, len(MAGIC) + 1 + NONCE_BYTES + 4 + 2)
    if head[:4] != MAGIC:
        raise AuthError(f"peer {peer_name} is not a relaytrain stage (bad handshake magic)")
    version = head[4]
    nonce_c = head[5 : 5 + NONCE_BYTES]
    peer_stage, n = struct.unpack(">iH", head[5 + NONCE_BYTES :])
    if n > _MAX_JOB_ID:
        raise AuthError(f"peer {peer_name} sent an oversized job id")
    peer_job_raw = _recv_exact(sock, n)
    hello_c = head + peer_job_raw
    peer_job = peer_job_raw.decode(errors="replace")

    problem = ""
    if version != VERSION:
        problem = f"link protocol version {version} != {VERSION}"
    elif peer_job != me.job_id:
        problem = f"peer belongs to job {peer_job!r}, this stage to job {me.job_id!r}"
    elif peer_stage != me.stage - 1:
        problem = f"peer is stage {peer_stage}; stage {me.stage} accepts only stage {me.stage - 1}"
    nonce_s = os.urandom(NONCE_BYTES)
    reason = problem.encode()
    hello_s = MAGIC + struct.pack(">B", VERSION) + nonce_s
    hello_s += struct.pack(">iBH", me.stage, _REJECTED if problem else _OK, len(reason))
    hello_s += reason
    sock.sendall(hello_s)
    if problem:
        raise AuthError(f"refused peer {peer_name}: {problem}")

    transcript = hashlib.sha256(hello_c + hello_s).digest()
    auth_key = _auth_key(me)
    if not hmac.compare_digest(_recv_exact(sock, 32), _proof(auth_key, b"client", transcript)):
        why = (
            f"the connecting stage could not prove it holds the secret of job {me.job_id!r} "
            "(wrong link secret?)"
        ).encode()
        sock.sendall(struct.pack(">BH", _REJECTED, len(why)) + why)
        raise AuthError(f"refused peer {peer_name}: {why.decode()}")
    sock.sendall(struct.pack(">B", _OK) + _proof(auth_key, b"server", transcript))
    c2s, s2c = _session_keys(me, nonce_c + nonce_s, transcript)
    return Session(RecordCipher(s2c), RecordCipher(c2s), peer_stage)


def _auth_key(me: Identity) -> bytes:
    return _hkdf(me.secret, b"relaytrain-link-v1", b"auth|" + me.job_id.encode(), 32)


def _session_keys(me: Identity, nonces: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    keys = _hkdf(me.secret, nonces, b"session|" + transcript, 64)
    return keys[:32], keys[32:]


def _hkdf(secret: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def _proof(key: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, role + transcript, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes during the handshake (the socket has a timeout set)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LinkBroken("peer closed the connection during the handshake")
        got += k
    return bytes(buf)
