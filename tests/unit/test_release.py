"""One version everywhere a release names it: the package (pyproject.toml), the chart's
version and its appVersion (the default tag of both images the chart runs), and the images'
OCI labels (`make images` passes the package's). The release workflow refuses a tag that
differs from them (.github/workflows/release.yml)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_the_package_the_chart_and_its_app_version_agree() -> None:
    package = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "charts/relaytrain/Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == package


def test_both_images_default_to_the_charts_app_version() -> None:
    values = yaml.safe_load((REPO / "charts/relaytrain/values.yaml").read_text())
    assert values["image"]["tag"] == "" and values["workerImage"]["tag"] == ""
    helpers = (REPO / "charts/relaytrain/templates/_helpers.tpl").read_text()
    for value in ("image", "workerImage"):
        assert f"(default .Chart.AppVersion .Values.{value}.tag)" in helpers


def test_the_release_builds_both_images_and_the_chart_with_the_tags_version() -> None:
    workflow = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    assert workflow[True]["push"]["tags"] == ["v*.*.*"]  # YAML 1.1 reads `on` as True
    images = workflow["jobs"]["images"]["strategy"]["matrix"]["include"]
    assert {i["image"]: i["dockerfile"] for i in images} == {
        "operator": "operator/Dockerfile",
        "worker": "worker_image/Dockerfile",
    }
    assert "linux/arm64" in {i["image"]: i["platforms"] for i in images}["operator"]
    steps = workflow["jobs"]["images"]["steps"]
    build = next(s for s in steps if s.get("id") == "build")["with"]
    assert build["sbom"] is True and build["push"] is True
    assert any("cosign sign --yes" in s.get("run", "") for s in steps)
    assert workflow["jobs"]["images"]["permissions"]["id-token"] == "write"
    chart = " ".join(s.get("run", "") for s in workflow["jobs"]["chart"]["steps"])
    assert "helm push" in chart and "oci://" in chart
