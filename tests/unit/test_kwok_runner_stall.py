"""The test kubelet's passes against an API server that stops answering: each read gives up
after the runner's request timeout and the next pass asks again, where a read with no timeout
would have stopped every pass (and every pod deletion's SIGTERM) for good."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from relaytrain_testkit.harness import kwok_runner
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = pytest.mark.unit


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers (an API server that hangs)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_pass_whose_read_gets_no_answer_is_retried_by_the_next(
    silent_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kwok_runner, "REQUEST_TIMEOUT", 0.1)
    api = client.ApiClient(client.Configuration(host=silent_server))
    runner = kwok_runner.KwokProcessRunner(api, tmp_path, "default")
    runner.start()
    try:
        wait_for(
            lambda: f"two passes to give up on their reads ({runner.stalls}, {runner.errors})",
            lambda: len(runner.stalls) >= 2,
        )
    finally:
        runner.stop()
    assert runner.errors == []
    assert runner.passes == 0
