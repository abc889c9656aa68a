"""How a job's `s3://` URIs are reached: the endpoint and credential rules of the contract.

Endpoint: `checkpoint.endpoint` names an S3 endpoint (MinIO, another S3-compatible store)
or is null, which means AWS S3 itself: its global endpoint, over TLS, in the region that
AWS's standard environment names (`s3_endpoint`).

Credentials: a job that names a credential Secret gets that key pair (in the variables the
stage document names). One that names none uses AWS's standard credential chain:
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN` from the environment;
else the profile `AWS_PROFILE` (else `default`) of the shared credentials file
`AWS_SHARED_CREDENTIALS_FILE` (else `$HOME/.aws/credentials`) (`aws_credentials`); else, on
AWS S3 (`S3Endpoint.is_aws`), the IAM role of the pod or machine (IRSA web identity, ECS,
EC2 instance metadata: the S3 client's job, so not here); else anonymous access.

Every reader of a job's store (the worker, the operator, `relaytrain run --local`) resolves
endpoints and credentials here, so they cannot disagree.
"""

from __future__ import annotations

import configparser
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from relaytrain_contract.names import (
    ACCESS_KEY_ENV,
    CREDENTIALS_FILE_ENV,
    PROFILE_ENV,
    REGION_ENVS,
    SECRET_KEY_ENV,
    SESSION_TOKEN_ENV,
)

AWS_S3_HOST = "s3.amazonaws.com"
"""AWS S3's global endpoint; the client finds a bucket's region from it (or from AWS_REGION)."""


@dataclass(frozen=True)
class S3Endpoint:
    """How to reach an S3 endpoint."""

    host: str
    """`host[:port]`, as S3 clients take it."""
    secure: bool
    """TLS (`https://`, and always for AWS)."""
    region: str | None = None
    """AWS region, when on AWS the environment names one (None: the client asks the bucket)."""

    @property
    def is_aws(self) -> bool:
        """AWS S3 itself (its credentials may also come from the pod's IAM role)."""
        return self.host.endswith(".amazonaws.com")


def s3_endpoint(endpoint: str | None, environ: Mapping[str, str] | None = None) -> S3Endpoint:
    """The endpoint of `checkpoint.endpoint`: `https://host` → TLS, `http://host` or a bare
    `host:port` → plain HTTP; None or "" → AWS S3. On AWS the region is the one
    AWS_REGION (else AWS_DEFAULT_REGION) in `environ` names; another store's region is left
    to the client (it asks the bucket), since AWS's variables are not about that store."""
    if not endpoint:
        where = S3Endpoint(AWS_S3_HOST, True)
    else:
        url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        where = S3Endpoint(url.netloc, url.scheme == "https")
    env = environ or {}
    region = next((env[name] for name in REGION_ENVS if env.get(name)), None)
    return S3Endpoint(where.host, where.secure, region) if where.is_aws else where


@dataclass(frozen=True)
class S3Credentials:
    """Static S3 credentials (all None: none; then the IAM role on AWS, else anonymous)."""

    access_key: str | None = None
    """Access key id."""
    secret_key: str | None = None
    """Secret access key."""
    session_token: str | None = None
    """A temporary session token (AWS STS), with the key pair it belongs to."""


def aws_credentials(environ: Mapping[str, str]) -> S3Credentials:
    """The key pair AWS's standard credential chain finds in `environ` and the files it
    names, for a job that names no credential Secret: the environment's
    (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), else the shared
    credentials file's profile; a pair needs both halves. None found: `S3Credentials()`,
    and the chain goes on to the IAM role (on AWS) or anonymous access.

    Only `environ` is read, `HOME` included, so a caller passing its own mapping gets no
    file of this machine's user by accident.
    """
    access, secret = environ.get(ACCESS_KEY_ENV), environ.get(SECRET_KEY_ENV)
    if access and secret:
        return S3Credentials(access, secret, environ.get(SESSION_TOKEN_ENV) or None)
    return _credentials_file(environ)


def _credentials_file(environ: Mapping[str, str]) -> S3Credentials:
    path = environ.get(CREDENTIALS_FILE_ENV) or (
        str(Path(environ["HOME"], ".aws", "credentials")) if environ.get("HOME") else None
    )
    if path is None:
        return S3Credentials()
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
        return S3Credentials()  # a file that does not parse holds none: the chain goes on
    profile = environ.get(PROFILE_ENV) or "default"
    access = parser.get(profile, "aws_access_key_id", fallback=None)
    secret = parser.get(profile, "aws_secret_access_key", fallback=None)
    if not (access and secret):
        return S3Credentials()
    token = parser.get(profile, "aws_session_token", fallback=None)
    return S3Credentials(access, secret, token or None)


__all__ = ["AWS_S3_HOST", "S3Credentials", "S3Endpoint", "aws_credentials", "s3_endpoint"]
