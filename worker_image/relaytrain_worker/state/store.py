"""Object stores for checkpoints, progress and outputs: a local directory or S3 (AWS, MinIO).

Keys are ``/``-separated relative paths (``ns/job/step-20/stage-1/adapter.safetensors``).
Every ``put`` is atomic: a reader sees the old object, or the new one, never half of one.
That is what lets the checkpoint manifest, written last, act as the commit.

An S3 store that does not answer — connections refused or reset, timeouts, 5xx, MinIO still
starting — is waited for: each operation is retried with back-off for up to
`RETRY_SECONDS` (a store restarting stalls the job; it does not fail its stages). Answers
that will not change (no such key, access denied, bad credentials) fail at once. The
server's Retry-After is not obeyed (`http_client`): MinIO asks 60 s of every client that
meets it starting up, where it is ready a second or two later.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlparse

from relaytrain_contract import (
    CheckpointSpec,
    S3Credentials,
    S3Endpoint,
    aws_credentials,
    s3_endpoint,
)

log = logging.getLogger("relaytrain.store")

RETRY_SECONDS = 300.0
"""How long an operation on an S3 store that does not answer is retried before it fails."""
_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
    "XMinioServerNotInitialized", "XMinioReadQuorum", "XMinioWriteQuorum",
}  # fmt: skip
"""S3 error codes that a later try can succeed past."""

T = TypeVar("T")


def transient(e: BaseException) -> bool:
    """Whether a store error can pass by itself: the store unreachable, restarting or
    overloaded, not an answer (no such key, access denied) that a retry would repeat."""
    try:
        from minio.error import S3Error, ServerError
        from urllib3.exceptions import HTTPError
    except ImportError:  # no S3 client here (a host with only a local store): no S3 error
        return isinstance(e, ConnectionError | TimeoutError)

    if isinstance(e, S3Error):
        return e.code in _TRANSIENT_CODES
    return isinstance(e, ServerError | HTTPError | ConnectionError | TimeoutError)


_REFUSAL_CODES = {
    "AccessDenied": "access denied",
    "InvalidAccessKeyId": "the access key is not known to the store",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "InvalidToken": "the session token is not valid",
    "ExpiredToken": "the session token has expired",
    "NoSuchBucket": "no such bucket",
    "AllAccessDisabled": "all access to the bucket is disabled",
}
"""S3 error codes that answer for the credentials or the bucket: a retry gets the same."""


def refusal(e: BaseException) -> str | None:
    """One line on why the store refused (bad keys, access denied, no such bucket), naming
    the store, bucket and object; None when `e` (or the error it wraps) is no such answer."""
    try:
        from minio.error import S3Error
    except ImportError:  # no S3 client here, so `e` is no S3 answer: the error stands as it is
        return None

    seen: BaseException | None = e
    while seen is not None and not isinstance(seen, S3Error):
        seen = seen.__cause__
    if not isinstance(seen, S3Error) or seen.code not in _REFUSAL_CODES:
        return None
    where = f"s3://{seen.bucket_name or ''}/{seen.object_name or ''}".rstrip("/")
    return (
        f"the object store refused {where} ({seen.code}: {_REFUSAL_CODES[seen.code]}); check "
        "spec.checkpoint.credentialsSecret (its keys) and the bucket in the job's URIs"
    )


class StoreError(Exception):
    """A store operation failed (the message names the store and key)."""


class ObjectNotFound(StoreError, KeyError):  # noqa: N818 - reads like KeyError
    """``get`` of a key that does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@runtime_checkable
class Store(Protocol):
    """What checkpoints and progress need from a store."""

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically (replacing any previous object)."""

    def get(self, key: str) -> bytes:
        """Read ``key``; ObjectNotFound if it does not exist."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (recursively), sorted."""

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is fine."""


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}: use a relative a/b/c path")
    return key


class LocalStore:
    """A directory on the local filesystem; atomic writes via a temp file + os.replace."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        """Created by the first `put` (opening a store touches nothing)."""

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{key} not found in {self.root}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        prefix = prefix.lstrip("/")
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if name.startswith(".") and name.endswith(".tmp"):
                    continue  # an in-flight atomic write
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Drop now-empty directories up to the root so pruned steps leave nothing behind.
        for parent in path.parents:
            if parent == self.root or not parent.is_relative_to(self.root):
                break
            try:
                parent.rmdir()
            except OSError:
                break


def job_credentials(
    checkpoint: CheckpointSpec, environ: Mapping[str, str] = os.environ
) -> S3Credentials:
    """The credentials a stage document points at.

    With `accessKeyEnv`/`secretKeyEnv` named (a credential Secret in a pod), the key pair in
    those variables. With none named, AWS's standard credential chain as the stage contract
    resolves it (`relaytrain_contract.aws_credentials`: the environment's key pair, else the
    shared credentials file's; none: on AWS the IAM role, see `S3Store`, else anonymous).
    """
    if checkpoint.access_key_env is not None and checkpoint.secret_key_env is not None:
        return S3Credentials(
            environ.get(checkpoint.access_key_env) or None,
            environ.get(checkpoint.secret_key_env) or None,
        )
    return aws_credentials(environ)


def http_client() -> Any:
    """The minio client's connection pool as it makes it by default (five-minute timeouts,
    ten connections, the CA bundle of SSL_CERT_FILE or certifi's, five quick retries of a
    5xx), but deaf to the server's Retry-After. MinIO answers every request in the second or
    two between its start and its storage being ready with 503 XMinioServerNotInitialized
    and `Retry-After: 60`, which urllib3 obeys: a stage that met a restarted store there sat
    out a minute after the store was back (the chaos schedule's reader did, and the job ran
    to its end unseen). `S3Store._retrying` backs off on its own, by at most 10 s."""
    import certifi
    import urllib3

    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=300.0, read=300.0),
        maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(
            total=5,
            backoff_factor=0.2,
            status_forcelist=[500, 502, 503, 504],
            respect_retry_after_header=False,
        ),
    )


class S3Store:
    """A bucket/prefix on S3 or MinIO through the minio client (which does multipart)."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        prefix: str = "",
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        secure: bool = False,
        session_token: str | None = None,
        region: str | None = None,
    ) -> None:
        from minio import Minio

        self.endpoint = endpoint
        self.secure = secure
        self.region = region
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.credentials = S3Credentials(access_key, secret_key, session_token)
        kwargs: dict[str, Any] = {}
        if access_key is None and S3Endpoint(endpoint, secure).is_aws:
            # AWS S3 and no key pair (none in the environment or the credentials file):
            # the pod's IAM role (IRSA web identity, ECS or EC2 instance metadata), where
            # AWS's standard chain ends (relaytrain_contract.store); the operator's reads
            # end there too (relaytrain_operator.store.objectstore).
            from minio.credentials.providers import IamAwsProvider

            kwargs["credentials"] = IamAwsProvider()
        self._client = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            secure=secure,
            region=region,
            http_client=http_client(),
            **kwargs,
        )
        self.retry_seconds = RETRY_SECONDS

        def open_bucket() -> None:
            if not self._client.bucket_exists(bucket):
                self._client.make_bucket(bucket)

        try:
            self._retrying("open the bucket", open_bucket)
        except Exception as e:
            if _s3_code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise StoreError(f"cannot open bucket {bucket!r} at {endpoint}: {e}") from e

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, retried with back-off while the store does not answer (`transient`),
        for up to `retry_seconds`; any other error at once."""
        deadline = time.monotonic() + self.retry_seconds
        delay, since = 0.5, None
        while True:
            try:
                result = call()
            except Exception as e:
                if not transient(e) or time.monotonic() + delay > deadline:
                    raise
                if since is None:
                    since = time.monotonic()
                    log.warning("The store at %s did not answer (%s: %s); retrying for up to "
                                "%.0f s", self.endpoint, what, e, self.retry_seconds)  # fmt: skip
                time.sleep(delay)
                delay = min(2 * delay, 10.0)
                continue
            if since is not None:
                log.info("The store at %s answered again after %.1f s (%s)",
                         self.endpoint, time.monotonic() - since, what)  # fmt: skip
            return result

    def __repr__(self) -> str:
        return f"S3Store({self.endpoint!r}, {self.bucket!r}, {self.prefix!r})"

    def _name(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        name = self._name(key)
        self._retrying(
            f"put {key}",
            lambda: self._client.put_object(self.bucket, name, io.BytesIO(data), len(data)),
        )

    def get(self, key: str) -> bytes:
        name = self._name(key)

        def get() -> bytes:
            response = None
            try:
                response = self._client.get_object(self.bucket, name)
                return bytes(response.read())
            except Exception as e:
                if _s3_code(e) in ("NoSuchKey", "NoSuchObject"):
                    raise ObjectNotFound(
                        f"{key} not found in s3://{self.bucket}/{self.prefix}"
                    ) from None
                raise
            finally:
                if response is not None:
                    response.close()
                    response.release_conn()

        return self._retrying(f"get {key}", get)

    def exists(self, key: str) -> bool:
        name = self._name(key)

        def exists() -> bool:
            try:
                self._client.stat_object(self.bucket, name)
            except Exception as e:
                if _s3_code(e) in ("NoSuchKey", "NoSuchObject", "ResponseCode"):
                    return False
                raise
            return True

        return self._retrying(f"stat {key}", exists)

    def list(self, prefix: str) -> list[str]:
        # A raw prefix, not a key: "ns/job/step-" must match "ns/job/step-20/...".
        full = f"{self.prefix}/{prefix.lstrip('/')}" if self.prefix else prefix.lstrip("/")
        strip = len(self.prefix) + 1 if self.prefix else 0

        def names() -> list[str]:
            found = self._client.list_objects(self.bucket, prefix=full, recursive=True)
            return sorted(o.object_name[strip:] for o in found if o.object_name is not None)

        return self._retrying(f"list {prefix}", names)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._retrying(f"delete {key}", lambda: self._client.remove_object(self.bucket, name))


def _s3_code(e: Exception) -> str:
    return str(getattr(e, "code", ""))


def open_store(
    uri: str,
    endpoint: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    *,
    session_token: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Store:
    """Open ``s3://bucket/prefix`` or a local path.

    ``file://`` URIs and plain paths give a LocalStore. An s3:// URI is served by
    ``endpoint`` (``https://`` over TLS, ``http://`` or no scheme over plain HTTP), or, with
    no endpoint, by AWS S3 in the region ``environ`` names (`relaytrain_contract.s3_endpoint`).
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{uri!r} names no bucket; use s3://bucket/prefix")
        ep = s3_endpoint(endpoint, environ)
        return S3Store(
            ep.host,
            parsed.netloc,
            parsed.path.strip("/"),
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            secure=ep.secure,
            region=ep.region,
        )
    if parsed.scheme == "file":
        return LocalStore(parsed.path)
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # plain path (or a Windows drive)
        return LocalStore(uri)
    raise ValueError(f"unsupported store URI {uri!r}; use s3://bucket/prefix or a local path")


def open_job_store(
    uri: str, checkpoint: CheckpointSpec, environ: Mapping[str, str] = os.environ
) -> Store:
    """The store of ``uri`` (checkpoint, model, dataset or output) as a stage document
    says to reach it: ``checkpoint.endpoint`` (null: AWS S3) and `job_credentials`."""
    creds = job_credentials(checkpoint, environ)
    return open_store(
        uri,
        checkpoint.endpoint,
        creds.access_key,
        creds.secret_key,
        session_token=creds.session_token,
        environ=environ,
    )
