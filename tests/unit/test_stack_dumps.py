"""`kill -USR1` on a stage or the operator (relaytrain_contract.stacks) writes every thread's
stack and the process goes on, even while threads start and end: a process churning
threads took thousands of SIGUSR1 without dying, where `faulthandler.register`'s dump from
the C signal handler crashed this machine's Python within a few thousand (CPython issue
116008)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CHURN = """
import sys, threading
from relaytrain_contract.stacks import dump_stacks_on_sigusr1

dump_stacks_on_sigusr1()

def deep(n):
    return deep(n - 1) if n else sum(range(50))

def churn():
    while True:
        threads = [threading.Thread(target=deep, args=(30,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

for _ in range(3):
    threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
while sys.stdin.readline():  # until the test closes stdin
    pass
"""


def test_stack_dumps_on_sigusr1_leave_a_process_churning_threads_alive(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with log.open("w") as err, subprocess.Popen(
        [sys.executable, "-c", CHURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=err, env=env, text=True,
    ) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        for _ in range(6000):
            os.kill(proc.pid, signal.SIGUSR1)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.stdin.close()  # it exits
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]
    dumps = log.read_text()
    # Each dump names every thread, the main thread's (in `readline`) among them.
    assert dumps.count("Current thread 0x") >= 1, dumps[-3000:]
    assert "(most recent call first)" in dumps and 'File "<string>"' in dumps, dumps[-3000:]
