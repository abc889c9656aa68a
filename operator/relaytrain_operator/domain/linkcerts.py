"""The per-job link PKI: a CA and one certificate per stage, for mutual TLS on the links.

Pure: a job's identity, its pipelines' stage counts and the clock in; the files of the
job's link Secret out (file name -> PEM text). Key generation and serial numbers can be
injected, so tests mint reproducible keys; nothing here reads the clock or the cluster.

What is minted:
- A CA (EC P-256, `CA:TRUE, pathlen:0`), used to sign the stage certificates and then
  dropped: its private key is never written, so no stage (and no Secret) can issue a
  certificate (`relaytrain run --local` keeps it in memory to add a pipeline: `LinkCA`).
  Each job has its own CA, minted when its Secret is created, so a stage of one job never
  trusts a stage of another, nor one of an earlier job of the same name.
- Per pipeline i and stage k, a certificate (EC P-256) whose identity is the URI SAN
  `relaytrain://<namespace>/<job>/p<i>/s<k>` (`relaytrain_contract.link_identity`), for both TLS
  roles (a stage listens for its predecessor and connects to its successor), and its key.

Why EC P-256 (ECDSA) and not Ed25519: both work with Python's ssl on OpenSSL >= 1.1.1, but
ecdsa_secp256r1_sha256 is a signature scheme every TLS 1.3 implementation must support
(RFC 8446, 9.1) and FIPS builds of OpenSSL allow, while Ed25519 is optional. The choice
costs nothing on the wire: signatures are used once per connection, bulk data is AES-GCM.

Lifetime: every certificate is valid from 5 minutes before `now` (clock skew between the
operator and the nodes) for `lifetime` (spec.linkCertificates.lifetimeSeconds, 30 days by
default). Each CA is named after its generation (`relaytrain link CA g<n>`): a job renews its
certificates with a new CA before they expire, and its stages trust two CAs while they do.

Renewal (`renewal_step`, `renewed_files`): the Secret goes through three phases, each
applied only once every stage pod can have seen the previous one (the kubelet refreshes a
mounted Secret within its sync period: `propagation`):

1. Trusting: `ca.crt` holds the current CA and the next one; the next generation's stage
   certificates wait in the Secret under `next-…` names no pod mounts.
2. Switching: the stage certificates are the next generation's; `ca.crt` still holds both.
3. Current: `ca.crt` holds the new CA alone.

Any two stages one phase apart trust each other's certificates (a stage re-reads its files
before each new link; open links are never re-checked), so neighbours never refuse each
other during a renewal, and a replacement started at any point links to them.

A pipeline added to a running job (`mint_link_extension`, `extended_files`) gets its stages'
certificates from a CA of their own, valid as long as the job's and its key dropped too;
`ca.crt` then holds both, and a stage re-reads it before each new link. The next renewal
mints every planned stage under one new CA again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from relaytrain_contract import link_identity

__all__ = [
    "CA_FILE",
    "CERT_LIFETIME",
    "LinkCA",
    "LinkState",
    "Phase",
    "StagePem",
    "Step",
    "cert_file",
    "extended_files",
    "key_file",
    "mint_link_authority",
    "mint_link_credentials",
    "mint_link_extension",
    "missing_stages",
    "new_key",
    "renewal_due",
    "renewal_step",
    "renewed_files",
    "stage_pem",
]

CA_FILE = "ca.crt"
"""The job's CA certificate (public) in the Secret."""
CERT_LIFETIME = timedelta(days=30)
"""How long the CA and the stage certificates are valid."""
CLOCK_SKEW = timedelta(minutes=5)
"""Certificates are valid from this long before `now`, for nodes whose clocks lag."""

KeyFactory = Callable[[], ec.EllipticCurvePrivateKey]


class StagePem(NamedTuple):
    """What one stage is handed: its certificate and key, and the job's CA certificate."""

    cert: str
    key: str
    ca: str


def cert_file(pipeline: int, stage: int) -> str:
    """Name of a stage's certificate in the link Secret."""
    return f"p{pipeline}-s{stage}.crt"


def key_file(pipeline: int, stage: int) -> str:
    """Name of a stage's private key in the link Secret."""
    return f"p{pipeline}-s{stage}.key"


def stage_pem(files: Mapping[str, str], pipeline: int, stage: int) -> StagePem:
    """One stage's share of `mint_link_credentials`'s output."""
    return StagePem(
        files[cert_file(pipeline, stage)], files[key_file(pipeline, stage)], files[CA_FILE]
    )


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh EC P-256 private key from the operating system's randomness."""
    return ec.generate_private_key(ec.SECP256R1())


def mint_link_credentials(
    namespace: str,
    job: str,
    stages: Sequence[int],
    *,
    now: datetime,
    lifetime: timedelta = CERT_LIFETIME,
    make_key: KeyFactory = new_key,
    make_serial: Callable[[], int] = x509.random_serial_number,
    generation: int = 0,
) -> dict[str, str]:
    """The link Secret's files for a job whose pipeline i has `stages[i]` stages.

    Returns `{CA_FILE: ca PEM, cert_file(i, k): cert PEM, key_file(i, k): key PEM, ...}`.
    `now` must be timezone-aware. The CA's private key is not returned. `generation` names
    the CA (renewals count up from 0).
    """
    files, _ = mint_link_authority(
        namespace, job, stages, now=now, lifetime=lifetime, make_key=make_key,
        make_serial=make_serial, generation=generation,
    )  # fmt: skip
    return files


def mint_link_authority(
    namespace: str,
    job: str,
    stages: Sequence[int],
    *,
    now: datetime,
    lifetime: timedelta = CERT_LIFETIME,
    make_key: KeyFactory = new_key,
    make_serial: Callable[[], int] = x509.random_serial_number,
    generation: int = 0,
) -> tuple[dict[str, str], LinkCA]:
    """`mint_link_credentials`'s files, and the CA itself (`LinkCA`: its private key, in
    memory) for a caller that issues certificates for stages added later."""
    if not stages or any(n < 1 for n in stages):
        raise ValueError(f"every pipeline needs at least one stage, got {list(stages)}")
    ca = _authority(namespace, job, now, now + lifetime, f"relaytrain link CA g{generation}",
                    make_key=make_key, make_serial=make_serial)  # fmt: skip
    files = {CA_FILE: _pem(ca.cert)}
    for pipeline, count in enumerate(stages):
        for stage in range(count):
            files.update(ca.issue(pipeline, stage))
    return files, ca


def mint_link_extension(
    namespace: str,
    job: str,
    stages: Sequence[tuple[int, int]],
    *,
    now: datetime,
    not_after: datetime,
    generation: int,
    make_key: KeyFactory = new_key,
    make_serial: Callable[[], int] = x509.random_serial_number,
) -> dict[str, str]:
    """Certificates for `stages` ((pipeline, stage)) added to a running job whose
    certificates expire at `not_after`: a CA of their own, valid as long as the job's
    (its key dropped too: `extended_files` adds its certificate to what every stage
    trusts), and one certificate each. The job's CA cannot issue them: its key was dropped
    when it was minted."""
    if not stages:
        raise ValueError("no stage to mint certificates for")
    added = ",".join(f"p{p}" for p in sorted({p for p, _ in stages}))[:40]  # a CN is <= 64
    ca = _authority(namespace, job, now, not_after, f"relaytrain link CA g{generation} +{added}",
                    make_key=make_key, make_serial=make_serial)  # fmt: skip
    files = {CA_FILE: _pem(ca.cert)}
    for pipeline, stage in sorted(stages):
        files.update(ca.issue(pipeline, stage))
    return files


def _authority(
    namespace: str,
    job: str,
    now: datetime,
    end: datetime,
    ca_cn: str,
    *,
    make_key: KeyFactory,
    make_serial: Callable[[], int],
) -> LinkCA:
    """A fresh CA named `ca_cn`, valid from `now` (less the clock skew) to `end`."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    start = now - CLOCK_SKEW
    ca_key = make_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_cn)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(make_serial())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return LinkCA(ca_key, cert, (namespace, job), make_key=make_key, make_serial=make_serial)


class LinkCA:
    """A job's link CA with its private key, which issues stage certificates
    (`mint_link_authority`). Held only in the memory of whoever adds stages to a running job
    (`relaytrain run --local`'s supervisor): never written, never handed to a stage."""

    def __init__(
        self,
        key: ec.EllipticCurvePrivateKey,
        cert: x509.Certificate,
        job: tuple[str, str],
        *,
        make_key: KeyFactory,
        make_serial: Callable[[], int],
    ) -> None:
        self._key = key
        self.cert = cert
        self._job = job
        """(namespace, name) of the job."""
        self._make_key = make_key
        self._make_serial = make_serial

    def issue(self, pipeline: int, stage: int) -> dict[str, str]:
        """A certificate and key for stage `stage` of `pipeline`, valid as long as the CA:
        `{cert_file(...): PEM, key_file(...): PEM}`."""
        key = self._make_key()
        identity = link_identity(*self._job, pipeline, stage)
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
            x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"p{pipeline}-s{stage}")])
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(self._make_serial())
            .not_valid_before(self.cert.not_valid_before_utc)
            .not_valid_after(self.cert.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]),
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(aki, critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return {
            cert_file(pipeline, stage): _pem(cert),
            key_file(pipeline, stage): key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ).decode(),
        }


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


# -- renewal ------------------------------------------------------------------------------

Phase = Literal["Current", "Trusting", "Switching"]
"""Where a renewal stands (the module docstring): none under way, next CA trusted, next
certificates in use."""
Step = Literal["trust", "switch", "retire", "reissue"]
"""A change of the link Secret: the three phases of a renewal, or, once the certificates
have expired (a job suspended for longer than their lifetime), a fresh set at once."""

NEXT = "next-"
"""Prefix of the next generation's files while a renewal is under way (no pod mounts them)."""
GENERATION_ANNOTATION = "relaytrain.io/link-generation"
PHASE_ANNOTATION = "relaytrain.io/link-phase"
SINCE_ANNOTATION = "relaytrain.io/link-phase-since"

_AFTER: dict[Phase, Step] = {"Current": "trust", "Trusting": "switch", "Switching": "retire"}


@dataclass(frozen=True)
class LinkState:
    """A job's link certificates as its Secret holds them."""

    generation: int
    """The generation (CA) of the certificates the stages use: 0 at first, +1 per renewal."""
    phase: Phase
    """Where a renewal stands."""
    since: datetime
    """When the phase began."""
    issued: datetime
    """When the certificates the stages use were minted."""
    not_after: datetime
    """When they expire."""


def link_state(files: Mapping[str, str], annotations: Mapping[str, str]) -> LinkState:
    """The state of the link Secret with `files` (decoded) and `annotations`. The times
    come from the certificates themselves; a Secret without the annotations (written by an
    operator before renewal existed) is generation 0, Current since it was minted."""
    cert = x509.load_pem_x509_certificate(files[cert_file(0, 0)].encode())
    issued = cert.not_valid_before_utc + CLOCK_SKEW
    phase = annotations.get(PHASE_ANNOTATION, "Current")
    if phase not in _AFTER:
        phase = "Current"
    since = annotations.get(SINCE_ANNOTATION)
    return LinkState(
        generation=int(annotations.get(GENERATION_ANNOTATION, "0")),
        phase=phase,  # type: ignore[arg-type]  # checked against _AFTER above
        since=datetime.fromisoformat(since) if since else issued,
        issued=issued,
        not_after=cert.not_valid_after_utc,
    )


def state_annotations(state: LinkState) -> dict[str, str]:
    """The Secret annotations that record `state`'s generation and phase."""
    return {
        GENERATION_ANNOTATION: str(state.generation),
        PHASE_ANNOTATION: state.phase,
        SINCE_ANNOTATION: state.since.isoformat(),
    }


def renewal_due(state: LinkState, renew_at: float, propagation: timedelta) -> datetime:
    """When the next step of `state`'s renewal is due: a renewal starts once `renew_at` (a
    fraction) of the certificates' lifetime has passed, and early enough that its three
    phases, `propagation` apart, end before they expire; each later phase `propagation`
    after the one before."""
    if state.phase != "Current":
        return state.since + propagation
    start = state.issued + (state.not_after - state.issued) * renew_at
    return max(state.issued, min(start, state.not_after - 3 * propagation))


def renewal_step(
    state: LinkState, now: datetime, renew_at: float, propagation: timedelta
) -> Step | None:
    """The change the Secret needs at `now`, if any."""
    if now >= state.not_after:
        return "reissue"
    if now < renewal_due(state, renew_at, propagation):
        return None
    return _AFTER[state.phase]


def renewed_files(
    step: Step, files: Mapping[str, str], minted: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The link Secret's files after `step`. `minted` (for "trust" and "reissue"): a fresh
    `mint_link_credentials` of the next generation."""
    current = {name: pem for name, pem in files.items() if not name.startswith(NEXT)}
    if step in ("trust", "reissue"):
        if minted is None:
            raise ValueError(f"step {step} needs freshly minted credentials")
        if step == "reissue":
            return dict(minted)
        staged = {NEXT + name: pem for name, pem in minted.items()}
        bundle = current[CA_FILE].rstrip("\n") + "\n" + minted[CA_FILE]
        return {**current, CA_FILE: bundle, **staged}
    if step == "switch":
        switched = {
            name[len(NEXT) :]: pem
            for name, pem in files.items()
            if name.startswith(NEXT) and name != NEXT + CA_FILE
        }
        return {**current, **switched, NEXT + CA_FILE: files[NEXT + CA_FILE]}
    return {**current, CA_FILE: files[NEXT + CA_FILE]}  # retire


def extended_files(files: Mapping[str, str], minted: Mapping[str, str]) -> dict[str, str]:
    """The link Secret's files with the stages of `minted` (`mint_link_extension`) added:
    their certificates and keys beside the others', and their CA trusted by every stage
    (`ca.crt` holds it after the job's). A renewal's next generation covers every planned
    stage, so its `retire` leaves the job's new CA alone."""
    bundle = files[CA_FILE].rstrip("\n") + "\n" + minted[CA_FILE]
    return {**files, **{n: pem for n, pem in minted.items() if n != CA_FILE}, CA_FILE: bundle}


def missing_stages(
    files: Mapping[str, str], stages: Iterable[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Those of `stages` ((pipeline, stage)) the Secret's `files` hold no certificate for."""
    return [(p, k) for p, k in stages if cert_file(p, k) not in files]


def advanced(
    state: LinkState, step: Step, now: datetime, lifetime: timedelta, files: Mapping[str, str]
) -> LinkState:
    """The state after `step` taken at `now` on the Secret holding `files` (before it); a
    step that mints does so at `now` for `lifetime`."""
    if step == "trust":
        return LinkState(state.generation, "Trusting", now, state.issued, state.not_after)
    if step == "switch":
        staged = x509.load_pem_x509_certificate(files[NEXT + cert_file(0, 0)].encode())
        issued = staged.not_valid_before_utc + CLOCK_SKEW
        return LinkState(state.generation + 1, "Switching", now, issued, staged.not_valid_after_utc)
    if step == "retire":
        return LinkState(state.generation, "Current", now, state.issued, state.not_after)
    return LinkState(state.generation + 1, "Current", now, now, now + lifetime)  # reissue
