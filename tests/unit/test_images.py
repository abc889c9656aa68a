"""The images install the pins the tests ran with: each Dockerfile installs the pinned uv with
hash checking and then exactly uv.lock. No Docker engine runs here, so the test runs each
Dockerfile's own install command against the lock (uv's --dry-run, offline: everything the
lock names is in uv's cache once the bootstrap has run) and checks what it would install."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hack import toolpaths

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
IMAGES = {
    # Dockerfile: (packages it must install, packages it must not)
    "operator/Dockerfile": ({"kopf", "kubernetes", "pydantic"}, {"torch", "transformers"}),
    "worker_image/Dockerfile": ({"torch", "transformers", "peft", "bitsandbytes"}, {"kopf"}),
}


def _run_lines(dockerfile: Path) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(r"^RUN (.+)$", text, flags=re.M)]


def _commands(dockerfile: Path) -> list[str]:
    """Every command of every RUN instruction (split at `&&`)."""
    return [c.strip() for r in _run_lines(dockerfile) for c in r.split("&&")]


def _locked_install(dockerfile: Path) -> list[str]:
    """The image's last `uv sync`: the one that installs the project with its dependencies
    (the one before installs the dependencies alone, in a layer of their own)."""
    syncs = [shlex.split(c) for c in _commands(dockerfile) if " sync " in f" {c} "]
    assert len(syncs) == 2, f"{dockerfile}: expected two `uv sync` (deps, then project): {syncs}"
    deps, project = syncs
    assert deps == [*project, "--no-install-project"], (deps, project)
    return project


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_the_image_installs_the_pinned_uv_with_hashes(path: str) -> None:
    installs = [c for c in _commands(REPO / path) if "pip install" in c]
    assert installs, f"{path} installs no uv"
    for command in installs:  # each RUN that uses uv installs it, hash-checked, and drops it
        assert command.endswith("--require-hashes -r uv-requirements.txt"), command
    assert all(c.startswith("/tmp/uv/bin/uv ") for c in _commands(REPO / path) if " uv " in c)


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_the_image_installs_exactly_the_lock(path: str, tmp_path: Path) -> None:
    argv = _locked_install(REPO / path)
    assert "--locked" in argv  # fails when pyproject.toml and uv.lock disagree
    env = {
        **os.environ,
        "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv"),
        "UV_PYTHON_DOWNLOADS": "never",
    }
    proc = subprocess.run(
        [str(toolpaths.uv()), *argv[1:], "--dry-run", "--offline", "--python", "python3"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    would = set(re.findall(r"^ \+ ([A-Za-z0-9_.-]+)==", proc.stderr + proc.stdout, flags=re.M))
    must, must_not = IMAGES[path]
    assert must <= would, f"{path} would not install {sorted(must - would)}"
    assert not (must_not & would), f"{path} would install {sorted(must_not & would)}"
    assert not (tmp_path / "venv").exists()  # a dry run
