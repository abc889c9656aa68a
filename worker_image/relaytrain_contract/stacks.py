"""`kill -USR1` on a stage or the operator writes every thread's stack to its stderr, and
the process goes on: where a stuck process waits.

Not `faulthandler.register(SIGUSR1, all_threads=True)`, which dumps from inside the C signal
handler, without the GIL: it walks the other threads' frames while they run, and a thread
starting or ending meanwhile can crash the process (CPython issue 116008; a stage lost to a
stack dump in our own test, 2026-11-29). Here a Python handler dumps them: Python runs it in
the main thread between two bytecodes, holding the GIL, so no thread changes under the walk.
The price: a main thread inside one long native call (a matmul) dumps once that call returns;
one waiting on a socket, a lock or a queue (where a stuck stage waits) dumps at once, since
the signal interrupts the wait."""

from __future__ import annotations

import faulthandler
import signal
import sys
from types import FrameType


def dump_stacks_on_sigusr1() -> None:
    """From now on SIGUSR1 writes every thread's stack to stderr (faulthandler's format,
    "Thread 0x... (most recent call first):" for each). Call it from the main thread."""

    def dump(_signum: int, _frame: FrameType | None) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    signal.signal(signal.SIGUSR1, dump)
