"""The per-job link PKI: a CA and one certificate per stage, for mutual TLS on the links.

Pure: a job's identity, its pipelines' stage counts and the clock in; the files of the
job's link Secret out (file name -> PEM text). Key generation and serial numbers can be
injected, so tests mint reproducible keys; nothing here reads the clock or the cluster.

What is minted:
- A CA (EC P-256, `CA:TRUE, pathlen:0`), used once to sign the stage certificates and then
  dropped: its private key is never returned, so no stage (and no Secret) can issue a
  certificate. Each job has its own CA, minted when its Secret is created, so a stage of
  one job never trusts a stage of another, nor one of an earlier job of the same name.
- Per pipeline i and stage k, a certificate (EC P-256) whose identity is the URI SAN
  `relaytrain://<namespace>/<job>/p<i>/s<k>` (`relaytrain_contract.link_identity`), for both TLS
  roles (a stage listens for its predecessor and connects to its successor), and its key.

Why EC P-256 (ECDSA) and not Ed25519: both work with Python's ssl on OpenSSL >= 1.1.1, but
ecdsa_secp256r1_sha256 is a signature scheme every TLS 1.3 implementation must support
(RFC 8446, 9.1) and FIPS builds of OpenSSL allow, while Ed25519 is optional. The choice
costs nothing on the wire: signatures are used once per connection, bulk data is AES-GCM.

Lifetime: every certificate is valid from 5 minutes before `now` (clock skew between the
operator and the nodes) for `lifetime` (30 days by default), a generous bound on a job's
run. The Secret is created once per job and never rewritten (replacement pods reuse it);
a job that runs past the bound cannot open new links (open ones keep working) until its
`<job>-link` Secret and its pods are recreated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from relaytrain_contract import link_identity

__all__ = [
    "CA_FILE",
    "CERT_LIFETIME",
    "StagePem",
    "cert_file",
    "key_file",
    "mint_link_credentials",
    "new_key",
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
) -> dict[str, str]:
    """The link Secret's files for a job whose pipeline i has `stages[i]` stages.

    Returns `{CA_FILE: ca PEM, cert_file(i, k): cert PEM, key_file(i, k): key PEM, ...}`.
    `now` must be timezone-aware. The CA's private key is not returned.
    """
    if not stages or any(n < 1 for n in stages):
        raise ValueError(f"every pipeline needs at least one stage, got {list(stages)}")
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    start, end = now - CLOCK_SKEW, now + lifetime
    ca_key = make_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relaytrain link CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
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
    files = {CA_FILE: _pem(ca)}
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    for pipeline, count in enumerate(stages):
        for stage in range(count):
            key = make_key()
            identity = link_identity(namespace, job, pipeline, stage)
            cert = (
                x509.CertificateBuilder()
                .subject_name(
                    x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"p{pipeline}-s{stage}")])
                )
                .issuer_name(ca_name)
                .public_key(key.public_key())
                .serial_number(make_serial())
                .not_valid_before(start)
                .not_valid_after(end)
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
                .sign(ca_key, hashes.SHA256())
            )
            files[cert_file(pipeline, stage)] = _pem(cert)
            files[key_file(pipeline, stage)] = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ).decode()
    return files


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
