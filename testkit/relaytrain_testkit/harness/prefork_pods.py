"""`python -m relaytrain_testkit.harness.prefork_pods SOCKET`: the worker's prefork server
(relaytrain_worker.prefork) for the test kubelet (kwok_runner.py): a stage pod run as a
local process is forked from a process that imported the worker once, instead of starting
`python -m relaytrain_worker` and importing torch again, pod after pod.

What a pod needs beyond what `relaytrain run --local` does is its volumes: the forked
child enters namespaces of its own where they are mounted (mount_ns.enter, as a pod started
anew does through mount_ns.command) before it runs the module. The request carries them
(`mounts_request`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from relaytrain_testkit.harness.mount_ns import Mount, enter, from_json, to_json

SERVER = "relaytrain_testkit.harness.prefork_pods"


def mounts_request(mounts: Sequence[Mount]) -> dict[str, Any]:
    """The request's field for `mounts` (what `_setup` does in the child)."""
    return {"mounts": to_json(mounts)}


def _setup(body: dict[str, Any]) -> None:
    enter(from_json(body.get("mounts") or []))


if __name__ == "__main__":
    from relaytrain_worker import prefork

    sys.exit(prefork.main(sys.argv[1:], setup=_setup))
