"""The prefork server (relaytrain_worker.prefork) and its client (relaytrain_contract.prefork):
a process it forks runs as `python -m MODULE` would, with the argv, environment, working
folder and output asked for, in a session of its own; its exit status and signals are
Popen's; it dies with the server. `relaytrain run --local` starts every stage through it
(tests/e2e/test_local_*.py train through it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from relaytrain_contract.prefork import ForkedProcess, PreforkError, PreforkServer

# The server imports torch, transformers and peft (in its own process): not the fast loop.
pytestmark = [pytest.mark.unit, pytest.mark.torch]

PROBE = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "say": os.environ.get("SAY"),
                  "leader": os.getpgid(0) == os.getpid(), "name": __name__}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreforkServer]:
    modules = tmp_path_factory.mktemp("modules")
    (modules / "probe_child.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(modules), *sys.path])}
    started = PreforkServer.start(env)
    try:
        yield started
    finally:
        started.stop()


def _spawn(server: PreforkServer, tmp_path: Path, *args: str) -> tuple[ForkedProcess, Path]:
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("wb") as o, err.open("wb") as e:
        proc = server.spawn(
            ["-m", "probe_child", *args], {**os.environ, "SAY": "hello"}, tmp_path,
            stdout=o.fileno(), stderr=e.fileno(),
        )  # fmt: skip
    return proc, out


def _said(out: Path) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while not out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return dict(json.loads(out.read_text().splitlines()[0]))


def test_a_forked_process_runs_the_module_as_python_m_would(
    server: PreforkServer, tmp_path: Path
) -> None:
    proc, out = _spawn(server, tmp_path, "exit", "3")
    assert proc.wait(timeout=30) == 3 and proc.returncode == 3 and proc.poll() == 3
    said = _said(out)
    assert said == {
        "argv": ["exit", "3"], "cwd": str(tmp_path), "say": "hello", "leader": True,
        "name": "__main__",
    }  # fmt: skip
    assert (tmp_path / "err.log").read_text() == "to stderr\n"
    # And a module that fails to start says why on its stderr, with Python's exit code.
    proc, _ = _spawn(server, tmp_path, "exit", "not-a-number")
    assert proc.wait(timeout=30) == 1
    assert "ValueError" in (tmp_path / "err.log").read_text()


def test_signals_reach_the_process_and_its_end_is_popens(
    server: PreforkServer, tmp_path: Path
) -> None:
    proc, out = _spawn(server, tmp_path, "sleep", "0")
    _said(out)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # its own group, as the supervisor signals it
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc, out = _spawn(server, tmp_path, "sleep", "0")
    _said(out)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # one that has ended: nothing to signal, no error


def test_what_the_server_runs_dies_with_it(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "probe_child.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(modules), *sys.path])}
    server = PreforkServer.start(env)
    try:
        stopped, out = _spawn(server, tmp_path, "sleep", "0")
        _said(out)
        server.stop()  # an orderly end: what it still runs is killed
        assert stopped.wait(timeout=30) == -signal.SIGKILL
    finally:
        server.stop()
    server = PreforkServer.start(env)
    try:
        orphan, out = _spawn(server, tmp_path, "sleep", "0")
        _said(out)
        server.process.kill()  # the server itself killed: the kernel kills its children
        deadline = time.monotonic() + 30
        while _running(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(orphan.pid)
        assert orphan.wait(timeout=5) == -signal.SIGKILL  # nobody is left to say otherwise
    finally:
        server.stop()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# A server whose imports initialised CUDA, as bitsandbytes' import does on a GPU host (here
# the check is made to say so: this machine has no GPU).
CUDA_TOUCHED = """
import sys, torch
torch.cuda.is_initialized = lambda: True
from relaytrain_worker.prefork import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_server_whose_imports_touched_the_gpu_forks_nothing(tmp_path: Path) -> None:
    (tmp_path / "cuda_touched.py").write_text(CUDA_TOUCHED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    log = tmp_path / "prefork.log"
    with log.open("wb") as own, pytest.raises(PreforkError, match=r"did not start \(exit 1\)"):
        PreforkServer.start(env, log=own, module="cuda_touched")
    assert "initialised CUDA" in log.read_text() and "none is forked" in log.read_text()
