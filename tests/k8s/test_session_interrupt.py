"""An interrupted test session leaves nothing behind (issue 22 item 5).

A `make test` stopped by SIGTERM (`timeout` around it, or CI's stop) used to leave its
daemonised kwok cluster and servers running for hours. This starts a real pytest session
that brings up its own local cluster and MinIO through the same session fixtures every test
uses, sends it SIGTERM (and, in the second case, SIGHUP) once both are up, and checks that
the session ended as interrupted and that no process of that cluster or that MinIO is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from relaytrain_testkit import REPO
from relaytrain_testkit.harness.procs import alive
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

CHILD = """
import os
import threading
from pathlib import Path


def test_holds_a_cluster_and_a_store(kube_cluster, minio_server):
    ready = Path(os.environ["RT_READY"])
    partial = ready.with_name(ready.name + ".partial")
    partial.write_text(f"{kube_cluster.workdir}\\n{minio_server.data_dir}")
    partial.replace(ready)  # whole or absent: the waiting session never reads half of it
    threading.Event().wait(900)
"""

PYTEST_INTERRUPTED = 2


def _pids_naming(marker: str) -> set[int]:
    """The live processes whose command line names `marker` (a folder only they use)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            found.add(int(entry.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if alive(pid)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signalled_session_stops_its_cluster_and_servers(tmp_path, sig):
    (tmp_path / "test_hold.py").write_text(CHILD)
    ready = tmp_path / "ready"
    log = tmp_path / "session.log"
    paths = [REPO / "testkit", REPO / "operator", REPO / "worker_image", REPO]
    env = {**os.environ, "RT_READY": str(ready), "PYTHONPATH": os.pathsep.join(map(str, paths))}
    plugins = ["interrupt", "cluster", "minio_fixture"]
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s"]
    for plugin in plugins:
        argv += ["-p", f"relaytrain_testkit.harness.{plugin}"]
    argv += ["--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml")]
    argv += ["--basetemp", str(tmp_path / "base"), str(tmp_path / "test_hold.py")]
    with log.open("wb") as out:
        session = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(
                "the child session's cluster and MinIO up",
                lambda: ready.exists() or session.poll() is not None,
                timeout=300,
            )
            assert ready.exists(), log.read_text()
            workdir, data_dir = ready.read_text().splitlines()
            started = _pids_naming(workdir) | _pids_naming(data_dir)
            assert len(_pids_naming(workdir)) >= 4, "etcd, apiserver, controller manager, scheduler"
            assert _pids_naming(data_dir), "MinIO"
            session.send_signal(sig)
            code = session.wait(timeout=240)
        finally:
            if session.poll() is None:
                session.kill()
    left = _alive(started | _pids_naming(workdir) | _pids_naming(data_dir))
    for pid in left:  # a failing run must not leave them behind either
        os.kill(pid, signal.SIGKILL)
    output = log.read_text()
    assert code == PYTEST_INTERRUPTED, output
    assert "KeyboardInterrupt" in output, output
    assert left == set(), f"left running: {sorted(left)}\n{output}"
