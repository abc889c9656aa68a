"""Which prefork server a run forks its stages from (docs/worker.md, "Starting"): the one at
RELAYTRAIN_PREFORK_SOCKET where it can serve the run, else one the run starts with its
first stage, its output in `<workdir>/prefork.log`; none with RELAYTRAIN_PREFORK=0
(`stages.forks_stages`), off Linux, or once a server failed (said once: the stages then
start as programs of their own)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from relaytrain_contract.prefork import SOCKET_ENV, ForkedProcess, PreforkError, PreforkServer

from relaytrain_operator.cli.local_run.stages import die_with_supervisor


class StageForks:
    """A run's prefork server, found or started when the first stage is forked."""

    def __init__(self, enabled: bool, env: Mapping[str, str], workdir: Path, qlora: bool) -> None:
        """`enabled`: `forks_stages`' answer; `env`: the stages' environment (the server's
        too, when the run starts one); `qlora`: whether the stages import bitsandbytes."""
        self.enabled = enabled and sys.platform.startswith("linux")  # pidfds, death signals
        self._env = env
        self._workdir = workdir
        self._qlora = qlora
        self._server: PreforkServer | None = None

    def spawn(self, argv: list[str], log: int, env: Mapping[str, str]) -> ForkedProcess | None:
        """`argv` forked with `env`, its output to `log`; None: start it as a program."""
        if not self.enabled:
            return None
        try:
            if self._server is None:
                self._server = self._shared() or self._own()
            return self._server.spawn(argv, env, Path.cwd(), stdout=log, stderr=log)
        except PreforkError as err:
            print(f"relaytrain: {err}; each stage starts as a program of its own", file=sys.stderr)
            self.enabled = False
            self.stop()
            return None

    def _shared(self) -> PreforkServer | None:
        """The server at RELAYTRAIN_PREFORK_SOCKET, or None (not set, or it cannot serve
        this run: said once, and the run starts its own)."""
        path = os.environ.get(SOCKET_ENV)
        if not path:
            return None
        try:
            return PreforkServer.attach(path, self._env, qlora=self._qlora)
        except PreforkError as err:
            print(f"relaytrain: {err}; this run starts a prefork server of its own",
                  file=sys.stderr)  # fmt: skip
            return None

    def _own(self) -> PreforkServer:
        with (self._workdir / "prefork.log").open("ab") as own:
            return PreforkServer.start(
                self._env, die_with_supervisor(os.getpid()), own, qlora=self._qlora
            )

    def stop(self) -> None:
        """End the run's own server, once no stage is left (it kills any it still runs); one
        the run attached to runs on."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
