"""Where an `s3://` URI of a job is served from: the endpoint rule of the stage contract.

`checkpoint.endpoint` names an S3 endpoint (MinIO, another S3-compatible store) or is
null, which means AWS S3 itself: its global endpoint, over TLS, in the region that AWS's
standard environment names. Every reader of a job's store (the worker, the operator,
`relaytrain run --local`) resolves an endpoint here, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from relaytrain_contract.names import REGION_ENVS

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


__all__ = ["AWS_S3_HOST", "S3Endpoint", "s3_endpoint"]
