"""Fleet planner benchmark: several pipelines against the best single pipeline, and how long
planning them takes. Plain script; prints tables. Every figure is the cost model's prediction
(operator/relaytrain_operator/domain/planner/), not a measured run.

    .venv/bin/python bench/bench_fleet_plan.py            # about 40 s on the 2-core dev VM
    .venv/bin/python bench/bench_fleet_plan.py --quick    # fewer random fleets in section 4
    .venv/bin/python bench/bench_fleet_plan.py --json OUT # also every row as JSON

1. The local cluster's fleet (hack/pools.yaml: 2 H100, 2 A100-40GB, 4 RTX 4090, 2 V100-16GB)
   with Llama-3.1-8B (the shipped config.json) and examples/finetunejob-lora.yaml's settings
   (LoRA r8 on q/k/v/o, 4 x 256 tokens per micro-batch, bf16, int8 links), 64 micro-batches
   per step: the best single pipeline (what `plan()` gives today) against several pipelines
   with the sync unpriced, synchronous (the worker's all-gather of the fp32 LoRA gradients
   every step; a ring; the issue's assumption, a ring of bf16 gradients) and periodic; and
   two bounds: the best set's pipelines at steady state (4,096 micro-batches, no fill and
   drain, no sync), and every GPU alone (the whole model on it, memory ignored: DESIGN.md's
   fleet-use denominator).
2. Six heterogeneous fleets (bench/bench_planner.py's): the same comparison.
3. Plan time: 64 GPUs (4 kinds x 16) x 80 layers, 4 kinds x 32 nodes (128 GPUs), and 64
   GPUs of 16-24 GB (RTX 4090, RTX 3090, A10, V100-16GB; 70B QLoRA fp16: 7+ stages).
4. The set search's greedy start (no branch and bound) against the exhaustive search on
   random small fleets.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_planner import (  # noqa: E402
    A10,
    A100_40,
    A100_80,
    FLEETS,
    H100,
    L40S,
    LLAMA2_13B,
    LLAMA3_8B,
    RTX3090,
    RTX4090,
    V100_16,
)
from relaytrain_operator.domain.planner import (  # noqa: E402
    CostSettings,
    FleetPlan,
    ModelShape,
    PlanError,
    Pool,
    Sync,
    TrainingShape,
    assess,
    plan,
    plan_fleet,
    pools_from_file,
)

LLAMA_31_8B = ModelShape.from_hf_config(
    json.loads((ROOT / "operator/relaytrain_operator/known_models/llama-3.1-8b.json").read_text())
)
#: "Sync unpriced": a periodic sync so rare that its share of a step is nil.
UNPRICED = Sync("periodic", 10**12)
STEADY_MICRO_BATCHES = 4096


def describe(f: FleetPlan) -> str:
    shapes: dict[str, int] = {}
    for p in f.pipelines:
        key = "+".join(s.pool for s in p.stages)
        shapes[key] = shapes.get(key, 0) + 1
    return ", ".join(f"{n}x[{k}]" for k, n in shapes.items())


def alone(model: ModelShape, training: TrainingShape, pools: list[Pool]) -> float:
    """Tokens/s of every GPU running the whole model by itself, memory ignored."""
    total = 0.0
    for pool in pools:
        try:
            one = assess(model, training, pools, [(pool.name, model.num_layers)])
        except PlanError:
            continue  # a pool the dtype leaves out
        total += pool.gpus * one.tokens_per_second
    return total


def steady(model: ModelShape, training: TrainingShape, pools: list[Pool]) -> FleetPlan:
    many = replace(training, micro_batches=STEADY_MICRO_BATCHES)
    return plan_fleet(model, many, pools, sync=UNPRICED)


def lab() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pools = pools_from_file(yaml.safe_load((ROOT / "hack/pools.yaml").read_text()))
    ring = CostSettings(sync_collective="ring")
    print("## 1. hack/pools.yaml, Llama-3.1-8B LoRA, int8 links, 64 micro-batches of 4x256\n")
    print("| dtype | plan | pipelines | GPUs | tokens/s | x single | sync/step |")
    print("|---|---|---|---|---|---|---|")
    for dtype in ("bfloat16", "float16"):
        training = TrainingShape(4, 64, 256, compression="int8", dtype=dtype)
        single = plan(LLAMA_31_8B, training, pools)
        usable = sum(p.gpus for p in pools) - (2 if dtype == "bfloat16" else 0)

        def row(name: str, f: FleetPlan, *, usable: int = usable, dtype: str = dtype) -> None:
            sync = f.sync.per_step_seconds
            out.append({
                "section": "lab", "dtype": dtype, "plan": name, "shape": describe(f),
                "pipelines": len(f.pipelines), "gpus": f.gpus, "usable_gpus": usable,
                "tokens_per_s": f.tokens_per_second, "speedup": f.speedup,
                "sync_per_step_s": sync,
            })  # fmt: skip
            shape = f": {describe(f)}" if len(f.pipelines) > 1 else ""
            print(
                f"| {dtype} | {name}{shape} | {len(f.pipelines)} | {f.gpus} of {usable} | "
                f"{f.tokens_per_second:,.0f} | {f.speedup:.2f} | "
                f"{f'{sync:.3g}s' if sync > 1e-9 else '0'} |"
            )

        row("best single pipeline (today)", plan_fleet(LLAMA_31_8B, training, pools, replicas=1))
        row("several, sync unpriced", plan_fleet(LLAMA_31_8B, training, pools, sync=UNPRICED))
        row("several, synchronous (auto)", plan_fleet(LLAMA_31_8B, training, pools))
        six = plan_fleet(LLAMA_31_8B, training, pools, replicas=6)
        row("several, synchronous, 6 pipelines", six)
        for h in (4, 8, 16):
            row(
                f"several, periodic every {h}",
                plan_fleet(LLAMA_31_8B, training, pools, sync=Sync("periodic", h)),
            )
        row(
            "several, synchronous, ring (auto)",
            plan_fleet(LLAMA_31_8B, training, pools, settings=ring),
        )
        # The issue's assumption: the six pipelines, a ring of bf16 gradients (half the fp32
        # bytes), no token-count exchange.
        s = plan_fleet(LLAMA_31_8B, training, pools, settings=ring, replicas=6).sync
        r = s.pipelines
        issue = 2 * (r - 1) / r * s.load_seconds / 2 + 2 * (r - 1) * s.hop_latency_seconds
        tps = six.micro_batches * six.tokens_per_micro_batch / (six.pipeline_seconds + issue)
        out.append({
            "section": "lab", "dtype": dtype, "plan": "issue's assumption", "shape": describe(six),
            "pipelines": 6, "gpus": six.gpus, "usable_gpus": usable, "tokens_per_s": tps,
            "speedup": tps / single.tokens_per_second, "sync_per_step_s": issue,
        })  # fmt: skip
        print(
            f"| {dtype} | issue's assumption: 6 pipelines, ring of bf16 LoRA gradients, no token "
            f"counts | 6 | {six.gpus} of {usable} | {tps:,.0f} | "
            f"{tps / single.tokens_per_second:.2f} | {issue:.3g}s |"
        )
        bound = steady(LLAMA_31_8B, training, pools)
        rate = sum(p.micro_batches for p in bound.pipelines) * training.tokens_per_micro_batch
        rate /= bound.pipeline_seconds
        each = alone(LLAMA_31_8B, training, pools)
        out.append({
            "section": "lab", "dtype": dtype, "plan": "bound: steady state",
            "shape": describe(bound), "pipelines": len(bound.pipelines), "gpus": bound.gpus,
            "usable_gpus": usable, "tokens_per_s": rate,
            "speedup": rate / single.tokens_per_second, "sync_per_step_s": None,
        })  # fmt: skip
        out.append({
            "section": "lab", "dtype": dtype, "plan": "bound: every GPU alone", "shape": "",
            "pipelines": None, "gpus": usable, "usable_gpus": usable, "tokens_per_s": each,
            "speedup": each / single.tokens_per_second, "sync_per_step_s": None,
        })  # fmt: skip
        print(
            f"| {dtype} | bound: best set at steady state ({STEADY_MICRO_BATCHES} micro-batches, "
            f"no sync): {describe(bound)} | {len(bound.pipelines)} | {bound.gpus} of {usable} | "
            f"{rate:,.0f} | {rate / single.tokens_per_second:.2f} | - |"
        )
        print(
            f"| {dtype} | bound: every GPU alone, memory ignored | - | {usable} | {each:,.0f} | "
            f"{each / single.tokens_per_second:.2f} | - |"
        )
    print()
    return out


def fleets() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    print("## 2. Six heterogeneous fleets (bench/bench_planner.py's)\n")
    print(
        "| fleet | single: GPUs, tok/s | synchronous | periodic every 8 | sync unpriced "
        "| fleet use: sync. / periodic / unpriced |"
    )
    print("|---|---|---|---|---|---|")
    for name, _description, model, training, pools in FLEETS:
        single = plan(model, training, pools)
        cells, uses = [], []
        each = alone(model, training, pools)
        row: dict[str, Any] = {
            "section": "fleets", "fleet": name, "micro_batches": training.micro_batches,
            "single": {"stages": len(single.stages), "tokens_per_s": single.tokens_per_second},
        }  # fmt: skip
        for key, sync in (
            ("synchronous", Sync()), ("periodic_8", Sync("periodic", 8)), ("unpriced", UNPRICED)
        ):  # fmt: skip
            f = plan_fleet(model, training, pools, sync=sync)
            row[key] = {
                "pipelines": len(f.pipelines), "gpus": f.gpus, "shape": describe(f),
                "tokens_per_s": f.tokens_per_second, "speedup": f.speedup,
            }  # fmt: skip
            cells.append(
                f"{len(f.pipelines)} on {f.gpus} GPUs, {f.tokens_per_second:,.0f} "
                f"({f.speedup:.2f}x)"
            )
            row[key]["fleet_use"] = f.tokens_per_second / each
            uses.append(f"{f.tokens_per_second / each:.2f}")
        out.append(row)
        print(
            f"| {name} (M={training.micro_batches}) | {len(single.stages)}, "
            f"{single.tokens_per_second:,.0f} | {' | '.join(cells)} | {' / '.join(uses)} |"
        )
    print()
    print(
        "Fleet use: each plan's tokens/s over every GPU alone (memory ignored; DESIGN.md's"
        " target: >= 0.8).\n"
    )
    return out


def plan_time() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    print("## 3. Plan time (median of 3, synchronous and periodic every 8)\n")
    _, _, model, training, pools = FLEETS[-1]
    big = [replace(p, gpus=32, nodes=32) for p in pools]
    more = replace(training, micro_batches=1024)
    # The harder case: GPUs of 16-24 GB, so a pipeline of the 70B needs 7 stages or more.
    small = [
        Pool("4090", RTX4090, 16, 500, 30),
        Pool("3090", RTX3090, 16, 500, 30),
        Pool("a10", A10, 16, 1000, 10),
        Pool("v100", V100_16, 16, 1000, 10),
    ]
    fp16 = replace(training, dtype="float16")
    cases = [
        ("64 GPUs (4 kinds x 16) x 80 layers, M=64", pools, training, 1.0),
        ("4 kinds x 32 nodes (128 GPUs) x 80 layers, M=64", big, training, 5.0),
        ("4 kinds x 32 nodes (128 GPUs) x 80 layers, M=1024", big, more, 5.0),
        ("64 GPUs of 16-24 GB (4 kinds x 16) x 80 layers, fp16, M=64", small, fp16, 5.0),
    ]
    for label, fleet, shape, target in cases:
        for sync in (Sync(), Sync("periodic", 8)):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                f = plan_fleet(model, shape, fleet, sync=sync)
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            out.append({
                "section": "plan_time", "case": label, "sync": sync.mode, "seconds": t,
                "target_s": target, "pipelines": len(f.pipelines), "gpus": f.gpus,
                "speedup": f.speedup, "search": f.search,
            })  # fmt: skip
            print(
                f"- {label}, {sync.mode}: {t:.3f} s (target < {target:g} s: "
                f"{'met' if t < target else 'MISSED'}); {len(f.pipelines)} pipelines on {f.gpus} "
                f"GPUs, {f.speedup:.2f}x; search {f.search}, {f.candidates} candidates, "
                f"{f.sets_evaluated} sets priced"
            )
    print()
    return out


def greedy_gap(instances: int, seed: int = 11) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds = [H100, A100_80, A100_40, L40S, RTX4090, RTX3090, A10]
    gaps, fast_t, exact_t, done, tries = [], [], [], 0, 0
    while done < instances and tries < 20 * instances:
        tries += 1
        pools = [
            Pool(
                f"p{i}", k, rng.randint(1, 4), rng.choice([200, 500, 1000]), rng.choice([5, 20, 50])
            )
            for i, k in enumerate(rng.sample(kinds, 3))
        ]
        model = rng.choice([LLAMA3_8B, LLAMA2_13B])
        training = TrainingShape(
            1,
            rng.choice([16, 32, 64]),
            rng.choice([512, 2048]),
            method=rng.choice(["lora", "qlora"]),
            compression=rng.choice(["int8", "int4"]),
        )
        sync = rng.choice([Sync(), Sync("periodic", 8), UNPRICED])
        try:
            start = time.perf_counter()
            exact = plan_fleet(model, training, pools, sync=sync, set_budget=10**7)
            exact_t.append(time.perf_counter() - start)
        except PlanError:
            continue
        start = time.perf_counter()
        fast = plan_fleet(model, training, pools, sync=sync, set_budget=0)
        fast_t.append(time.perf_counter() - start)
        gaps.append(fast.step_seconds / exact.step_seconds - 1)
        done += 1
    print(
        f"## 4. Greedy start vs exhaustive set search ({done} random fleets, 3 kinds x 1-4 GPUs)\n"
    )
    print(
        f"- equal (gap < 1e-9): {sum(g < 1e-9 for g in gaps)}/{len(gaps)}; "
        f"mean gap {100 * statistics.mean(gaps):.2f}%, max gap {100 * max(gaps):.2f}%"
    )
    print(
        f"- time: greedy start median {1000 * statistics.median(fast_t):.1f} ms, "
        f"exhaustive median {1000 * statistics.median(exact_t):.1f} ms, "
        f"max {1000 * max(exact_t):.0f} ms"
    )
    return {
        "section": "greedy_gap", "fleets": len(gaps), "equal": sum(g < 1e-9 for g in gaps),
        "mean_gap": statistics.mean(gaps), "max_gap": max(gaps),
        "greedy_median_s": statistics.median(fast_t),
        "exhaustive_median_s": statistics.median(exact_t),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="10 random fleets in section 4, not 40"
    )
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args()
    rows = [*lab(), *fleets(), *plan_time(), greedy_gap(10 if args.quick else 40)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
