"""The set-up refuses what it did not pin: a binary that reports another version, a build
module that does not require the pin of versions.env, a lock that disagrees with
pyproject.toml. Each test runs the real scripts of hack/ on a copy where needed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from hack import toolpaths

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PINS = toolpaths.versions()


def _fake_binary(folder: Path, name: str, prints: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{prints}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _kubernetes_folder(cache: Path, apiserver_says: str) -> Path:
    v = PINS["KUBERNETES_VERSION"]
    folder = cache / "bin" / f"kubernetes-{v}"
    _fake_binary(folder, "kube-apiserver", apiserver_says)
    _fake_binary(folder, "kube-controller-manager", f"Kubernetes {v}")
    _fake_binary(folder, "kube-scheduler", f"Kubernetes {v}")
    _fake_binary(folder, "kubelet", f"Kubernetes {v}")
    minor = v.split(".")[1]
    _fake_binary(folder, "kubectl", f'Client Version: {v}\n"minor": "{minor}"')
    return folder


def _run(*args: str, cache: Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RELAYTRAIN_CACHE": str(cache)}
    return subprocess.run(
        ["bash", *args], check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_binary_that_does_not_report_its_pin_is_refused(tmp_path: Path) -> None:
    folder = _kubernetes_folder(tmp_path, "Kubernetes v1.37.0")
    proc = _run("hack/build-go-binaries.sh", "verify", "kubernetes", cache=tmp_path)
    assert proc.returncode == 1, proc.stderr
    message = proc.stderr
    assert f"{folder}/kube-apiserver does not report its pin" in message
    assert "Kubernetes v1.37.0" in message  # what it printed
    assert f"Kubernetes {PINS['KUBERNETES_VERSION']}" in message  # what was expected
    assert "make deps" in message


def test_binaries_that_report_their_pins_pass(tmp_path: Path) -> None:
    _kubernetes_folder(tmp_path, f"Kubernetes {PINS['KUBERNETES_VERSION']}")
    proc = _run("hack/build-go-binaries.sh", "verify", "kubernetes", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr


def _copy_of_hack(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "hack", root / "hack", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_build_module_that_does_not_require_the_pin_is_refused(tmp_path: Path) -> None:
    root = _copy_of_hack(tmp_path)
    env_file = root / "hack" / "versions.env"
    pinned = PINS["ETCD_VERSION"]
    env_file.write_text(env_file.read_text().replace(pinned, "v3.6.99"))
    proc = _run("hack/build-go-binaries.sh", "etcd", cache=tmp_path / "cache", cwd=root)
    assert proc.returncode == 1
    assert "hack/gomod/etcd/go.mod does not require go.etcd.io/etcd/server/v3 v3.6.99" in (
        proc.stderr
    )
    assert "make go-modules" in proc.stderr
    assert not (tmp_path / "cache" / "bin" / "etcd-v3.6.99").exists()


def test_every_committed_build_module_is_read_only_and_complete() -> None:
    """Each component has its go.mod and go.sum, and the build passes -mod=readonly."""
    for name in ("etcd", "kwok", "kubernetes", "minio", "helm"):
        folder = REPO / "hack" / "gomod" / name
        assert (folder / "go.mod").is_file() and (folder / "go.sum").stat().st_size > 0
        assert "\ntool" in (folder / "go.mod").read_text()
    # kstatus-check is a main package of ours requiring the library at its pin.
    kstatus = REPO / "hack" / "gomod" / "kstatus"
    assert (kstatus / "main.go").is_file() and (kstatus / "go.sum").stat().st_size > 0
    assert f"sigs.k8s.io/cli-utils {PINS['KSTATUS_VERSION']}" in (kstatus / "go.mod").read_text()
    assert "-mod=readonly" in (REPO / "hack" / "build-go-binaries.sh").read_text()


def _copy_for_lock(tmp_path: Path) -> Path:
    root = _copy_of_hack(tmp_path)
    for name in ("pyproject.toml", "uv.lock", "README.md"):
        shutil.copy(REPO / name, root / name)
    return root


def test_the_lock_matches_pyproject(tmp_path: Path) -> None:
    root = _copy_for_lock(tmp_path)
    proc = _run("hack/bootstrap.sh", "check-lock", cache=toolpaths.cache_dir(), cwd=root)
    assert proc.returncode == 0, proc.stderr


def test_a_pyproject_change_without_a_new_lock_is_refused(tmp_path: Path) -> None:
    root = _copy_for_lock(tmp_path)
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    assert '"tqdm==4.70.1"' in text
    pyproject.write_text(text.replace('"tqdm==4.70.1"', '"tqdm>=4.70"'))
    proc = _run("hack/bootstrap.sh", "check-lock", cache=toolpaths.cache_dir(), cwd=root)
    assert proc.returncode == 1
    assert "uv.lock does not match pyproject.toml: run `make lock`" in proc.stderr
