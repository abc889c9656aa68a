"""A store that is starting up: MinIO answers every request in the second or two between
its start and its storage being ready with 503 XMinioServerNotInitialized and
`Retry-After: 60`. A stage asks again at once and goes on; it does not sit out the minute
the server asks for (urllib3 obeys Retry-After by default, and a chaos schedule's reader
that did saw the job run to its end unseen).

The server here is a stub that speaks that much S3 on loopback: MinIO itself answers 503
only within a race of its start (tests/e2e/test_store_s3.py stops and starts a real one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from relaytrain_worker.state.store import S3Store

pytestmark = pytest.mark.unit

NOT_READY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>XMinioServerNotInitialized</Code>'
    b"<Message>Server not initialized yet, please try again.</Message></Error>"
)


class _Starting(BaseHTTPRequestHandler):
    """HEAD of the bucket: there. GET of an object: 503 with Retry-After 60 to the first
    `server.refusals` asks, then the object."""

    server: Any

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.server.asked.append(self.path)
        if len(self.server.asked) <= self.server.refusals:
            self.send_response(503)
            self.send_header("Retry-After", "60")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(NOT_READY)))
            self.end_headers()
            self.wfile.write(NOT_READY)
            return
        body = b'{"step": 7}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def starting() -> Iterator[Any]:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Starting)
    server.asked, server.refusals = [], 1
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every sleep asked for in this process, each taken as at most 10 ms: the minute a
    store asks for shows up here without being waited out."""
    asked: list[float] = []
    real = time.sleep

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        real(min(seconds, 0.01))

    monkeypatch.setattr(time, "sleep", sleep)
    return asked


def test_a_store_still_starting_is_asked_again_at_once_not_after_its_retry_after(
    starting: Any, slept: list[float]
) -> None:
    host, port = starting.server_address
    store = S3Store(
        f"{host}:{port}", "bucket", "ns/job", access_key="k", secret_key="s", region="us-east-1"
    )
    assert store.get("progress.json") == b'{"step": 7}'
    assert starting.asked == ["/bucket/ns/job/progress.json"] * 2
    assert max(slept, default=0.0) < 1.0, f"the store was waited for: sleeps {slept}"


def test_a_store_that_stays_starting_is_waited_for_by_the_stores_own_back_off(
    starting: Any, slept: list[float]
) -> None:
    """Still starting after the client's quick retries: the store's back-off (0.5 s,
    doubling, at most 10 s) waits for it, not the server's minute."""
    starting.refusals = 8
    host, port = starting.server_address
    store = S3Store(
        f"{host}:{port}", "bucket", "", access_key="k", secret_key="s", region="us-east-1"
    )
    assert store.get("progress.json") == b'{"step": 7}'
    assert len(starting.asked) == 9
    assert 0.5 in slept and max(slept) <= 10.0, slept
