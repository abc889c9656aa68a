"""A pod's volumes shown at their mount paths, in a mount namespace of the process's own: the
test kubelet's one way of mounting them (kubelet_volumes.py writes what they hold).

The process enters a user namespace where this user is root and a mount namespace of its own
(private propagation: nothing it mounts shows outside), gets a fresh tmpfs at /run if a
target is under it (a container's /run is its own; /var/run links to it), and each volume's
folder is bound at its target, read-only ones remounted so. No privilege is needed.

Both ways a pod's process starts use `enter`: one forked from the prefork server calls it
in the child (prefork_pods.py), and one started anew runs this file, standard library only,
which enters and then execs the container's command (`command`): the same pid, so signals
and the exit status are the container's. It is run by its path, not as a module, since a
pod's environment does not put the testkit on the path.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_RUN_ROOTS = (PurePosixPath("/run"), PurePosixPath("/var/run"))
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


@dataclass(frozen=True)
class Mount:
    """A folder on this machine shown at `target` inside the container."""

    source: Path
    target: str
    read_only: bool = True


def under_run(target: str) -> bool:
    """Whether `target` is under /run (or /var/run), which a pod gets a tmpfs of its own."""
    path = PurePosixPath(target)
    return any(path == root or root in path.parents for root in _RUN_ROOTS)


def check_targets(mounts: Sequence[Mount]) -> None:
    """Every target outside /run must exist here: nothing is created on this machine's
    filesystem."""
    for m in mounts:
        if not under_run(m.target) and not Path(m.target).exists():
            raise RuntimeError(f"cannot mount a volume at {m.target}: it does not exist here")


def to_json(mounts: Sequence[Mount]) -> list[list[object]]:
    """`mounts` as JSON (a prefork request's field, this file's first argument)."""
    return [[str(m.source), m.target, m.read_only] for m in mounts]


def from_json(doc: Sequence[Sequence[object]]) -> list[Mount]:
    return [Mount(Path(str(source)), str(target), bool(ro)) for source, target, ro in doc]


def command(argv: list[str], mounts: Sequence[Mount]) -> list[str]:
    """`argv` started in a mount namespace of its own where each mount is in place."""
    if not mounts:
        return argv
    check_targets(mounts)
    return [sys.executable, str(Path(__file__).resolve()), json.dumps(to_json(mounts)), *argv]


def enter(mounts: Sequence[Mount]) -> None:
    """Put this process (single-threaded: a user namespace demands it) in namespaces of its
    own where each mount is in place."""
    if not mounts:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    if any(under_run(m.target) for m in mounts):
        _check(libc.mount(b"tmpfs", b"/run", b"tmpfs", 0, b"mode=0755"), "tmpfs at /run")
    for m in mounts:
        target = m.target.encode()
        if not Path(m.target).is_file():  # a file (the runner's hosts) is bound onto a file
            Path(m.target).mkdir(parents=True, exist_ok=True)
        _check(libc.mount(str(m.source).encode(), target, None, MS_BIND, None), m.target)
        if m.read_only:
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY
            _check(libc.mount(None, target, None, flags, None), f"{m.target} read-only")


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


if __name__ == "__main__":
    enter(from_json(json.loads(sys.argv[1])))
    os.execvp(sys.argv[2], sys.argv[2:])
