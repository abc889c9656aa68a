"""Process state as /proc tells it, for tests that watch processes they did not start, and
stopping the ones they did."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is not a zombie (ended, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def held(pid: int) -> Iterator[None]:
    """Process `pid` stopped (SIGSTOP) for the block and continued (SIGCONT) after it,
    whatever happens in it; a process gone meanwhile (killed and reaped) is left alone."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def stop(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """SIGTERM to `proc` if it still runs, SIGKILL after `grace` seconds, and reap it (its
    pipes drained, so a chatty process cannot block on a full one)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
