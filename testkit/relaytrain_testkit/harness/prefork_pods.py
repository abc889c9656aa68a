"""`python -m relaytrain_testkit.harness.prefork_pods SOCKET`: the worker's prefork server
(relaytrain_worker.prefork) for the test kubelet (kwok_runner.py): a stage pod run as a
local process is forked from a process that imported the worker once, instead of starting
`python -m relaytrain_worker` and importing torch again, pod after pod.

What a pod needs beyond what `relaytrain run --local` does is its volumes. Where the runner
would start a pod as `unshare --user --map-root-user --mount sh -c 'mount ...; exec ...'`
(kubelet_volumes.in_mount_namespace), the forked child does the same itself before it runs
the module: a user namespace with this user as root, a mount namespace of its own (private
propagation), a fresh tmpfs at /run if a target is under it, and each volume bound at its
target (read-only ones remounted so). The request carries them (`mounts_request`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relaytrain_testkit.harness.kubelet_volumes import Mount, under_run

SERVER = "relaytrain_testkit.harness.prefork_pods"
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def mounts_request(mounts: Sequence[Mount]) -> dict[str, Any]:
    """The request's field for `mounts` (what `_setup` does in the child)."""
    return {"mounts": [[str(m.source), m.target, m.read_only] for m in mounts]}


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _setup(body: dict[str, Any]) -> None:
    mounts = body.get("mounts") or []
    if not mounts:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    if any(under_run(target) for _, target, _ in mounts):
        _check(libc.mount(b"tmpfs", b"/run", b"tmpfs", 0, b"mode=0755"), "tmpfs at /run")
    for source, target, read_only in mounts:
        if not Path(target).is_file():  # a file (the runner's hosts) is bound onto a file
            Path(target).mkdir(parents=True, exist_ok=True)
        _check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), target)
        if read_only:
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY
            _check(libc.mount(None, target.encode(), None, flags, None), f"{target} read-only")


if __name__ == "__main__":
    from relaytrain_worker import prefork

    sys.exit(prefork.main(sys.argv[1:], setup=_setup))
