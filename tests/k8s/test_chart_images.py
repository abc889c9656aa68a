"""The images the chart runs: by default the appVersion's tag of both repositories; by
digest when `image.digest` / `workerImage.digest` is set (what a release or a private
registry pins), the tag then ignored; and helm refuses a digest that is not one."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml
from relaytrain_testkit import REPO
from relaytrain_testkit.harness.chart_rbac import render_chart

from hack import toolpaths

pytestmark = pytest.mark.k8s

DIGEST = "sha256:" + "ab" * 32


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _worker_image(container: dict[str, Any]) -> str:
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    return str(env["RELAYTRAIN_WORKER_IMAGE"])


def test_both_images_default_to_the_app_version_tag() -> None:
    version = yaml.safe_load((REPO / "charts/relaytrain/Chart.yaml").read_text())["appVersion"]
    container = _operator(render_chart("rt", "ops"))
    assert container["image"] == f"ghcr.io/relaytrain/operator:{version}"
    assert _worker_image(container) == f"ghcr.io/relaytrain/worker:{version}"


def test_a_digest_pins_each_image_and_the_tag_is_ignored() -> None:
    container = _operator(
        render_chart(
            "rt", "ops",
            "image.repository=registry.example:5000/rt/operator", "image.tag=ignored",
            f"image.digest={DIGEST}",
            "workerImage.repository=registry.example:5000/rt/worker",
            f"workerImage.digest={DIGEST}",
        )
    )  # fmt: skip
    assert container["image"] == f"registry.example:5000/rt/operator@{DIGEST}"
    assert _worker_image(container) == f"registry.example:5000/rt/worker@{DIGEST}"


def _refused(value: str) -> str:
    """helm's error for `--set value` (the chart's schema refuses it)."""
    proc = subprocess.run(
        [str(toolpaths.binary("helm")), "template", "rt", str(REPO / "charts/relaytrain"),
         "--set", value],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def test_a_digest_that_is_not_one_is_refused_naming_the_value() -> None:
    err = _refused("image.digest=latest")
    assert "/image/digest" in err and "sha256:" in err, err


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_stage_pods_compute_on_the_gpu_unless_the_release_says_otherwise() -> None:
    assert _env(_operator(render_chart("rt", "ops")))["RELAYTRAIN_WORKER_DEVICE"] == "cuda"
    cpu = _operator(render_chart("rt", "ops", "workerDevice=cpu"))
    assert _env(cpu)["RELAYTRAIN_WORKER_DEVICE"] == "cpu"
    err = _refused("workerDevice=gpu")
    assert "/workerDevice" in err and "cuda" in err, err
