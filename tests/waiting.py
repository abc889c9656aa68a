"""Polling for what a cluster or a process will do soon, with a message that says what."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.25
) -> Any:
    """Calls `probe` until it returns something truthy, and returns that; fails after `timeout`
    seconds with `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
