"""A stage asked to stop (SIGTERM: its pod deleted) ends within a bound, whatever its main
thread is doing.

The worker's SIGTERM handler is Python's: it runs in the main thread between two bytecodes
and raises KeyboardInterrupt there (or, for a stage of several pipelines, asks it to leave at
its next step boundary). That is the clean stop, and almost always what happens. But a
handler that never runs, or an exception lost on its way up (raised where C code clears
errors, or caught by a library's catch-all), leaves the stage training until the kubelet's
SIGKILL 30 s later — and meanwhile it commits checkpoints for a plan the operator has
replaced, so that the replacement's pipelines lose every write and restore the stale stage's
commits, again and again (the auto-growth e2e test, CI of 2026-11-30: a pipeline of one
stage, deleted to restart as two pipelines, trained on for its whole 30 s).

So the signal is also watched from a thread of its own: Python's C-level handler writes the
signal's number to a wakeup file descriptor (`signal.set_wakeup_fd`) as the signal arrives,
in whatever thread, before any Python code runs. The watcher reads it and gives the main
thread `STOP_SECONDS` to end the process (plus the wait for a step boundary, when the stage
chose to leave at one). A stage still running then writes every thread's stack to its log —
where its main thread was — and ends with the code of a stop (130), as the clean path would.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

from relaytrain_contract.exits import StageExit

log = logging.getLogger("relaytrain.stage")

LEAVE_WAIT_SECONDS = 10.0
"""How long a stage asked to stop trains on, waiting for its stage 0 to lead the pipeline
out (the operator removes the rest of a pipeline within a pass of seeing one of its pods go
from a node that announced its end); well inside a pod's 30 s grace period
(replicas/membership.py, `Replicated.depart`)."""
STOP_SECONDS = 10.0
"""How long a stage may still run after a SIGTERM that stops it at once: the clean path
(links closed, the metrics server stopped) takes well under a second. Well within a pod's
grace period (30 s), even after the `LEAVE_WAIT_SECONDS` of a stage leaving at a step
boundary."""


def watch_sigterm(name: str, leaving: Callable[[], bool]) -> None:
    """From now on, a SIGTERM that has not ended the process `STOP_SECONDS` later (or
    `LEAVE_WAIT_SECONDS` more, when `leaving()` says the stage chose to leave at its next
    step boundary) ends it (`StageExit.STOPPED`), its threads' stacks in its log. A second SIGTERM
    leaves it `STOP_SECONDS` from then at most. Call it from the main thread, once a Python
    handler for SIGTERM is installed (the wakeup descriptor is written only for signals with
    one)."""
    read, write = os.pipe()
    os.set_blocking(write, False)  # the C handler must never block on a full pipe
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(
        target=_watch, args=(read, name, leaving), name="sigterm-watch",
        daemon=True,
    ).start()  # fmt: skip


def _watch(read: int, name: str, leaving: Callable[[], bool]) -> None:
    asked: float | None = None
    deadline = float("inf")
    extended = False
    while True:
        wait = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read], [], [], wait)
        if ready:
            times = os.read(read, 64).count(signal.SIGTERM)  # a byte per signal handled
            if not times:  # another handled signal (SIGUSR1)
                continue
            now = time.monotonic()
            if asked is None:
                asked, times = now, times - 1
                log.info("Stage %s received SIGTERM", name)
            if times:  # a second one stops the stage at once: no wait for a step boundary
                extended = True
            deadline = min(deadline, now + STOP_SECONDS)
            continue
        if asked is None:
            continue
        if not extended and leaving():  # leaving at its step boundary: that wait too
            extended = True
            deadline += LEAVE_WAIT_SECONDS
            continue
        log.error(
            "Stage %s is still running %.0f s after SIGTERM: it ends now, without waiting "
            "for its main thread; each thread's stack follows", name, time.monotonic() - asked,
        )  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(StageExit.STOPPED)
