"""The prefork server (relaytrain_worker.prefork) and its client (relaytrain_contract.prefork):
a process it forks runs as `python -m MODULE` would, with the argv, environment, working
folder and output asked for, in a session of its own; its exit status and signals are
Popen's; it dies with the server, and with the client that asked for it; a client attaches
to a server started apart only where that server's children would be its own.
`relaytrain run --local` starts every stage through it (tests/e2e/test_local_*.py train
through it, from a server their session shares)."""

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
    started = PreforkServer.start(_env(modules), qlora=False)
    try:
        yield started
    finally:
        started.stop()


def _env(modules: Path) -> dict[str, str]:
    """This environment, with the probe's folder first on the import path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(modules), *sys.path])}


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
    env = _env(modules)
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


# A supervisor of its own attached to the module's server: it asks for a sleeping probe,
# says its PID, and waits on it.
CLIENT = """
import os, sys
from relaytrain_contract.prefork import PreforkServer
server = PreforkServer.attach(sys.argv[1], os.environ, qlora=False)
with open(sys.argv[2], "wb") as out:
    proc = server.spawn(["-m", "probe_child", "sleep", "0"], os.environ, os.getcwd(),
                        stdout=out.fileno(), stderr=out.fileno())
print(proc.pid, flush=True)
proc.wait()
"""


def test_a_client_that_dies_takes_its_process_along_and_the_server_serves_on(
    server: PreforkServer, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": _server_pythonpath(server)}
    out = tmp_path / "probe.log"
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(server.socket_path), str(out)], env=env,
        cwd=tmp_path, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert client.stdout is not None
    probe = int(client.stdout.readline())
    assert _said(out)["argv"] == ["sleep", "0"] and _running(probe)
    client.kill()  # SIGKILL: the kernel closes its connection to the server
    client.wait()
    client.stdout.close()
    deadline = time.monotonic() + 30
    while _running(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(probe)
    # The server was not the one to go: it forks the next process asked for.
    proc, _ = _spawn(server, tmp_path, "exit", "0")
    assert proc.wait(timeout=30) == 0


def _server_pythonpath(server: PreforkServer) -> str:
    assert server.process is not None
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
    return next(e for e in environ if e.startswith(b"PYTHONPATH=")).decode()[len("PYTHONPATH=") :]


def test_a_server_started_apart_serves_only_a_client_whose_stages_it_would_run_as_theirs(
    server: PreforkServer, tmp_path: Path
) -> None:
    same = {**os.environ, "PYTHONPATH": _server_pythonpath(server)}
    attached = PreforkServer.attach(server.socket_path, same, qlora=False)
    proc, out = _spawn(attached, tmp_path, "exit", "4")
    assert proc.wait(timeout=30) == 4 and _said(out)["say"] == "hello"
    attached.stop()  # it was not ours to end: the server forks on
    assert _spawn(server, tmp_path, "exit", "0")[0].wait(timeout=30) == 0

    with pytest.raises(PreforkError, match=r"no prefork server answers at .*none\.sock"):
        PreforkServer.attach(tmp_path / "none.sock", same, qlora=False)
    with pytest.raises(PreforkError, match=r"imports from PYTHONPATH=.*, the stages from '/x'"):
        PreforkServer.attach(server.socket_path, {**same, "PYTHONPATH": "/x"}, qlora=False)
    with pytest.raises(PreforkError, match="started --without-bitsandbytes, which a QLoRA"):
        PreforkServer.attach(server.socket_path, same, qlora=True)
    # A client in a network namespace of its own (a run whose links a test cuts): the
    # server's children would not be in it.
    attach = (
        "import os, sys\nfrom relaytrain_contract.prefork import PreforkServer, PreforkError\n"
        "try:\n    PreforkServer.attach(sys.argv[1], os.environ, qlora=False)\n"
        "except PreforkError as err:\n    print(err)\n"
    )
    said = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c", attach,
         str(server.socket_path)],
        env=same, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "namespace, and the stages it forks would run in the server's" in said.stdout, said


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
