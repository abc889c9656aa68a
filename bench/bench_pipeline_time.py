"""A step's measured time through four stages over slow links, against the planner's `steptime`
model of it (and the model `time_to_loss_model.py` used until 2026-12-01).

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_pipeline_time.py [--steps N] [--json OUT]

A tiny random Llama (4 layers, hidden 256, testkit) with LoRA r8 trains through 4 stages, one
layer each (`run_pipeline_threads`: the worker's StepRunner, 1F1B, Peers and encrypted
loopback links, every stage a thread), int8 boundaries, micro-batches of 4 rows of 64 tokens
(an activation frame about 67 KB). For each number of micro-batches a step and of forwards
ahead of 1F1B (``pipeline.forwardsAhead``), it runs once over loopback and once over each
emulated link (``Link.limit_rate``, ``Link.set_latency``, every link, each direction); the
first step is not timed (``warmup``), the mean of the rest is the measured step.

The model (`steptime.step_seconds`) takes the stage's compute per micro-batch from the
loopback run of the same shape (`steptime.calibrate`), and a frame's send from the bytes
the links counted; the old model is ``max(loopback step, busiest direction's bytes / rate)
+ 2 (P - 1) latency``. Each row: measured, model and old model seconds a step, and each
model's error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO / "bench"),
    str(REPO),
    str(REPO / "operator"),
    str(REPO / "worker_image"),
    str(REPO / "testkit"),
]

from relaytrain_operator.domain.planner.steptime import (  # noqa: E402
    StepShape,
    calibrate,
    step_seconds,
)

STAGES, LAYERS, HIDDEN, SEQ, MBS = 4, 4, 256, 64, 4
LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "o_proj"]}
SHAPES = ((2, 0), (8, 0), (8, 4))
"""(micro-batches a step, forwards ahead)."""
LINKS = ((2.0, 50.0), (10.0, 20.0))
"""(Mbit/s, one-way ms)."""


def measure(
    model: Path, micros: int, ahead: int, steps: int, link: tuple[float, float] | None
) -> tuple[float, list[float]]:
    """(mean seconds a step after the first, [down, up] bytes a step of the busiest boundary)."""
    from relaytrain_contract import TrainingSpec
    from relaytrain_testkit.inputs import even_splits
    from relaytrain_testkit.linkcreds import stage_credentials
    from relaytrain_testkit.pipelines import run_pipeline_threads
    from relaytrain_worker.state.data import MicroBatch

    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(SEQ).expand(MBS, -1).contiguous()

    def batch() -> MicroBatch:
        ids = torch.randint(0, 256, (MBS, SEQ), generator=gen)
        return MicroBatch(ids, torch.ones_like(ids), pos, ids.clone())

    data = [[batch() for _ in range(micros)] for _ in range(steps + 1)]
    training = TrainingSpec(
        steps=steps + 1, micro_batch_size=MBS, micro_batches=micros, learning_rate=1e-3,
        schedule="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    run = run_pipeline_threads(
        model, even_splits(LAYERS, STAGES), data, training,
        credentials=stage_credentials(STAGES, job="bench"), compression="int8", lora=LORA,
        link_rate=None if link is None else link[0] * 1e6 / 8,
        link_latency=0.0 if link is None else link[1] / 1e3, warmup=1, ahead=ahead,
    )  # fmt: skip
    per_step = [max(b[d] for b in run.boundary_bytes) / (steps + 1) for d in range(2)]
    return run.seconds / steps, per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps a run (one more untimed)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from relaytrain_testkit.tiny_models import tiny_model_dir

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_dir(Path(tmp) / "llama", layers=LAYERS, hidden=HIDDEN, tied=False)
        for micros, ahead in SHAPES:
            loopback, _ = measure(model, micros, ahead, args.steps, None)
            compute = calibrate(STAGES, micros, loopback)
            for mbit, ms in LINKS:
                measured, (down, up) = measure(model, micros, ahead, args.steps, (mbit, ms))
                rate, latency = mbit * 1e6 / 8, ms / 1e3
                shape = StepShape(
                    STAGES, micros, compute, down / micros / rate, up / micros / rate, latency,
                    ahead=ahead,
                )  # fmt: skip
                old = max(loopback, max(down, up) / rate) + 2 * (STAGES - 1) * latency
                rows.append(
                    {
                        "micros": micros, "ahead": ahead, "mbit": mbit, "ms": ms,
                        "loopback": loopback, "measured": measured,
                        "model": step_seconds(shape), "old_model": old,
                    }
                )  # fmt: skip
                print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    print(
        "\n| micro-batches | ahead | link | loopback s | measured s | model s (error) |"
        " old model s (error) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(
            f"{r[k]:.2f} ({100 * (r[k] / r['measured'] - 1):+.0f} %)"
            for k in ("model", "old_model")
        )
        print(
            f"| {r['micros']} | {r['ahead']} | {r['mbit']:g} Mbit/s, {r['ms']:g} ms"
            f" | {r['loopback']:.2f} | {r['measured']:.2f} | {cells} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
