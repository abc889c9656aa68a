"""A container registry for the tests: distribution's `registry` (built from its pinned Go
module by the bootstrap) serving plain HTTP on loopback, with its storage in a folder.
`make images` builds into a local storage; hack/images.sh push copies an image here and says
its digest, and the kwok runner pulls it by that digest for a pod, as a node pulls from a
private registry."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hack import toolpaths
from relaytrain_testkit.harness import procs
from relaytrain_testkit.harness.containers import images_sh
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.waiting import wait_for


@dataclass
class Registry:
    address: str
    """host:port"""
    process: subprocess.Popen[bytes]

    def push(self, name: str) -> str:
        """Copies image `name` ("operator", "worker") here; its reference by digest."""
        proc = images_sh("push", self.address, name, timeout=900, env={"PUSH_TLS_VERIFY": "false"})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        procs.stop(self.process)


def start_registry(workdir: Path) -> Registry:
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    config = workdir / "registry.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "log": {"level": "warn"},
                "storage": {"filesystem": {"rootdirectory": str(workdir / "data")}},
                "http": {"addr": address},
            }
        )
    )
    with (workdir / "registry.log").open("ab") as log:
        process = subprocess.Popen(
            [str(toolpaths.binary("registry")), "serve", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    registry = Registry(address, process)
    try:
        wait_for("the registry to answer", lambda: _answers(address), timeout=30)
    except BaseException:
        registry.stop()
        raise
    return registry


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="session")
def image_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """The session's registry (pytest plugin)."""
    registry = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield registry
    finally:
        registry.stop()
