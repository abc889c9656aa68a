"""Small JSON reads from the job's object store (S3/MinIO) or a local directory.

The operator reads two things there: the base model's config.json (to plan) and the
workers' progress.json (to report). Both are tiny; both use the job's own endpoint and
credential Secret (spec.checkpoint), which the operator reads through `apply`. One client
is kept per endpoint (and replaced when its credentials change), so a periodic read reuses
its pooled connection instead of building a client each time.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from minio import Minio
from minio.error import S3Error
from relaytrain_contract import s3_endpoint

JsonDict = dict[str, Any]


class StoreError(RuntimeError):
    """The store could not be read (not: the object does not exist)."""


@dataclass(frozen=True)
class StoreAccess:
    """How to reach a job's object store."""

    endpoint: str | None
    """`http(s)://host:port` of an S3 endpoint; None means AWS S3."""
    access_key: str | None = None
    """Access key id (None: anonymous)."""
    secret_key: str | None = None
    """Secret access key."""


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
    return Minio(
        endpoint.host,
        access_key=access.access_key,
        secret_key=access.secret_key,
        secure=endpoint.secure,
        region=endpoint.region,
        http_client=http,
    )


def read_json(uri: str, name: str, access: StoreAccess | None) -> JsonDict | None:
    """The JSON object `<uri>/<name>`, or None when it does not exist.

    `uri` is `s3://bucket/prefix`, `file:///dir` or a local directory.
    Raises StoreError when the store cannot be reached or the object is not JSON.
    """
    try:
        if uri.startswith("s3://"):
            bucket, prefix = split_s3(uri)
            response = _client(access or StoreAccess(None)).get_object(bucket, join(prefix, name))
            try:
                data = response.read()
            finally:
                response.close()
                response.release_conn()
        else:
            path = Path(uri.removeprefix("file://")) / name
            if not path.is_file():
                return None
            data = path.read_bytes()
        value = json.loads(data)
    except S3Error as exc:
        if exc.code in ("NoSuchKey", "NoSuchBucket"):
            return None
        raise StoreError(f"reading {name} under {uri}: {exc.code}: {exc.message}") from exc
    except (OSError, urllib3.exceptions.HTTPError, ValueError) as exc:
        raise StoreError(f"reading {name} under {uri}: {exc}") from exc
    if not isinstance(value, dict):
        raise StoreError(f"{name} under {uri} is not a JSON object")
    return value
