"""The time-to-loss run a GPU host makes (`bash hack/gpu-check.sh time-to-loss`: issue 24's
`delta` against int8 over a 100 Mbit/s, 50 ms link, at an 8B's width) has a CPU twin here, so
the path it takes cannot rot before a card runs it: the same arguments, with the device, the
width and the rows made small, through the same subprocess layout (the repository's packages
from its source tree). The stages must hold the model the unsplit evaluation holds (weights
drawn by name: the first step's loss is one number both ways), `delta` must send fewer bytes
than int8 and int8 fewer than bf16, and both timed runs must reach the target.

Marked torch by hand: the module imports no torch, but the script it runs trains with it."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from relaytrain_testkit import REPO

pytestmark = [pytest.mark.unit, pytest.mark.slow, pytest.mark.torch]

SMALL = {"--device": "cpu", "--hidden": "64", "--seq": "16"}
"""What the twin changes of the GPU host's arguments."""


def gpu_arguments() -> list[str]:
    """hack/gpu-check.sh's TIME_TO_LOSS, as bash splits it."""
    script = (REPO / "hack" / "gpu-check.sh").read_text()
    found = re.search(r"^TIME_TO_LOSS=\((.*?)\)$", script, re.MULTILINE | re.DOTALL)
    assert found, "hack/gpu-check.sh defines no TIME_TO_LOSS=(...)"
    return shlex.split(found.group(1))


def timed_delta() -> str:
    """The `delta` mode the GPU host races against int8 (its ``--timed``)."""
    args = gpu_arguments()
    mode = args[args.index("--timed") + 1]
    assert mode.startswith("delta") and mode in args[args.index("--modes") + 1].split(","), args
    return mode


def twin_arguments() -> list[str]:
    """The GPU host's arguments with the device, the width and the rows made small."""
    args = gpu_arguments()
    for flag, value in SMALL.items():
        args[args.index(flag) + 1] = value
    return [*args, "--weights", "drawn", "--rows", "16", "--epochs", "2"]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": "operator:worker_image:testkit:.", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "bench/bench_delta_boundary.py", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def report_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("time-to-loss") / "time-to-loss.json"
    done = bench(*twin_arguments(), "--json", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def report(report_path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(report_path.read_text())
    return loaded


def test_the_gpu_host_runs_a_model_of_an_8bs_width_on_the_card() -> None:
    args = gpu_arguments()
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--hidden") + 1] == "4096"


def test_the_stages_and_the_unsplit_evaluation_hold_one_model(report: dict[str, Any]) -> None:
    assert report["setup"]["weights"] == "drawn"
    assert report["setup"]["hidden"] == 64
    first = report["first_step_loss"]
    assert first["pipeline"] == pytest.approx(first["unsplit"], rel=1e-5)


def test_the_base_is_pretrained_on_the_device_before_the_fine_tune(report: dict[str, Any]) -> None:
    """The card fine-tunes a base that knows most of its language, as the CPU figures do:
    the drawn model, trained in full there, ends below a model that knows nothing."""
    fitted = report["pretrained"]
    assert fitted is not None and fitted["steps"] > 0
    # 300: bigram.VOCAB, the loss of a model that knows nothing being its log
    assert fitted["entropy"] < fitted["loss"] < math.log(300) - 0.5, fitted


def test_delta_sends_less_than_int8_and_int8_less_than_bf16(report: dict[str, Any]) -> None:
    overall = {m: sum(v["overall"]) for m, v in report["bytes_per_token_per_boundary"].items()}
    assert overall[timed_delta()] < overall["int8"] < overall["bf16"]


def test_both_timed_runs_reach_the_target(report: dict[str, Any]) -> None:
    (target,) = [v for k, v in report["time_to_target"].items() if k.startswith("none's")]
    for mode in ("int8", timed_delta()):
        assert target[mode]["steps"] is not None and target[mode]["measured"] > 0, target
        # The loopback step's work shared out over a card a stage: less a stage than 1F1B's
        # calibration gives it (over instant links a step is 5 of 4 stages x 2 micro-batches).
        assert 0 < target[mode]["model_card_a_stage"] < target[mode]["model"], target[mode]


def test_a_call_stopped_at_its_limit_is_finished_by_another_that_trains_only_the_rest(
    report: dict[str, Any], tmp_path: Path
) -> None:
    """A device call has 10 minutes; the time-to-loss run may need more. What a stopped call
    wrote (its report, partial) is handed to the next with ``--resume``: the runs there are
    taken as measured, only the missing one is trained, and the report is whole again."""
    stopped = {k: v for k, v in report.items() if k != "time_to_target"}
    stopped["linked_runs"] = {m: r for m, r in report["linked_runs"].items() if m != "int8"}
    stopped["partial"] = True
    earlier, out = tmp_path / "stopped.json", tmp_path / "finished.json"
    earlier.write_text(json.dumps(stopped))
    done = bench(*twin_arguments(), "--resume", str(earlier), "--json", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "training int8 over" in done.stderr
    assert "training delta" not in done.stderr and "training none" not in done.stderr
    finished = json.loads(out.read_text())
    assert "partial" not in finished
    for mode, run in report["runs"].items():
        assert finished["runs"][mode]["step_eval"] == run["step_eval"], mode
    # The int8 run over the link trained again: the same steps, the same losses.
    assert (
        finished["linked_runs"]["int8"]["step_eval"] == report["linked_runs"]["int8"]["step_eval"]
    )
    (target,) = [v for k, v in finished["time_to_target"].items() if k.startswith("none's")]
    assert target["int8"]["steps"] is not None


def test_a_report_of_other_arguments_is_not_resumed(report_path: Path) -> None:
    done = bench(*twin_arguments(), "--seed", "1", "--resume", str(report_path))
    assert done.returncode != 0
    assert "seed: 0 there, 1 here" in done.stderr, done.stderr[-2000:]


def test_the_bytes_to_a_target_are_each_steps_most_loaded_boundary_summed() -> None:
    """What the projection's ratios are made of: a link's time follows, each step, its most
    loaded boundary in its busiest direction; the gradients' direction is counted apart."""
    from bench.bench_delta_boundary import ModeRun, link_bytes, to_target_bytes

    # per step, per boundary: [down, up]
    steps = [[[10, 3], [7, 9]], [[5, 6], [8, 2]], [[100, 100], [100, 100]]]
    run = ModeRun("delta", "unlimited", 1.0, [0.1] * 3, [2.0, 1.0, 0.5], steps, [])
    assert to_target_bytes(run, 2) == (10 + 8, 9 + 6)  # the third step is past the target
    assert to_target_bytes(run, 3) == (118, 115)
    assert link_bytes(run, 2) == [(15, 9), (15, 11)]  # each boundary's own, both directions


def test_the_step_model_gives_each_link_its_own_boundarys_bytes() -> None:
    """The timed runs' model: each link carries its own boundary's frames of the step. Under
    `delta` one boundary can carry most of a step's bytes; priced as if every link carried
    them, the model put a measured step 6-9 % too slow (2026-12-08)."""
    from relaytrain_operator.domain.planner.steptime import StepShape, step_seconds

    from bench.bench_delta_boundary import STAGES, ModeRun, SlowLink, step_model

    link, micros = SlowLink(1.0, 10.0), 4
    heavy, light = [400_000, 200_000], [1_000, 3_000]
    loaded = [[heavy] + [light] * (STAGES - 2)]  # one step: the first boundary loaded
    every = [[heavy] * (STAGES - 1)]
    loopback = ModeRun("delta", "unlimited", 0.8, [0.8], [1.0], loaded, [])

    def model(step_bytes: list[list[list[int]]]) -> float:
        run = ModeRun("delta", link.label, 9.0, [9.0], [1.0], step_bytes, [])
        return step_model(run, loopback, 1, link, micros, apart=True)[0]

    frame = [[b[d] / link.rate / micros for b in loaded[0]] for d in range(2)]
    compute = 0.8 / (STAGES * micros)  # `apart`: the loopback step's work shared out
    want = StepShape(STAGES, micros, compute, tuple(frame[0]), tuple(frame[1]), link.latency)
    assert model(loaded) == step_seconds(want)
    assert model(loaded) < 0.9 * model(every)  # the light links fill and drain sooner


def test_the_report_gives_each_modes_steps_and_bytes_to_the_target(
    report: dict[str, Any],
) -> None:
    from bench.time_to_loss_model import steps_to

    runs, to_target = report["runs"], report["to_target"]
    target = 1.01 * runs["none"]["step_eval"][-1]
    for mode, run in runs.items():
        assert to_target[mode]["steps"] == steps_to(run["step_eval"], target), mode
    delta, int8 = to_target[timed_delta()], to_target["int8"]
    assert delta["busiest_ratio"] == pytest.approx(int8["busiest_bytes"] / delta["busiest_bytes"])
    assert delta["gradient_ratio"] == pytest.approx(
        int8["gradient_bytes"] / delta["gradient_bytes"]
    )
    # Each link's own: no link of delta's carries more than the busiest boundary's bytes.
    for link, (mine, ours) in enumerate(zip(delta["link_bytes"], int8["link_bytes"], strict=True)):
        assert delta["link_ratios"][link] == pytest.approx([ours[0] / mine[0], ours[1] / mine[1]])
        assert delta["link_ratios"][link][0] >= delta["busiest_ratio"] * (1 - 1e-9)
