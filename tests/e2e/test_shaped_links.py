"""`relaytrain run --local` over links the kernel makes slow: two real stage processes in a
user and network namespace whose loopback gives every link 1 Mbit/s in each direction
(relaytrain_testkit.shaped_links: htb classes per port, no pacing in the links), and over
links that lose packets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from relaytrain_testkit import shaped_links
from relaytrain_testkit.local_jobs import local_job, progress, run_env
from relaytrain_testkit.tiny_models import CORPUS, tiny_model_dir

pytestmark = pytest.mark.e2e

RATE = 1e6 / 8
"""Bytes per second, each link and direction: 1 Mbit/s."""
STEPS, MICROS, ROWS, SEQ, HIDDEN = 4, 4, 2, 32, 256
ACTIVATION = ROWS * SEQ * HIDDEN * 4
"""Bytes of one micro-batch's hidden states (float32, no compression): the least an
activation frame (and a gradient frame) carries."""


def _run(root: Path, name: str, shaping: shaped_links.Shaping | None) -> dict[str, object]:
    """The module's job `name` on the workspace at `root`, through links shaped so (None:
    loopback as it is); returns what the shaper counted (nothing unshaped)."""
    problem = shaped_links.missing()
    if problem is not None:
        pytest.fail(f"this test needs a user and network namespace with htb: {problem}")
    if not (root / "model").exists():
        tiny_model_dir(root / "model", layers=2, hidden=HIDDEN)
        with (root / "data.jsonl").open("w") as f:
            for i in range(16):  # every row longer than SEQ: cut to it, no padding
                f.write(json.dumps({"prompt": f"q{i}:", "completion": " ".join(CORPUS)}) + "\n")
    job = (
        local_job(root, name)
        .dataset(sequence_length=SEQ)
        .training(steps=STEPS, micro_batch_size=ROWS, micro_batches=MICROS)
        .checkpoint(str(root / "ckpt"), every_steps=STEPS, keep=1)
        .write(root)
    )
    run = [sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
           "--no-progress", "--workdir", str(root / f"wd-{name}")]  # fmt: skip
    stats = root / f"shaper-{name}.json"
    argv = run if shaping is None else shaped_links.command(run, shaping, stats=str(stats))
    done = subprocess.run(
        argv, check=False, env=run_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "relaytrain: done" in done.stdout
    return json.loads(stats.read_text()) if shaping is not None else {}


def _losses(root: Path, name: str) -> list[float]:
    history = json.loads((root / "ckpt" / "default" / name / "loss-history.json").read_text())
    return [entry["loss"] for entry in history]


def test_a_lossy_link_trains_the_same_bits_only_later(tmp_path: Path) -> None:
    """2 % of the packets lost each way (iptables in the namespace, Ethernet-sized packets):
    TCP resends them, every frame arrives whole, and the run trains exactly what it trains
    over loopback as it is."""
    lossy = _run(tmp_path, "lossy", shaped_links.Shaping(4 * RATE, loss=0.02))
    assert int(lossy["lost"]) > 0, lossy  # packets were lost, and resent
    _run(tmp_path, "clean", None)
    assert _losses(tmp_path, "lossy") == _losses(tmp_path, "clean")


def test_training_over_a_kernel_shaped_link_finishes_at_the_links_speed(tmp_path: Path) -> None:
    stats = _run(tmp_path, "slow", shaped_links.Shaping(RATE))

    final = progress(tmp_path / "ckpt", "slow")
    assert final is not None and final["done"] and final["step"] == STEPS
    tokens = STEPS * MICROS * ROWS * SEQ
    assert final["tokensSeen"] == tokens, "rows were padded: the per-step bound below is off"
    # Both directions of the stage link went through a shaped class of their own: the
    # busiest two carried at least every activation (down) and every gradient (up).
    carried = sorted(stats["classBytes"].values(), reverse=True)  # type: ignore[attr-defined]
    assert len(carried) >= 2 and carried[1] >= STEPS * MICROS * ACTIVATION, carried

    # What the user reads: every step's tokens/s is at most what 1 Mbit/s allows. A step
    # moves its MICROS activations over the link; one may have left before the last stage
    # started the step's clock, and the bucket's burst passes at once.
    history = json.loads((tmp_path / "ckpt" / "default" / "slow" / "loss-history.json").read_text())
    least_seconds = ((MICROS - 1) * ACTIVATION - shaped_links.MIN_BURST) / RATE
    most = tokens / STEPS / least_seconds
    rates = [entry["tokensPerSecond"] for entry in history]
    assert len(rates) == STEPS and max(rates) <= most, (rates, most)
