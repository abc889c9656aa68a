"""The GPU check's CPU twin, so the script a GPU host runs cannot rot: bench/gpu_check.py
--device cpu, run as the GPU host runs it (a subprocess importing the repository's packages
from its source tree through PYTHONPATH=operator:worker_image:testkit:.), on a tiny Llama of
the 8B config's family. It must report every set-up with positive tokens/s and its peak
memory beside the planner's estimate, and two stages over a loopback link must train what
one stage trains, the unsplit peft model too (float32: equal within float tolerance), so the
twin checks the arithmetic, not only that the script runs.

Marked torch by hand: the module imports no torch, but the script it runs trains with it
(`make test-fast` leaves it out)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from relaytrain_testkit import REPO

pytestmark = [pytest.mark.unit, pytest.mark.slow, pytest.mark.torch]

SOURCE_PATH = "operator:worker_image:testkit:."
"""What hack/gpu-check.sh puts after the carried wheels on the GPU host."""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH}
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ratios: (b)/(a) = " in done.stdout
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def test_the_hosts_source_path_is_the_scripts() -> None:
    script = (REPO / "hack" / "gpu-check.sh").read_text()
    assert f"SOURCE_PATH={SOURCE_PATH}\n" in script
    assert "bench/gpu_check.py --device cuda --json" in script


def test_every_setup_reports_speed_and_memory_beside_the_estimate(report: dict[str, Any]) -> None:
    assert report["device"] == "cpu" and report["model"]["layers"] == 4
    runs = report["runs"]
    assert runs["b"]["stage_layers"] == [2, 2]
    for key in ("a", "b", "c"):
        row = runs[key]
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0
        assert row["tokens"] == report["training"]["timed_tokens"] > 0
        assert row["estimate_bytes"] > 0
        assert row["peak_bytes"] is None or row["peak_bytes"] > 0
        assert "mfu" in row and "peak_over_estimate" in row
    # (b)'s two stages are priced as two stages: the first holds two micro-batches in flight.
    first, second = runs["b"]["estimate_per_stage"]
    assert runs["b"]["estimate_bytes"] == first + second
    assert report["ratios"]["b_over_a"] > 0 and report["ratios"]["a_over_c"] > 0
    assert report["flops"]["model_flops_per_token"] > 0


def test_a_card_s_one_stage_mfu_becomes_its_catalog_entry_s_efficiency(
    report: dict[str, Any],
) -> None:
    """On a card the report gives the catalog entry it measured, (a)'s MFU as `efficiency`,
    in the planner's override format; on the CPU (no catalog product, no MFU) none."""
    from relaytrain_operator.domain.planner import DEFAULT_CATALOG

    from bench.gpu_check import measured_entry

    assert "catalog_entry" not in report
    assert measured_entry(report["catalog_product"], report["runs"]["a"]) is None
    on_card = {**report["runs"]["a"], "mfu": 0.30462}
    entry = measured_entry("NVIDIA-H200", on_card)
    assert entry == {"NVIDIA-H200": {"efficiency": 0.305}}
    assert DEFAULT_CATALOG.with_overrides(entry)["NVIDIA-H200"].efficiency == 0.305


def test_qlora_runs_where_bitsandbytes_imports(report: dict[str, Any]) -> None:
    row = report["runs"]["qlora"]
    if importlib.util.find_spec("bitsandbytes") is None:
        assert row["skipped"].startswith("bitsandbytes does not import")
    else:
        assert "error" not in row and row["tokens_per_s"] > 0, row


def test_two_stages_train_what_one_stage_trains(report: dict[str, Any]) -> None:
    check = report["checks"]["b_vs_a"]
    assert check["grad_max_abs"] > 0  # gradients that exist: equal zeros would prove nothing
    assert check["loss_max_abs_diff"] <= 1e-6 * check["last_loss"]
    assert check["grad_max_rel_diff"] <= 1e-6
    assert check["params_max_abs_diff"] <= 1e-7


def test_the_unsplit_peft_model_trains_the_same(report: dict[str, Any]) -> None:
    check = report["checks"]["c_vs_a"]
    assert check["loss_max_abs_diff"] <= 1e-5 * check["last_loss"]
    assert check["grad_max_rel_diff"] <= 1e-4
    assert check["params_max_abs_diff"] <= 1e-6


def test_the_gpu_tests_collect_on_a_host_without_the_cluster_packages(tmp_path: Path) -> None:
    """The GPU host has torch but not kubernetes, kopf or minio (the first card run, on
    2026-11-27, stopped here: tests/conftest.py's harness plugins import kubernetes). The
    script's `tests` verb must collect the gpu-marked tests with those packages missing."""
    for name in ("kubernetes", "kopf", "minio"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('no {name} on the GPU host')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{SOURCE_PATH}", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "hack/gpu-check.sh", "tests", "--collect-only"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    collected = re.search(r"(\d+)/\d+ tests collected|(\d+) tests? collected", done.stdout)
    assert collected, done.stdout[-2000:]
    assert int(collected.group(1) or collected.group(2)) >= 3, done.stdout[-2000:]
