"""Stage processes forked from a process that has imported the worker once (`relaytrain run
--local`; the server is `relaytrain_worker.prefork`).

A stage process spends most of its start importing torch, transformers and peft: about
5 CPU-seconds here, against well under a second to load a tiny model and link up. A run on
one machine starts a stage per (pipeline, stage) and again at every restart, rejoin and
growth, all on the cores the stages train on. The prefork server imports the worker once
and forks each stage from itself (the zygote pattern of Android and of Python's
`multiprocessing` forkserver; neither serves here: the stages are not Python functions of
the supervisor but programs with their own argv, environment, working folder and log).

This module is the client side and the wire protocol, standard library only (the
supervisor lives in the operator package, which never imports torch): `PreforkServer`
starts the server and asks it for processes; each is a `ForkedProcess`, which answers as
much of `subprocess.Popen` as the supervisor uses (pid, poll, wait, signals, returncode).

The protocol, over one Unix stream connection per process: the client sends one JSON line
(`argv`: `["-m", MODULE, ARG...]`, `env`, `cwd`, `new_session`) with the child's stdout
and stderr descriptors attached (SCM_RIGHTS); the server forks and answers `pid N`, and
once the child has ended and it has reaped it, `exit N` (Popen's returncode: negative for
a signal), then closes the connection. The client cannot reap a process that is not its
child, so its exit status is the server's to tell. A client that closes the connection
first (or dies) takes the process with it: the server kills it.

A server started apart can serve several runs (`SOCKET_ENV`, `PreforkServer.attach`): a
process forked from it lives in the server's namespaces, with the server's import path and
what the server imported, so a client attaches only where those are its stages' own.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

SERVER_MODULE = "relaytrain_worker.prefork"
READY = b"ready\n"
SOCKET_ENV = "RELAYTRAIN_PREFORK_SOCKET"
"""The socket of a prefork server already running (started apart, e.g. by a test session
for all its runs): `relaytrain run --local` forks its stages from it instead of starting
one, where `PreforkServer.attach` allows."""
NAMESPACES = ("mnt", "net", "pid", "user", "ipc", "uts", "cgroup")
"""A forked process's namespaces are its server's: a client in any other (a run in a
network namespace of its own) cannot use that server."""
WITHOUT_BITSANDBYTES = "--without-bitsandbytes"
"""The server's flag for a job that is not QLoRA: peft imports bitsandbytes whenever it is
installed (about a CPU-second), and only QLoRA's NF4 base uses it. The children cannot
import it either."""
START_SECONDS = 120.0
"""How long the server may take to import the worker and say it is ready."""


class PreforkError(RuntimeError):
    """The prefork server could not be started or did not answer."""


def request(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    new_session: bool,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """One spawn request's line (`extra`: fields for a server built on ours, its `setup`)."""
    body = {**(extra or {}), "argv": list(argv), "env": dict(env), "cwd": cwd,
            "new_session": new_session}  # fmt: skip
    return json.dumps(body).encode() + b"\n"


def read_line(conn: socket.socket, buffer: bytearray, timeout: float | None) -> bytes | None:
    """The next line from `conn` (None at EOF), reading into `buffer`; raises TimeoutError
    when none is complete within `timeout` seconds (None: wait)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in buffer:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([conn], [], [], left)
        if not ready:
            raise TimeoutError
        chunk = conn.recv(4096)
        if not chunk:
            return None
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def _import_path(pythonpath: str) -> list[str]:
    """What a PYTHONPATH puts on the import path: its folders in order, each once."""
    return list(dict.fromkeys(p for p in pythonpath.split(os.pathsep) if p))


class ForkedProcess:
    """A process the server forked for us: the parts of `subprocess.Popen` a supervisor
    uses. Signals go straight to the process (same user); its end comes from the server."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._conn: socket.socket | None = conn
        self._buffer = bytearray()
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()
        """One reader of the exit line at a time (a kubelet polls and waits from threads)."""

    def _read_exit(self, timeout: float | None) -> None:
        if self._conn is None:
            return
        line = read_line(self._conn, self._buffer, timeout)
        self._conn.close()
        self._conn = None
        if line is None or not line.startswith(b"exit "):
            # The server went away before telling: the process died with it (its parent's
            # death signal) or is beyond our reach; either way it is not ours to wait on.
            self.returncode = -signal.SIGKILL
            return
        self.returncode = int(line.split()[1])

    def poll(self) -> int | None:
        # As Popen's: while another thread waits, the answer is "still running".
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._read_exit(0)
            except TimeoutError:
                pass
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            try:
                self._read_exit(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            finally:
                self._lock.release()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreforkServer:
    """The server process, started by `start` (it imports the worker: seconds), and the
    processes it forks (`spawn`)."""

    def __init__(self, socket_path: Path, process: subprocess.Popen[bytes] | None) -> None:
        """`process`: the server, when we started it (None: one we attached to)."""
        self.socket_path = socket_path
        self.process = process

    @classmethod
    def start(
        cls,
        env: Mapping[str, str],
        preexec_fn: Callable[[], None] | None = None,
        log: IO[bytes] | None = None,
        *,
        qlora: bool = True,
        module: str = SERVER_MODULE,
    ) -> PreforkServer:
        """Start the server with `env` (the stages' environment: what the imports read,
        the thread count, is theirs), `preexec_fn` run in it before exec, and its own
        output to `log`; returns once it is ready. Raises PreforkError if it is not.
        `qlora`: whether the stages may need bitsandbytes (only QLoRA does). `module`: the
        server (one built on `relaytrain_worker.prefork`)."""
        folder = Path(tempfile.mkdtemp(prefix="relaytrain-prefork-"))
        path = folder / "server.sock"
        flags = [] if qlora else [WITHOUT_BITSANDBYTES]
        process = subprocess.Popen(
            [sys.executable, "-m", module, *flags, str(path)],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=log if log is not None else subprocess.DEVNULL,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - only prctl and getppid (die with us)
        )
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_SECONDS)
        line = process.stdout.readline() if ready else b""
        if line != READY:
            process.kill()
            process.wait()
            process.stdout.close()
            raise PreforkError(
                f"the prefork server ({module}) did not start"
                + (f" (exit {process.returncode})" if process.returncode is not None else "")
            )
        return cls(path, process)

    @classmethod
    def attach(
        cls, socket_path: str | os.PathLike[str], env: Mapping[str, str], *, qlora: bool
    ) -> PreforkServer:
        """The server already listening on `socket_path`, for stages whose environment is
        `env` (`qlora`: whether they need bitsandbytes). Raises PreforkError saying why when
        it cannot serve them: no server answers there, it runs in other namespaces than
        ours, it was started with another PYTHONPATH than `env`'s (its children import from
        the server's path), or without the bitsandbytes a QLoRA stage needs."""
        path = Path(socket_path)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(path))
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        except OSError as exc:
            raise PreforkError(f"no prefork server answers at {path}: {exc}") from exc
        finally:
            conn.close()  # the server reads an empty request and refuses it
        pid = int.from_bytes(creds[:4], sys.byteorder, signed=True)
        for name in NAMESPACES:
            try:
                same = os.readlink(f"/proc/{pid}/ns/{name}") == os.readlink(f"/proc/self/ns/{name}")
                why = "runs in another"
            except OSError as exc:  # from a user namespace of our own, say
                same, why = False, f"cannot be seen ({exc.strerror}) to run in this run's"
            if not same:
                raise PreforkError(
                    f"the prefork server at {path} {why} {name} namespace, and the stages it "
                    "forks would run in the server's"
                )
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError as exc:
            raise PreforkError(f"cannot read the prefork server at {path}: {exc}") from exc
        theirs = next((e[len(b"PYTHONPATH="):] for e in environ
                       if e.startswith(b"PYTHONPATH=")), b"").decode(errors="replace")  # fmt: skip
        if _import_path(theirs) != _import_path(env.get("PYTHONPATH", "")):
            raise PreforkError(
                f"the prefork server at {path} imports from PYTHONPATH={theirs!r}, the stages "
                f"from {env.get('PYTHONPATH', '')!r}"
            )
        if qlora and WITHOUT_BITSANDBYTES.encode() in cmdline:
            raise PreforkError(
                f"the prefork server at {path} was started {WITHOUT_BITSANDBYTES}, which a "
                "QLoRA job's stages import"
            )
        return cls(path, None)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        *,
        stdout: int,
        stderr: int,
        new_session: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> ForkedProcess:
        """Fork a process running `argv` (`["-m", MODULE, ARG...]`) with `env`, in `cwd`,
        its output to the descriptors `stdout` and `stderr`, in a session (and process
        group) of its own if `new_session`."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.socket_path))
            sent = request(argv, env, os.fspath(cwd), new_session, extra)
            socket.send_fds(conn, [sent], [stdout, stderr])
            buffer = bytearray()
            line = read_line(conn, buffer, START_SECONDS)
        except (OSError, TimeoutError) as exc:
            conn.close()
            raise PreforkError(f"the prefork server did not fork {list(argv)}: {exc}") from exc
        if line is None or not line.startswith(b"pid "):
            conn.close()
            raise PreforkError(f"the prefork server refused {list(argv)}: {line!r}")
        forked = ForkedProcess(conn, int(line.split()[1]), argv)
        forked._buffer = buffer  # anything after the pid line (an exit already) is kept
        return forked

    def stop(self) -> None:
        """End the server (it kills what it forked and is still running) and its socket;
        one we attached to is left running (what it forked for us ends as we hang up)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        with contextlib.suppress(OSError):
            self.socket_path.parent.rmdir()
