"""hack/images.sh's container tools on a machine that has none of them: it must say what it
needs (or install it), never stop without a word. A fresh machine met that: dpkg-query
printed nothing for a package it never saw, `read` failed at the end of its input, and
under `set -e` `make images` ended with "Error 1" alone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from relaytrain_testkit import REPO

pytestmark = pytest.mark.unit


def test_missing_tools_are_named_not_a_silent_exit(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # dpkg has never seen the packages; the user is not root, so nothing is installed.
    (bin_dir / "dpkg-query").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "RELAYTRAIN_CACHE": str(tmp_path / "cache")}  # fmt: skip
    done = subprocess.run(["bash", "hack/images.sh", "tools"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "[images] needs Debian's buildah=" in done.stderr, done.stderr
    assert "as root, apt-get install buildah=" in done.stderr and "skopeo=" in done.stderr
