"""Re-plan benchmark (issue 23): how long `plan_growth` takes to decide which pipelines to
add to a running job when GPUs become free, on 4 GPU types x 32 GPUs. Plain script; prints
a table. Figures are the cost model's predictions and this machine's planning time.

    .venv/bin/python bench/bench_replan.py           # about 3 s on the 2-core dev VM
    .venv/bin/python bench/bench_replan.py --quick   # one repetition a case, not 3

The fleet is bench/bench_planner.py's "64-gpu" one grown to 32 GPUs of each type (H100,
A100-80GB, L40S, RTX 4090; 128 GPUs), Llama-3-70B QLoRA, 64 and 1,024 micro-batches per
step, synchronous and periodic (every 8 steps) sync. Each case plans a job with
`plan_fleet` on what was free when it started, then frees more and times `plan_growth`
(the running pipelines kept): a pool that joins whole, half of every pool freed, and 8 GPUs
of one type freed. The issue's target: at most 1 s a re-plan (median and max over cases).
For comparison, `plan_fleet` on the whole fleet afresh (which may move running pipelines).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_planner import FLEETS  # noqa: E402
from relaytrain_operator.domain.planner import Pool, Sync, plan_fleet  # noqa: E402
from relaytrain_operator.domain.planner.growth import plan_growth  # noqa: E402

TARGET_SECONDS = 1.0


def _cases(pools: list[Pool]) -> list[tuple[str, list[Pool], list[Pool]]]:
    """(what changed, the pools the job started on, the pools freed since)."""
    whole = [replace(p, gpus=32, nodes=32) for p in pools]
    half = [replace(p, gpus=16, nodes=16) for p in pools]
    return [
        ("an RTX 4090 pool of 32 joins", whole[:3], whole[3:]),
        ("half of every pool freed", half, half),
        ("8 H100 freed", [replace(whole[0], gpus=24), *whole[1:]], [replace(whole[0], gpus=8)]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repetition a case, not 3")
    args = parser.parse_args()
    repeat = 1 if args.quick else 3
    _, _, model, training, pools = next(f for f in FLEETS if f[0] == "64-gpu")
    whole = [replace(p, gpus=32, nodes=32) for p in pools]
    print("| change | M | sync | running | added | tokens/s before → after | pays | re-plan s | "
          "afresh: tokens/s, s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    seconds: list[float] = []
    for label, started, freed in _cases(pools):
        for m in (64, 1024):
            shape = replace(training, micro_batches=m)
            for sync in (Sync(), Sync("periodic", every=8)):
                start = plan_fleet(model, shape, started, sync=sync)
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    growth = plan_growth(
                        model, shape, start.pipelines, whole, freed, steps_left=10_000,
                        sync=sync,
                    )  # fmt: skip
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                fresh = plan_fleet(model, shape, whole, sync=sync)
                afresh = time.perf_counter() - t0
                took = statistics.median(times)
                seconds.append(took)
                print(
                    f"| {label} | {m} | {sync.mode} | {len(start.pipelines)} | "
                    f"{len(growth.added)} | {growth.tokens_per_second_before:,.0f} → "
                    f"{growth.tokens_per_second_after:,.0f} | {'yes' if growth.pays else 'no'} | "
                    f"{took:.3f} | {fresh.tokens_per_second:,.0f}, {afresh:.3f} |"
                )
    worst = max(seconds)
    print(
        f"\nRe-plan time over {len(seconds)} cases: median {statistics.median(seconds):.3f} s, "
        f"max {worst:.3f} s (target ≤ {TARGET_SECONDS:g} s: "
        f"{'met' if worst <= TARGET_SECONDS else 'MISSED'})."
    )


if __name__ == "__main__":
    main()
