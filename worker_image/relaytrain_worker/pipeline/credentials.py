"""One stage's link credentials: its certificate and key and the CA certificates it trusts,
loaded into TLS contexts for both roles (`linkauth` runs the handshakes with them).

How credentials arrive: a folder (`links.credentialsDir` of the stage document; in a pod
the job's link Secret, mounted) holds `tls.crt`, `tls.key` and `ca.crt`
(`LinkCredentials.from_folder`). The operator renews them during long runs: `ca.crt` then
holds the current and the next CA one after the other, and every CA in it is trusted, so
stages on either side of the renewal keep linking; later `tls.crt` and `tls.key` carry a
certificate of the next CA. The stage reads the folder again before every new link (one
readlink of the kubelet's `..data` when there is one, else the three files) and builds new
TLS contexts only when the files changed. Live links keep the session they opened with;
new links use the new files. Files that do not load (a writer caught half-way) leave the
earlier ones in use, with a warning; a certificate of another stage is refused.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from relaytrain_contract import LINK_CA_FILE, LINK_CERT_FILE, LINK_KEY_FILE

from relaytrain_worker.pipeline.linkauth import ALPN, AuthError

__all__ = ["KUBELET_DATA", "Contexts", "LinkCredentials"]

log = logging.getLogger("relaytrain.links")

KUBELET_DATA = "..data"
"""The link in a mounted Secret's folder to the folder holding its current files (the
kubelet swaps it to a new one at once when the Secret changes)."""


class Contexts(NamedTuple):
    """One loaded set of credentials, ready for handshakes."""

    not_after: datetime
    """When its certificate expires."""
    server: ssl.SSLContext
    """For links this stage accepts."""
    client: ssl.SSLContext
    """For links this stage opens."""


class LinkCredentials:
    """One stage's side of the links: its certificate and key, and the CA certificates it
    trusts (the job's CA; during a renewal the next one as well).

    Made from PEM texts, a fixed snapshot; made by `from_folder`, it follows the folder:
    every handshake re-reads it first (`contexts`). Safe to use from several threads.
    Raises AuthError when they do not fit together (a key of another certificate, a
    certificate without exactly one relaytrain identity, PEM that does not parse).
    """

    def __init__(self, cert_pem: str, key_pem: str, ca_pem: str) -> None:
        identity, self._contexts = _load(cert_pem, key_pem, ca_pem)
        self.identity = identity
        """This stage's identity: the URI SAN of its certificate (a renewal keeps it)."""
        self.plan = 0
        """The plan this stage is of (its document's `job.planEpoch`): its links join only
        stages of the same plan (linkauth)."""
        self._folder: Path | None = None
        self._source: object = None
        """What the loaded files were read from: the resolved `..data`, or their texts."""
        self._warned = ""
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> LinkCredentials:
        """Load `tls.crt`, `tls.key` and `ca.crt` from the folder `path`, and re-read them
        before every handshake from then on. AuthError naming the file and the folder when
        one is missing or empty, or when they do not load."""
        folder = Path(path)
        base = _data_dir(folder)
        texts = _read_folder(folder, base)
        try:
            creds = cls(*texts)
        except AuthError as e:
            raise AuthError(f"{e} (files in {folder})") from None
        creds._folder = folder
        creds._source = base if base is not None else texts
        return creds

    @property
    def not_after(self) -> datetime:
        """When the certificate loaded last expires; no new link can be opened after that."""
        return self._contexts.not_after

    def contexts(self) -> Contexts:
        """The TLS contexts for a new link: those of the folder's current files when they
        changed and load, else the ones loaded before. AuthError when the folder's
        certificate now names another stage."""
        if self._folder is None:
            return self._contexts
        with self._lock:
            self._reload(self._folder)
            return self._contexts

    def check_valid(self, now: datetime | None = None) -> None:
        """AuthError if the current certificate has expired (no new link could be opened)."""
        not_after = self.contexts().not_after
        now = now or datetime.now(UTC)
        if now >= not_after:
            raise AuthError(
                f"the link certificate of {self.identity} expired at "
                f"{not_after:%Y-%m-%d %H:%M} UTC; the operator renews it before that: "
                "recreate the job's link Secret and its stage pods if it could not"
            )

    def _reload(self, folder: Path) -> None:
        """Adopt the folder's files if they changed since the last load (under the lock)."""
        base = _data_dir(folder)
        if base is not None and base == self._source:
            return  # the kubelet's generation loaded last: nothing to read
        try:
            texts = _read_folder(folder, base)
            source: object = base if base is not None else texts
            if source == self._source:
                return
            identity, contexts = _load(*texts)
        except AuthError as e:
            if str(e) != self._warned:  # once per bad state, not once per link
                self._warned = str(e)
                log.warning("Kept the earlier link credentials of %s: the files in %s do not "
                            "load (%s); trying again before the next link",
                            self.identity, folder, e)  # fmt: skip
            return
        if identity != self.identity:
            raise AuthError(
                f"the link certificate in {folder} now names {identity}, but this stage is "
                f"{self.identity} (the folder holds another stage's credentials)"
            )
        self._contexts, self._source, self._warned = contexts, source, ""
        log.info("Loaded renewed link credentials of %s from %s (valid until %s UTC)",
                 self.identity, folder, f"{contexts.not_after:%Y-%m-%d %H:%M}")  # fmt: skip


# -- credentials internals ---------------------------------------------------------------


def _data_dir(folder: Path) -> Path | None:
    """The folder the kubelet's `..data` link points at now (resolved once, so the three
    files are read from one generation), or None for a plain folder."""
    data = folder / KUBELET_DATA
    return Path(os.path.realpath(data)) if data.exists() else None


def _read_folder(folder: Path, base: Path | None) -> tuple[str, str, str]:
    """The certificate, key and CA texts in `base` (the resolved `..data`) or `folder`."""
    texts = []
    for name in (LINK_CERT_FILE, LINK_KEY_FILE, LINK_CA_FILE):
        try:
            text = ((base or folder) / name).read_text()
        except FileNotFoundError:
            text = ""
        except (OSError, UnicodeDecodeError) as e:
            raise AuthError(f"{name} in {folder} (link credentials) cannot be read: {e}") from None
        if not text.strip():
            raise AuthError(f"{name} in {folder} (link credentials) is missing or empty")
        texts.append(text)
    return texts[0], texts[1], texts[2]


def _load(cert_pem: str, key_pem: str, ca_pem: str) -> tuple[str, Contexts]:
    """The identity of the certificate, and contexts for both roles."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError as e:
        raise AuthError(f"the link certificate is not a PEM certificate: {e}") from None
    identity = _identity_of(cert)
    server = _context(ssl.PROTOCOL_TLS_SERVER, cert_pem, key_pem, ca_pem)
    client = _context(ssl.PROTOCOL_TLS_CLIENT, cert_pem, key_pem, ca_pem)
    return identity, Contexts(cert.not_valid_after_utc, server, client)


def _identity_of(cert: x509.Certificate) -> str:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([])
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    if len(uris) != 1 or not uris[0].startswith("relaytrain://"):
        raise AuthError(f"the link certificate must name exactly one relaytrain:// URI, has {uris}")
    return uris[0]


def _context(protocol: int, cert_pem: str, key_pem: str, ca_pem: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # identity is the URI SAN, checked after the handshake
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.set_alpn_protocols([ALPN])
    if protocol == ssl.PROTOCOL_TLS_SERVER:
        ctx.num_tickets = 0  # no resumption: every link proves itself from scratch
    try:
        # The job's CA (during a renewal, the next one too) is the only trust anchor.
        ctx.load_verify_locations(cadata=ca_pem)
        _load_chain(ctx, cert_pem + "\n" + key_pem)
    except (ssl.SSLError, ValueError) as e:
        raise AuthError(f"the link credentials do not load ({e})") from None
    return ctx


def _load_chain(ctx: ssl.SSLContext, pem: str) -> None:
    """`load_cert_chain` reads only files: hand it an in-memory one where the OS has them,
    so the private key never touches a disk; else a private temporary file, removed at once."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("relaytrain-link", os.MFD_CLOEXEC)
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(pem.encode())
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="relaytrain-link-") as tmp:  # mode 0700
        path = Path(tmp) / "link.pem"
        path.touch(mode=0o600)
        path.write_text(pem)
        ctx.load_cert_chain(path)
