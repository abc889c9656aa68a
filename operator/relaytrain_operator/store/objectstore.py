"""Small reads from the job's object store (S3/MinIO) or a local directory, and one write.

The operator reads three things there: the base model's config.json (to plan), the
workers' progress.json (to report) and its own given-up.json; it writes given-up.json, the
pipelines it gave up, for the stages (names.GIVEN_UP_FILE). `relaytrain run --local` reads
progress.json and the loss history. All are tiny. Endpoints and credentials follow the
stage contract's rules (`relaytrain_contract.store`), as the worker's do: the job's
credential Secret when it names one (the operator reads it through `apply`), else AWS's
standard chain (`StoreAccess.from_environ`). One client is kept per endpoint (and replaced
when its credentials change), so a periodic read reuses its pooled connection instead of
building a client each time.
"""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from minio import Minio
from minio.credentials.providers import IamAwsProvider, Provider
from minio.error import S3Error
from relaytrain_contract import aws_credentials, s3_endpoint

JsonDict = dict[str, Any]


class StoreError(RuntimeError):
    """The store could not be read (not: the object does not exist)."""


@dataclass(frozen=True)
class StoreAccess:
    """How to reach a job's object store."""

    endpoint: str | None
    """`http(s)://host:port` of an S3 endpoint; None means AWS S3."""
    access_key: str | None = None
    """Access key id (None: see `iam_role`)."""
    secret_key: str | None = None
    """Secret access key."""
    session_token: str | None = None
    """A temporary session token (AWS STS), with the key pair it belongs to."""
    iam_role: bool = False
    """Without a key pair, on AWS S3: the IAM role of this pod or machine (IRSA web
    identity, ECS, EC2 instance metadata), where AWS's standard chain ends. False, or off
    AWS: anonymous access."""

    @classmethod
    def from_environ(
        cls, endpoint: str | None, environ: Mapping[str, str] = os.environ
    ) -> StoreAccess:
        """A job that names no credential Secret: AWS's standard credential chain, as its
        stages resolve it (`relaytrain_contract.aws_credentials`, then the IAM role)."""
        creds = aws_credentials(environ)
        return cls(endpoint, creds.access_key, creds.secret_key, creds.session_token, iam_role=True)


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` → ("bucket", "a/b")."""
    rest = uri.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


def join(prefix: str, *parts: str) -> str:
    """Join object-key parts with single slashes."""
    return "/".join(p.strip("/") for p in (prefix, *parts) if p.strip("/"))


_clients: dict[str | None, tuple[StoreAccess, Minio]] = {}
_clients_lock = threading.Lock()


def _client(access: StoreAccess) -> Minio:
    """The client of `access.endpoint`, built once per endpoint and credentials."""
    with _clients_lock:
        cached = _clients.get(access.endpoint)
        if cached is None or cached[0] != access:
            cached = (access, _new_client(access))
            _clients[access.endpoint] = cached
        return cached[1]


def _new_client(access: StoreAccess) -> Minio:
    endpoint = s3_endpoint(access.endpoint, os.environ)
    # Short timeouts and no retries: a status read must not stall a reconcile; the next
    # one tries again.
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=2.0, read=5.0), retries=urllib3.Retry(total=0)
    )
    role: Provider | None = None
    if access.access_key is None and access.iam_role and endpoint.is_aws:
        role = IamAwsProvider(http_client=http)  # the worker's S3Store does the same
    return Minio(
        endpoint.host,
        access_key=access.access_key,
        secret_key=access.secret_key,
        session_token=access.session_token,
        secure=endpoint.secure,
        region=endpoint.region,
        http_client=http,
        credentials=role,
    )


def read_object(uri: str, name: str, access: StoreAccess | None) -> bytes | None:
    """The bytes of `<uri>/<name>`, or None when it does not exist.

    `uri` is `s3://bucket/prefix`, `file:///dir` or a local directory.
    Raises StoreError when the store cannot be reached.
    """
    try:
        if uri.startswith("s3://"):
            bucket, prefix = split_s3(uri)
            response = _client(access or StoreAccess(None)).get_object(bucket, join(prefix, name))
            try:
                return bytes(response.read())
            finally:
                response.close()
                response.release_conn()
        path = Path(uri.removeprefix("file://")) / name
        return path.read_bytes() if path.is_file() else None
    except S3Error as exc:
        if exc.code in ("NoSuchKey", "NoSuchBucket"):
            return None
        raise StoreError(f"reading {name} under {uri}: {exc.code}: {exc.message}") from exc
    except (OSError, urllib3.exceptions.HTTPError, ValueError) as exc:
        raise StoreError(f"reading {name} under {uri}: {exc}") from exc


def object_size(uri: str, access: StoreAccess | None) -> int | None:
    """The size in bytes of the object `s3://bucket/key` itself, or None when there is no
    such object (or bucket). Raises StoreError when the store cannot be reached or refuses."""
    bucket, key = split_s3(uri)
    try:
        return int(_client(access or StoreAccess(None)).stat_object(bucket, key).size or 0)
    except S3Error as exc:
        if exc.code in ("NoSuchKey", "NoSuchBucket", "NoSuchObject", "ResponseCode"):
            return None
        raise StoreError(f"reading {uri}: {exc.code}: {exc.message}") from exc
    except (urllib3.exceptions.HTTPError, ValueError) as exc:
        raise StoreError(f"reading {uri}: {exc}") from exc


REFUSALS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
            "ExpiredToken", "AllAccessDisabled")  # fmt: skip
"""S3 error codes with which a store refuses the keys it was given."""


def store_refusal(uri: str, access: StoreAccess | None) -> str | None:
    """`code: message` when the store refuses `access` for the bucket of `uri`; None when
    it takes them (a bucket that does not exist yet is fine: the stages create it) or
    cannot be reached (no verdict)."""
    bucket, _ = split_s3(uri)
    try:
        _client(access or StoreAccess(None)).bucket_exists(bucket)
    except S3Error as exc:
        return f"{exc.code}: {exc.message}" if exc.code in REFUSALS else None
    except (urllib3.exceptions.HTTPError, ValueError):
        return None
    return None


def write_json(uri: str, name: str, value: JsonDict, access: StoreAccess | None) -> None:
    """Write `value` as `<uri>/<name>` (`uri` as for `read_object`); StoreError when the
    store cannot be reached or refuses."""
    data = json.dumps(value, sort_keys=True).encode()
    try:
        if uri.startswith("s3://"):
            bucket, prefix = split_s3(uri)
            _client(access or StoreAccess(None)).put_object(
                bucket, join(prefix, name), io.BytesIO(data), len(data),
                content_type="application/json",
            )  # fmt: skip
            return
        path = Path(uri.removeprefix("file://")) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except S3Error as exc:
        raise StoreError(f"writing {name} under {uri}: {exc.code}: {exc.message}") from exc
    except (OSError, urllib3.exceptions.HTTPError, ValueError) as exc:
        raise StoreError(f"writing {name} under {uri}: {exc}") from exc


def read_json(uri: str, name: str, access: StoreAccess | None) -> JsonDict | None:
    """The JSON object `<uri>/<name>`, or None when it does not exist.

    Raises StoreError when the store cannot be reached or the object is not a JSON object.
    """
    data = read_object(uri, name, access)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise StoreError(f"reading {name} under {uri}: {exc}") from exc
    if not isinstance(value, dict):
        raise StoreError(f"{name} under {uri} is not a JSON object")
    return value
