"""`python -m relaytrain_worker.prefork SOCKET`: import the worker once, then fork each stage
process asked for (relaytrain_contract/prefork.py has the why, the client and the protocol).

The server imports what every stage imports (torch, transformers, peft, the worker's
runtime) and nothing more: it runs no tensor operation, starts no thread and touches no
GPU, so a forked child starts from a clean state — its OpenMP pool, CUDA context and
threads are made by the child, on first use, as in a process of its own. It then serves
one request at a time on `SOCKET`, a Unix socket only this user can reach, watching each
child through a pidfd and reaping it to report its exit.

A child, between fork and the module it runs: its own session if asked (the supervisor
signals the group), the kernel's SIGKILL if the server dies (which itself dies with the
supervisor), the given stdout and stderr, working folder and environment, default signal
dispositions, and `sys.argv` as `python -m MODULE ARG...` would have it.

A client that hangs up (closes its connection, as the kernel does for a client that dies,
SIGKILL included) before its child ends takes the child with it: SIGKILL, to its process
group when it has one of its own. So a server several supervisors share (one started
apart, `RELAYTRAIN_PREFORK_SOCKET`) never keeps a stage whose supervisor is gone.

SIGTERM or SIGINT ends the server, and with it every child still running (SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from relaytrain_contract.prefork import WITHOUT_BITSANDBYTES

PR_SET_PDEATHSIG = 1
PRELOAD = (
    "torch",
    "transformers",
    "peft",
    "relaytrain_worker.process",
    "transformers.models.llama.modeling_llama",
)
"""What every stage imports (the worker's runtime pulls in the rest of its own modules)."""


class _StopError(Exception):
    """SIGTERM or SIGINT: the server ends."""


def _raise_stop(_signum: int, _frame: object) -> None:
    raise _StopError


Setup = Callable[[dict[str, Any]], None]
"""What a server built on this one does in each child before its output and folder are
set (the request's whole body; a test kubelet mounts a pod's volumes there)."""


def main(argv: list[str], setup: Setup | None = None) -> int:
    without_bnb = argv[:1] == [WITHOUT_BITSANDBYTES]
    argv = argv[1:] if without_bnb else argv
    if len(argv) != 1:
        print(f"usage: python -m relaytrain_worker.prefork [{WITHOUT_BITSANDBYTES}] SOCKET",
              file=sys.stderr)  # fmt: skip
        return 2
    import importlib

    if without_bnb:  # as the worker's __main__ does for a stage that is not QLoRA
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]

    for name in PRELOAD:
        importlib.import_module(name)
    if _gpu_touched():
        print("relaytrain_worker.prefork: importing the stages' modules initialised CUDA (as "
              "bitsandbytes does on a GPU host); a forked stage could not use the GPU, so "
              "none is forked", file=sys.stderr)  # fmt: skip
        return 1
    path = argv[0]
    try:  # children are watched through pidfds (Linux 5.3): refuse to start without them,
        os.close(os.pidfd_open(os.getpid()))  # never after a child is forked
    except (AttributeError, OSError) as exc:
        print(f"relaytrain_worker.prefork: no pidfd here ({exc})", file=sys.stderr)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(16)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    children: dict[int, _Child] = {}  # by pidfd
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    _serve(listener, selector, children, setup)
                elif isinstance(key.data, _Child):  # its client's connection: a hang-up
                    _hung_up(key.data, selector)
                else:
                    _reap(int(key.fd), selector, children)
    except _StopError:
        pass
    finally:
        for child in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        for child in children.values():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return 0


def _gpu_touched() -> bool:
    """Whether the imports initialised CUDA here: a forked child then cannot use it
    ("Cannot re-initialize CUDA in forked subprocess"). bitsandbytes, which peft imports for a
    QLoRA job, asks every GPU for its compute capability at import."""
    torch = sys.modules["torch"]
    return bool(torch.cuda.is_initialized())


class _Child:
    """A forked child the server watches: its client's connection (where its exit is told),
    its PID, whether it leads a process group of its own, and whether its client is still
    there."""

    def __init__(self, conn: socket.socket, pid: int, group: bool) -> None:
        self.conn = conn
        self.pid = pid
        self.group = group
        self.client = True


def _serve(
    listener: socket.socket,
    selector: selectors.BaseSelector,
    children: dict[int, _Child],
    setup: Setup | None,
) -> None:
    conn, _ = listener.accept()
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        body = json.loads(message.decode())
        argv = [str(a) for a in body["argv"]]
        if len(fds) != 2 or len(argv) < 2 or argv[0] != "-m":
            raise ValueError(f"expected -m MODULE ARG... and two descriptors, got {argv}")
    except (OSError, ValueError, KeyError) as exc:
        with contextlib.suppress(OSError):
            conn.sendall(f"error {exc}\n".encode())
        conn.close()
        return
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        inherited = [listener, conn, *(c.conn for c in children.values())]
        _child(server, inherited, list(children), body, fds, setup=setup)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    child = _Child(conn, pid, bool(body.get("new_session")))
    children[pidfd] = child
    selector.register(pidfd, selectors.EVENT_READ)
    selector.register(conn, selectors.EVENT_READ, child)
    conn.sendall(f"pid {pid}\n".encode())


def _hung_up(child: _Child, selector: selectors.BaseSelector) -> None:
    """Something to read on a child's connection: the client sends nothing after its
    request, so it is the end of the stream (a client that closed it or died) or a stray
    byte, which is dropped. At the end the child is killed (its reaping tells nobody)."""
    if not child.client:  # reaped in the same round, its connection closed
        return
    try:
        data = child.conn.recv(4096)
    except OSError:
        data = b""
    if data:
        return
    selector.unregister(child.conn)
    child.client = False
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)
    if child.group:  # and what it started (before its setsid there is no such group yet)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)


def _reap(pidfd: int, selector: selectors.BaseSelector, children: dict[int, _Child]) -> None:
    child = children.pop(pidfd)
    selector.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(child.pid, 0)
    code = os.waitstatus_to_exitcode(status)  # negative for a signal, as Popen's
    if child.client:
        selector.unregister(child.conn)
        child.client = False
        with contextlib.suppress(OSError):
            child.conn.sendall(f"exit {code}\n".encode())
    child.conn.close()


def _child(
    server: int,
    sockets: list[socket.socket],
    pidfds: list[int],
    body: dict[str, Any],
    fds: list[int],
    *,
    setup: Setup | None,
) -> NoReturn:
    """The forked child: set up as the module doc says, run the module, exit with its code."""
    code = 1
    try:
        for sock in sockets:
            sock.close()
        for pidfd in pidfds:
            os.close(pidfd)
        argv = [str(a) for a in body["argv"]]
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        if body.get("new_session"):
            os.setsid()
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != server:  # the server died between fork and prctl
                os.kill(os.getpid(), signal.SIGKILL)
        if setup is not None:
            setup(body)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            if fd > 2:
                os.close(fd)
        os.chdir(body["cwd"])
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in body["env"].items()})
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            import torch

            torch.set_num_threads(int(threads))
        sys.argv = [argv[1], *argv[2:]]
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    except BaseException:  # what an uncaught exception does at the end of a program
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
