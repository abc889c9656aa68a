"""Two pipelines against one on paced links: measured tokens/s against the planner's prediction.

    .venv/bin/python bench/bench_fleet_measured.py [--quick] [--json OUT] [--mbit R] [--reps N]
                                                   [--hidden H] [--mbs B]

The same model (a random 2-layer Llama, hidden 256, float32, LoRA r4 on q/v) and the same
global batch (16 micro-batches of 4 x 128 tokens per step, the same rows) trained

- (a) by one 2-stage pipeline (`testing.run_pipeline_threads`), and
- (b) by two 2-stage pipelines as one job (`testing.run_data_parallel_threads`, replicas over
  authenticated `LinkGroup` links: the token-count exchange and the per-step all-gather of the
  LoRA gradients), each training its share of every step,

every stage a thread of this process, every pipeline link and every replica link paced to R
Mbit/s in each direction (`Link.limit_rate`, 5 by default) so that the links, not the
machine's two cores, bound the run: a micro-batch's activations (512 KiB) take 0.86 s on a
link, its compute on a stage tens of ms — a small model is chosen for its little compute per
boundary byte (compute grows with hidden^2 per token, the boundary with hidden), because two
pipelines put four stage threads, their link threads and the machine's other work on the
same two cores. The sides alternate (a, b, then b, a, ...) for ``--reps`` rounds; reported:
median tokens/s of each side with its range, the two-over-one ratio of each round (median and
range), and the same runs unpaced (the cores' ceiling, for context).

Prediction: the planner (`plan_fleet`) on a fleet that describes this set-up — one pool of 4
"GPUs" (stage threads) whose links have the paced bandwidth and loopback's latency, and a
catalog entry whose matmul rate makes the planner's slowest stage compute what the unpaced
one-pipeline runs measured per micro-batch (median beat, seconds / (steps x (M + 1)); that
beat includes loopback sends, so the compute is over-, not under-stated). Efficiency 1 on that
measured rate. ``replicas=1, stages=2`` gives (a)'s prediction, ``replicas=2, stages=2`` gives
(b)'s: both pipelines' splits, the shares of the step (checked against
`split_micro_batches` over the pipelines' steps played out, and used by the run) and the price
of the synchronous sync over the paced replica links. Nothing in the prediction is fitted to
the paced runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "operator"),
    str(ROOT / "worker_image"),
    str(ROOT / "testkit"),
]

from relaytrain_contract import TrainingSpec  # noqa: E402
from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem  # noqa: E402
from relaytrain_operator.domain.planner import (  # noqa: E402
    DEFAULT_CATALOG,
    CostSettings,
    FleetPlan,
    Lane,
    ModelShape,
    Plan,
    Pool,
    TrainingShape,
    plan_fleet,
    split_micro_batches,
)
from relaytrain_operator.domain.planner.steptime import PLAYED_MICROS, PlannedSteps  # noqa: E402
from relaytrain_testkit.inputs import random_batches  # noqa: E402
from relaytrain_testkit.pipelines import run_data_parallel_threads, run_pipeline_threads  # noqa: E402
from relaytrain_testkit.tiny_models import tiny_model_dir  # noqa: E402
from relaytrain_worker.pipeline.credentials import LinkCredentials  # noqa: E402
from relaytrain_worker.state.data import MicroBatch  # noqa: E402

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""
PRODUCT = "CPU-paced-stage"
"""The catalog entry calibrated here: one stage thread of this machine."""
POOL = "paced"
LORA_RANK = 4
LORA_TARGETS = ("q_proj", "v_proj")
LORA: dict[str, Any] = {"rank": LORA_RANK, "alpha": 8.0, "dropout": 0.0,
                        "targets": list(LORA_TARGETS)}  # fmt: skip
LOOPBACK_MS = 0.03
"""One-way latency of a loopback link (bench_plan_vs_measured measures 0.02-0.03 ms); the
planner gets half of it per end. Against sends of tens of ms it does not matter."""


@dataclass(frozen=True)
class Setup:
    """What both sides train."""

    hidden: int
    micro_batches: int
    """M, micro-batches per optimizer step (the global batch)."""
    mbs: int
    seq: int
    steps: int
    """Optimizer steps per measured run (all timed)."""
    mbit: float
    """Paced rate of every link, each direction."""
    reps: int
    """Rounds of (one pipeline, two pipelines), alternating the order."""


FULL = Setup(hidden=256, micro_batches=16, mbs=4, seq=128, steps=1, mbit=5.0, reps=5)
QUICK = Setup(hidden=256, micro_batches=8, mbs=4, seq=128, steps=1, mbit=5.0, reps=2)


def credentials(stages: list[int]) -> list[list[LinkCredentials]]:
    """Every stage's link credentials, minted as the operator mints them for one job."""
    files = mint_link_credentials("bench", "fleet", stages, now=datetime.now(UTC))
    return [
        [LinkCredentials(*stage_pem(files, p, k)) for k in range(n)] for p, n in enumerate(stages)
    ]


def training_spec(s: Setup, steps: int) -> TrainingSpec:
    return TrainingSpec(
        steps=steps, microBatchSize=s.mbs, microBatches=s.micro_batches, learningRate=1e-3,
        schedule="constant", warmupSteps=0, weightDecay=0.0, maxGradNorm=1.0, seed=0,
    )  # fmt: skip


@dataclass(frozen=True)
class Sides:
    """The two set-ups as the runs use them."""

    one: list[tuple[int, int]]
    """The single pipeline's split ([start, end) per stage)."""
    two: list[list[tuple[int, int]]]
    """Each of the two pipelines' splits."""
    shares: list[int]
    """Micro-batches per step of each of the two pipelines."""


def run_side(
    model: Path, sides: Sides, two: bool, data: list[list[MicroBatch]], s: Setup, rate: float | None
) -> dict[str, float]:
    """Train ``data`` (every step's M micro-batches) with one pipeline or two; tokens/s and
    wire bytes per token of the first boundary (down, up)."""
    tokens = sum(int(mb.attention_mask.sum()) for micros in data for mb in micros)
    training = training_spec(s, len(data))
    if two:
        runs = run_data_parallel_threads(
            model, sides.two, sides.shares, data, training,
            credentials=credentials([len(x) for x in sides.two]), lora=LORA, replicas="links",
            link_rate=rate,
        )  # fmt: skip
        seconds = max(r.seconds for r in runs)
        down = sum(r.boundary_bytes[0][0] for r in runs)
        up = sum(r.boundary_bytes[0][1] for r in runs)
    else:
        run = run_pipeline_threads(
            model, sides.one, data, training, credentials=credentials([len(sides.one)])[0],
            lora=LORA, link_rate=rate,
        )  # fmt: skip
        seconds = run.seconds
        down, up = run.boundary_bytes[0]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "down": down / tokens,
            "up": up / tokens}  # fmt: skip


def planner_inputs(s: Setup) -> TrainingShape:
    return TrainingShape(
        s.mbs, s.micro_batches, s.seq, method="lora", lora_rank=LORA_RANK,
        lora_targets=LORA_TARGETS, compression="none", dtype="float32",
    )  # fmt: skip


def predict(shape: ModelShape, s: Setup, tflops: float, mbit: float) -> tuple[FleetPlan, FleetPlan]:
    """(one pipeline, two pipelines) as the planner prices them on this machine's stages."""
    entry = {
        "tflops": tflops,
        "fp32Tflops": tflops,
        "memoryMiB": 64 * 1024,
        "memoryBandwidthGBs": 10.0,
        "bf16": False,
    }
    catalog = DEFAULT_CATALOG.with_overrides({"gpus": {PRODUCT: entry}})
    pools = [Pool(POOL, PRODUCT, 4, mbit, LOOPBACK_MS / 2)]
    settings = CostSettings(efficiency=1.0)
    training = planner_inputs(s)
    one = plan_fleet(shape, training, pools, catalog, settings=settings, stages=2, replicas=1)
    two = plan_fleet(shape, training, pools, catalog, settings=settings, stages=2, replicas=2)
    return one, two


def calibrate_tflops(shape: ModelShape, s: Setup, beat: float) -> float:
    """The entry's TFLOPS at which the planner's slowest stage computes ``beat`` seconds per
    micro-batch (compute scales as 1 / TFLOPS; links priced here are ignored)."""
    one, _ = predict(shape, s, 1.0, 1e6)
    slowest = max(st.compute_seconds for st in one.pipelines[0].stages)
    return slowest / beat


def lane_of(p: Plan) -> Lane:
    """A pipeline's step for any share of the micro-batches, as the fleet planner prices it:
    its own stages and links played out (a line under it at 0 fill: the split needs none),
    linear from where `PlannedSteps` goes on at its slope, as the planner's lanes are."""
    assert p.timeline is not None
    return Lane(PlannedSteps(p.timeline), 0.0, p.micro_batch_seconds, linear_after=PLAYED_MICROS)


def splits_of(f: FleetPlan) -> list[list[tuple[int, int]]]:
    return [[(st.layer_start, st.layer_end) for st in p.stages] for p in f.pipelines]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="M=8 not 16, 2 rounds not 5 (about 45 s)"
    )
    parser.add_argument("--mbit", type=float, help="paced rate of every link, Mbit/s")
    parser.add_argument("--reps", type=int, help="rounds of (one, two), alternating")
    parser.add_argument("--hidden", type=int, help="the model's hidden size")
    parser.add_argument("--mbs", type=int, help="sequences per micro-batch")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    for name in ("mbit", "reps", "hidden", "mbs"):
        if getattr(args, name) is not None:
            s = replace(s, **{name: getattr(args, name)})
    with tempfile.TemporaryDirectory(prefix="fleet-measured-") as tmp:
        result = measure(s, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def measure(s: Setup, tmp: Path) -> dict[str, Any]:
    """Run both sides, predict both, print the table; returns everything as a dict."""
    # One intra-op thread per stage thread: a stage has its device to itself (1 of 2 cores
    # with one pipeline; two pipelines put four stage threads on the two cores).
    torch.set_num_threads(1)
    began = time.monotonic()
    load_before = os.getloadavg()
    model = tiny_model_dir(
        tmp / "m", layers=2, hidden=s.hidden, intermediate=s.hidden, max_shard_size="8MB"
    )
    shape = ModelShape.from_hf_config(json.loads((model / "config.json").read_text()))

    # The planner's splits and shares (the stages are identical, so the compute does not
    # change them; checked again once the compute is calibrated).
    one_plan, two_plan = predict(shape, s, 1.0, s.mbit)
    lanes = [lane_of(p) for p in two_plan.pipelines]
    shares = split_micro_batches(lanes, s.micro_batches)
    if shares != [p.micro_batches for p in two_plan.pipelines]:
        raise RuntimeError(f"split_micro_batches gives {shares}, the plan {two_plan.pipelines}")
    sides = Sides(splits_of(one_plan)[0], splits_of(two_plan), shares)

    data = random_batches(s.steps + 1, s.micro_batches, s.mbs, s.seq, 300)
    warm, timed = data[:1], data[1:]
    for two in (False, True):  # imports, first calls
        run_side(model, sides, two, warm, s, None)
    rows: list[dict[str, Any]] = []
    for rep in range(s.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        for paced in (False, True):
            for two in order:
                got = run_side(model, sides, two, timed, s, s.mbit * MBIT if paced else None)
                row = {"rep": rep, "pipelines": 2 if two else 1, "paced": paced,
                       "load": round(os.getloadavg()[0], 2), **got}  # fmt: skip
                rows.append(row)
                print(
                    f"round {rep}: {row['pipelines']} pipeline(s), "
                    f"{'paced' if paced else 'unpaced'}: {got['tokens_per_s']:,.0f} tokens/s "
                    f"({got['seconds']:.2f} s; load {row['load']})",
                    flush=True,
                )

    def tps(pipelines: int, paced: bool) -> list[float]:
        return [
            r["tokens_per_s"] for r in rows if r["pipelines"] == pipelines and r["paced"] == paced
        ]

    # Measured compute: the unpaced single pipeline's beat, (M + P - 1) beats a step.
    tokens_per_step = s.micro_batches * s.mbs * s.seq
    beats = [
        r["seconds"] / (s.steps * (s.micro_batches + 1))
        for r in rows
        if r["pipelines"] == 1 and not r["paced"]
    ]
    beat = statistics.median(beats)
    tflops = calibrate_tflops(shape, s, beat)
    one_plan, two_plan = predict(shape, s, tflops, s.mbit)
    ran = Sides(
        splits_of(one_plan)[0], splits_of(two_plan), [p.micro_batches for p in two_plan.pipelines]
    )
    if ran != sides:
        raise RuntimeError(f"the calibrated plan is {ran}, the runs used {sides}")
    measured_one, measured_two = tps(1, True), tps(2, True)
    ratios = [b / a for a, b in zip(measured_one, measured_two, strict=True)]
    pred_ratio = two_plan.tokens_per_second / one_plan.tokens_per_second
    one_med, two_med = statistics.median(measured_one), statistics.median(measured_two)
    ratio_med = statistics.median(ratios)
    p1, p2 = one_plan.pipelines[0], two_plan.pipelines
    slow = max(p1.stages, key=lambda st: st.seconds)
    # The link's own time per micro-batch (measured wire bytes down / rate), and each side's
    # measured step in those units: what 1F1B on a pure link would take is M + 1 (one
    # pipeline) and M/2 + 1 (two), plus the sync.
    send = statistics.median(r["down"] for r in rows if r["paced"]) * s.mbs * s.seq
    send /= s.mbit * MBIT
    step_one = tokens_per_step / one_med
    step_two = tokens_per_step / two_med
    result = {
        "setup": s.__dict__,
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - began, 1),
        "splits": {
            "one": [f"{a}-{b - 1}" for a, b in sides.one],
            "two": [[f"{a}-{b - 1}" for a, b in x] for x in sides.two],
        },
        "shares": shares,
        "compute_beat_s": beat,
        "calibrated_tflops": tflops,
        "wire_B_per_token": {
            "measured_down": statistics.median(r["down"] for r in rows if r["paced"]),
            "measured_up": statistics.median(r["up"] for r in rows if r["paced"]),
            "planner_down": p1.stages[0].link_seconds * s.mbit * MBIT / (s.mbs * s.seq),
        },
        "send_s_per_micro_batch": send,
        "measured_step_in_sends": {"one": step_one / send, "two": step_two / send},
        "predicted": {
            "one_tokens_per_s": one_plan.tokens_per_second,
            "two_tokens_per_s": two_plan.tokens_per_second,
            "ratio": pred_ratio,
            "one_beat_s": p1.micro_batch_seconds,
            "one_stage_s": [[st.compute_seconds, st.link_seconds] for st in p1.stages],
            "two_beats_s": [p.micro_batch_seconds for p in p2],
            "two_sync_per_step_s": two_plan.sync.per_step_seconds,
        },
        "measured": {
            "one_tokens_per_s": spread(measured_one),
            "two_tokens_per_s": spread(measured_two),
            "ratio": spread(ratios),
            "one_unpaced_tokens_per_s": spread(tps(1, False)),
            "two_unpaced_tokens_per_s": spread(tps(2, False)),
        },
        "error_pct": {
            "one": 100 * (one_plan.tokens_per_second - one_med) / one_med,
            "two": 100 * (two_plan.tokens_per_second - two_med) / two_med,
            "ratio": 100 * (pred_ratio - ratio_med) / ratio_med,
        },
        "rows": rows,
    }
    print()
    print(
        f"{s.micro_batches} micro-batches of {s.mbs}x{s.seq} tokens per step ({tokens_per_step} "
        f"tokens), {s.steps} timed step(s) per run, {s.reps} rounds; every link {s.mbit:g} Mbit/s "
        f"each way; splits {result['splits']['one']} | {result['splits']['two']}, shares "
        f"{shares}; load average {result['load_before'][0]} before, "
        f"{result['load_after'][0]} after"
    )
    print(
        f"measured compute: {beat * 1e3:.1f} ms per micro-batch (unpaced single pipeline), "
        f"{tflops * 1e3:.1f} GFLOP/s for the planner; wire bytes per token down/up "
        f"{result['wire_B_per_token']['measured_down']:.0f}/"
        f"{result['wire_B_per_token']['measured_up']:.0f} (planner down "
        f"{result['wire_B_per_token']['planner_down']:.0f})"
    )
    print(
        f"a micro-batch's activations take {send:.3f} s on a link; a measured step takes "
        f"{step_one / send:.2f} of those (one pipeline; 1F1B on the link alone: "
        f"{s.micro_batches + 1}) and {step_two / send:.2f} (two; "
        f"{max(shares) + 1} + the sync); the planner's beat is {p1.micro_batch_seconds:.3f} s "
        f"(stage {slow.index}: compute {slow.compute_seconds:.3f}, its busiest link direction "
        f"{slow.side_seconds:.3f} beside it), its step {p1.step_seconds:.3f} s played out; its "
        f"sync {two_plan.sync.per_step_seconds:.3f} s per step"
    )
    print()
    print("| | predicted tok/s | measured tok/s, median (range) | error | unpaced tok/s |")
    print("|---|---|---|---|---|")
    for name, plan_tps, paced_tps, unpaced, err in (
        ("one pipeline", one_plan.tokens_per_second, measured_one, tps(1, False), "one"),
        ("two pipelines", two_plan.tokens_per_second, measured_two, tps(2, False), "two"),
    ):
        print(
            f"| {name} | {plan_tps:,.0f} | {statistics.median(paced_tps):,.0f} "
            f"({min(paced_tps):,.0f}-{max(paced_tps):,.0f}) | {result['error_pct'][err]:+.1f}% | "
            f"{statistics.median(unpaced):,.0f} |"
        )
    print(
        f"| two / one | {pred_ratio:.2f}x | {ratio_med:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
        f"| {result['error_pct']['ratio']:+.1f}% | "
        f"{statistics.median(tps(2, False)) / statistics.median(tps(1, False)):.2f}x |"
    )
    within = all(abs(result["error_pct"][k]) <= 15 for k in ("two", "ratio"))
    print(
        f"\ntwo pipelines >= 1.7x one: {'yes' if ratio_med >= 1.7 else 'NO'} "
        f"({ratio_med:.2f}x); two pipelines and the ratio within 15% of the prediction: "
        f"{'yes' if within else 'NO'}; {result['seconds']:.0f} s"
    )
    return result


if __name__ == "__main__":
    main()
