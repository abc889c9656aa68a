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


def _locked_install(dockerfile: Path) -> list[str]:
    runs = [r for r in _run_lines(dockerfile) if r.startswith("uv sync")]
    assert len(runs) == 1, f"{dockerfile}: expected one `RUN uv sync ...`, found {runs}"
    return shlex.split(runs[0].split("&&")[0])


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_the_image_installs_the_pinned_uv_with_hashes(path: str) -> None:
    runs = _run_lines(REPO / path)
    assert "python -m pip install --require-hashes -r hack/uv-requirements.txt" in runs


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
