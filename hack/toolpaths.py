"""Where the bootstrap put the pinned binaries: one function for tests, benchmarks and scripts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

HACK = Path(__file__).resolve().parent

# binary name -> (versions.env key, folder prefix in the cache)
_BINARIES = {
    "kube-apiserver": ("KUBERNETES_VERSION", "kubernetes"),
    "kube-controller-manager": ("KUBERNETES_VERSION", "kubernetes"),
    "kube-scheduler": ("KUBERNETES_VERSION", "kubernetes"),
    "kubectl": ("KUBERNETES_VERSION", "kubernetes"),
    "kubelet": ("KUBERNETES_VERSION", "kubernetes"),
    "etcd": ("ETCD_VERSION", "etcd"),
    "kwok": ("KWOK_VERSION", "kwok"),
    "kwokctl": ("KWOK_VERSION", "kwok"),
    "minio": ("MINIO_VERSION", "minio"),
    "helm": ("HELM_VERSION", "helm"),
    "kstatus-check": ("KSTATUS_VERSION", "kstatus"),
    "kueue": ("KUEUE_VERSION", "kueue"),
    "promtool": ("PROMTOOL_VERSION", "promtool"),
    "actionlint": ("ACTIONLINT_VERSION", "actionlint"),
    "registry": ("REGISTRY_VERSION", "registry"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("RELAYTRAIN_CACHE", Path.home() / ".cache" / "relaytrain"))


def versions() -> dict[str, str]:
    """The pins of hack/versions.env."""
    pins: dict[str, str] = {}
    for raw in (HACK / "versions.env").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pins[key] = value
    return pins


def uv() -> Path:
    """The pinned uv (hack/uv-requirements.txt), as the bootstrap installs it."""
    out = subprocess.run(
        ["bash", str(HACK / "bootstrap.sh"), "uv-path"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return Path(out.strip().splitlines()[-1])


def component_files(component: str) -> Path:
    """The files the bootstrap copied out of `component`'s module into its cache folder
    (hack/gocomponents.sh `component_files`: kueue's CRDs and webhook configurations, the
    prometheus-operator's CRDs)."""
    version = versions()[f"{component.upper()}_VERSION"]
    path = cache_dir() / "bin" / f"{component}-{version}" / "files"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing: run `make deps` (or hack/build-go-binaries.sh)"
        )
    return path


def binary(name: str) -> Path:
    """The cached binary `name`; a clear error says how to build it when it is missing."""
    key, folder = _BINARIES[name]
    path = cache_dir() / "bin" / f"{folder}-{versions()[key]}" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run `make deps` (or hack/build-go-binaries.sh)"
        )
    return path
