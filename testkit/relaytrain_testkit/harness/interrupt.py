"""An interrupted test session stops what it started (a pytest plugin, tests/conftest.py).

pytest runs the session's finalizers — the local cluster's `hack/cluster.sh down`, MinIO's
stop, the operator and stage processes — when the session ends, failures and Ctrl-C
included. A SIGTERM (`timeout` around `make test`, CI's stop) or a SIGHUP (the terminal
closed) would kill the process without them, leaving daemonised clusters and servers behind.
Here both become a KeyboardInterrupt in the main thread, so the session ends as after Ctrl-C:
pytest reports what ran and tears down every fixture. A second signal during that teardown
is ignored, so the teardown finishes.
"""

from __future__ import annotations

import signal
from types import FrameType

import pytest


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}: the test session stops")


def pytest_sessionstart(session: pytest.Session) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
