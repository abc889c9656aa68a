"""bench/bench_codec_speed.py prices a job's `delta` in fitted bases too (``--basis``, held
to int4's or int3's error: ``--activation-error``): besides the first and later crossings, the
crossing that fits the deltas' basis and sends it, whose cost at an 8B's width the first card
run showed (2026-12-04), and the later crossings coded in that basis. Run small, in process;
the card's time-to-loss call runs it first with hack/gpu-check.sh's ``CODEC`` arguments, which
the first test runs with the device and the sizes made small (and with each error in theirs)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from relaytrain_testkit import REPO

pytestmark = [pytest.mark.unit, pytest.mark.torch]


def run(tmp_path: Path, *args: str) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_codec_speed
    finally:
        sys.path.remove(str(REPO / "bench"))
    import torch

    out = tmp_path / "codec.json"
    argv = ["--quick", "--tokens", "32", "--hidden", "128", "--json", str(out), *args]
    threads = torch.get_num_threads()
    try:  # the bench holds torch to one thread: the worker's later tests keep theirs
        assert bench_codec_speed.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def card_arguments() -> list[str]:
    """hack/gpu-check.sh's CODEC (the time-to-loss call's codec run), as bash splits it, with
    the device and the sizes made small."""
    script = (REPO / "hack" / "gpu-check.sh").read_text()
    found = re.search(r"^CODEC=\((.*?)\)$", script, re.MULTILINE)
    assert found, "hack/gpu-check.sh defines no CODEC=(...)"
    args = shlex.split(found.group(1))
    for flag, value in {"--device": "cpu", "--tokens": "32", "--hidden": "128"}.items():
        args[args.index(flag) + 1] = value
    return args


@pytest.mark.parametrize("error", ["card", "int3", "int4"])
def test_a_codec_of_fitted_bases_reports_the_fit_and_the_crossings_coded_in_it(
    tmp_path: Path, error: str
) -> None:
    """With the card's arguments as they are, and with each activation error in their place."""
    args = card_arguments()
    if error != "card":
        args[args.index("--activation-error") + 1] = error
    name = f"delta ({args[args.index('--activation-error') + 1]}, fitted bases)"
    report = run(tmp_path, *args)
    codes = report["codes"]
    fit = codes[f"{name}, the crossing that fits and sends a basis"]
    later = codes[f"{name}, later crossing (5 % drift: in the fitted basis)"]
    assert fit["encode_ns"] > 0 and later["encode_ns"] > 0
    assert f"{name}, first crossing" in codes
    # the fit alone, what the planner prices a basis's fit against (link_cost)
    assert report["fit_seconds"] > 0


def test_the_default_codec_fits_nothing(tmp_path: Path) -> None:
    report = run(tmp_path)
    codes = report["codes"]
    assert "delta (int4), first crossing" in codes
    assert report["fit_seconds"] is None
    assert not [name for name in codes if "fits" in name]


def test_an_unknown_activation_error_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        run(tmp_path, "--activation-error", "int2")
    assert "--activation-error" in capsys.readouterr().err
