"""The real node's harness (relaytrain_testkit.harness.real_kubelet) refuses to start where it
cannot, saying what is missing, before it touches anything; tests/e2e/test_real_kubelet.py
runs it for real."""

from __future__ import annotations

from pathlib import Path

import pytest
from relaytrain_testkit.harness import real_kubelet

pytestmark = pytest.mark.unit


def test_without_root_it_refuses_naming_root_and_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(real_kubelet.os, "geteuid", lambda: 1000)
    workdir = tmp_path / "node"
    with (
        pytest.raises(real_kubelet.RealNodeError, match=r"needs root \(running as uid 1000\)"),
        real_kubelet.real_kubelet_node(None, None, "unused", workdir),  # type: ignore[arg-type]
    ):
        pass
    assert not workdir.exists()


def test_a_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_kubelet.shutil, "which", lambda tool, path=None: None)
    missing = " ".join(real_kubelet.missing_requirements())
    for tool in ("containerd", "ctr", "runc"):
        assert f"`{tool}`" in missing
    assert "hack/images.sh tools" in missing
