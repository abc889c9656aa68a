"""Waiting on what a cluster, a process or a thread will do soon, with a message that says
what. A test that means "nothing happened" waits until something that would have shown it
did happen (another periodic pass, a retry, a thread blocking), then looks: a sleep of a
guessed length proves nothing when the machine is slow."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str | Callable[[], str],
    probe: Callable[[], Any],
    timeout: float = 60.0,
    interval: float = 0.25,
) -> Any:
    """Calls `probe` until it returns something truthy, and returns that; fails after `timeout`
    seconds with `what` (or what `what()` says then: the state that explains the wait) and the
    last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(_timed_out(what if isinstance(what, str) else what(), timeout, last))


async def wait_for_async(
    what: str, probe: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01
) -> Any:
    """`wait_for` inside an event loop: the loop runs other tasks between probes."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(_timed_out(what, timeout, last))


def running(thread: threading.Thread, function: str) -> bool:
    """Whether `thread` is inside a call of `function` now, a qualified name as Python
    writes it (`socket.accept`, `Link._wait_readable`): a frame of it is on the thread's
    stack. Name the call that blocks, to know the thread waits there."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_qualname == function:
            return True
        frame = frame.f_back
    return False


def _timed_out(what: str, timeout: float, last: Any) -> str:
    return f"timed out after {timeout:g}s waiting for {what}; last: {last!r}"
