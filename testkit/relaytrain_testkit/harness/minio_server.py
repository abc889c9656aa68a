"""A real MinIO server on loopback, built from github.com/minio/minio by the bootstrap.

Started with a data folder and generated credentials; used by the test session's
`minio_server` fixture (harness/minio_fixture.py) and by `make demo`.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack import toolpaths
from relaytrain_testkit.harness import procs
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.waiting import wait_for


@dataclass
class MinioServer:
    endpoint: str  # host:port, no scheme
    access_key: str
    secret_key: str
    bucket: str
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def client(self, timeout: float | None = None) -> Any:
        """A client of the server, with the connection pool a stage's store uses (minio's
        default, deaf to the Retry-After: 60 that MinIO answers while it starts:
        relaytrain_worker.state.store.http_client); `timeout`: seconds a request may take to
        connect or to answer, and no retry of its own, for a reader that polls on, whose one
        stuck request must not hold it up."""
        import urllib3
        from minio import Minio
        from relaytrain_worker.state.store import http_client

        http = (
            http_client()
            if timeout is None
            else urllib3.PoolManager(
                timeout=urllib3.Timeout(connect=timeout, read=timeout), retries=False
            )
        )
        return Minio(
            self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
            http_client=http,
        )


def start_minio(
    data_dir: Path, log_path: Path, *, again: MinioServer | None = None
) -> tuple[subprocess.Popen[bytes], MinioServer]:
    """Starts the server and waits until its storage is ready (its cluster health check).
    `again`: a server stopped before, started again at its address with its keys (an
    outage's end)."""
    port, console = free_port(), free_port()
    access, secret = "rt" + secrets.token_hex(6), secrets.token_hex(20)
    if again is not None:
        port = int(again.endpoint.rsplit(":", 1)[1])
        access, secret = again.access_key, again.secret_key
    env = {
        **os.environ,
        "MINIO_ROOT_USER": access,
        "MINIO_ROOT_PASSWORD": secret,
        "MINIO_BROWSER": "off",
        "MINIO_UPDATE": "off",
    }
    # The server keeps its own copy of the log's file descriptor; ours closes at once.
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                str(toolpaths.binary("minio")),
                "server",
                str(data_dir),
                "--address",
                f"127.0.0.1:{port}",
                "--console-address",
                f"127.0.0.1:{console}",
                "--quiet",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    bucket = again.bucket if again is not None else "relaytrain-test"
    server = MinioServer(f"127.0.0.1:{port}", access, secret, bucket, data_dir)

    def healthy() -> bool:
        # The cluster check, not the liveness one: MinIO is live a second or two before its
        # storage is ready, and answers S3 requests meanwhile with 503 (and Retry-After: 60).
        if proc.poll() is not None:
            raise RuntimeError(f"minio exited with {proc.returncode}; log: {log_path}")
        try:
            with urllib.request.urlopen(f"{server.url}/minio/health/cluster", timeout=2):
                return True
        except OSError:
            return False

    try:
        wait_for(f"minio to answer its cluster health check (log: {log_path})", healthy,
                 interval=0.2)  # fmt: skip
    except AssertionError:
        proc.kill()
        raise
    return proc, server


def stop_minio(proc: subprocess.Popen[bytes]) -> None:
    procs.stop(proc, grace=20)
