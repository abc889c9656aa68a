"""Planner benchmark: how long planning takes, and how much better its plans are predicted to
be than the usual recipes. Plain script; prints tables.

    .venv/bin/python bench/bench_planner.py

1. Plan time for 64 GPUs (four kinds) and an 80-layer model (Llama-3-70B shape).
2. On several heterogeneous fleets: predicted tokens/s of our plan against
   - "even": every GPU of the fleet (fastest first, at most one per layer), layers split evenly;
   - "tflops": the same GPUs, layers in proportion to each GPU's dense TFLOPS;
   - "tflops@ours": our GPUs in our order, layers in proportion to TFLOPS (isolates the split).
   All are priced by the same cost model; a baseline that overflows a GPU's memory is "OOM".
3. The heuristic (used when the sequences are too many to try) against exhaustive search on
   random mid-sized fleets: the gap in predicted step time.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    ModelShape,
    Plan,
    PlanError,
    Pool,
    TrainingShape,
    assess,
    plan,
)

LLAMA3_8B = ModelShape(32, 4096, 14336, 32, 8, 128, 128256)
LLAMA2_13B = ModelShape(40, 5120, 13824, 40, 40, 128, 32000)
LLAMA3_70B = ModelShape(80, 8192, 28672, 64, 8, 128, 128256)

H100, A100_80, A100_40 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-SXM4-40GB"
L40S, RTX4090, RTX3090 = "NVIDIA-L40S", "NVIDIA-GeForce-RTX-4090", "NVIDIA-GeForce-RTX-3090"
V100_32, V100_16, A10 = "Tesla-V100-SXM2-32GB", "Tesla-V100-SXM2-16GB", "NVIDIA-A10"

# (name, description, model, training, pools)
FLEETS = [
    (
        "lab",
        "2 H100 (1G/10ms), 2 A100-40 (1G/20ms), 4 RTX4090 (500M/30ms); 8B LoRA",
        LLAMA3_8B,
        TrainingShape(1, 16, 2048, method="lora"),
        [
            Pool("h100", H100, 2, 1000, 10),
            Pool("a100", A100_40, 2, 1000, 20),
            Pool("4090", RTX4090, 4, 500, 30),
        ],
    ),
    (
        "consumer",
        "4 RTX4090 + 4 RTX3090 (1G/10ms); 8B LoRA (needs >= 2 cards)",
        LLAMA3_8B,
        TrainingShape(1, 32, 1024, method="lora"),
        [Pool("4090", RTX4090, 4, 1000, 10), Pool("3090", RTX3090, 4, 1000, 10)],
    ),
    (
        "old+new",
        "1 H100 + 6 V100-32 (1G/10ms), fp16; 13B LoRA",
        LLAMA2_13B,
        TrainingShape(1, 32, 2048, method="lora", dtype="float16"),
        [Pool("h100", H100, 1, 1000, 10), Pool("v100", V100_32, 6, 1000, 10)],
    ),
    (
        "dc+consumer",
        "4 A100-80 (1G/10ms), 4 L40S (1G/20ms), 8 RTX3090 (300M/40ms); 70B QLoRA",
        LLAMA3_70B,
        TrainingShape(1, 32, 1024, method="qlora", compression="int4"),
        [
            Pool("a100", A100_80, 4, 1000, 10),
            Pool("l40s", L40S, 4, 1000, 20),
            Pool("3090", RTX3090, 8, 300, 40),
        ],
    ),
    (
        "swarm",
        "12 RTX4090 + 12 A10 (200M/50ms); 70B QLoRA, int4",
        LLAMA3_70B,
        TrainingShape(1, 64, 1024, method="qlora", compression="int4"),
        [Pool("4090", RTX4090, 12, 200, 50), Pool("a10", A10, 12, 200, 50)],
    ),
    (
        "64-gpu",
        "16 each of H100, A100-80 (1G/10ms), L40S, RTX4090 (500M/30ms); 70B QLoRA",
        LLAMA3_70B,
        TrainingShape(1, 64, 2048, method="qlora"),
        [
            Pool("h100", H100, 16, 1000, 10),
            Pool("a100", A100_80, 16, 1000, 10),
            Pool("l40s", L40S, 16, 500, 30),
            Pool("4090", RTX4090, 16, 500, 30),
        ],
    ),
]


def proportional(weights: list[float], layers: int) -> list[int]:
    """Largest-remainder rounding of ``layers`` in proportion to ``weights``, each >= 1."""
    total = sum(weights)
    raw = [layers * w / total for w in weights]
    counts = [max(1, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(counts) < layers:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > layers:
        j = max(range(len(counts)), key=lambda k: counts[k] - raw[k])
        counts[j] -= 1
    return counts


def baseline(model, training, pools, names: list[str], weights: list[float]) -> Plan:
    counts = proportional(weights, model.num_layers)
    return assess(model, training, pools, list(zip(names, counts, strict=True)))


def fmt(p: Plan | None, ours: Plan) -> str:
    if p is None:
        return "n/a"
    if not p.fits:
        return "OOM"
    return f"{p.tokens_per_second:,.0f} ({ours.tokens_per_second / p.tokens_per_second:.2f}x)"


def compare_fleets() -> None:
    print("\n## Predicted tokens/s: ours vs even split vs layers-proportional-to-TFLOPS")
    print("(x = how many times faster our plan is predicted to be; OOM = a GPU overflows;")
    print(" @ours = our GPUs in our order with that split; n/a = our plan has one stage)\n")
    print(
        "| fleet | ours: stages, bottleneck | ours tok/s | even | tflops | even@ours "
        "| tflops@ours |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, _description, model, training, pools in FLEETS:
        ours = plan(model, training, pools)
        flops = {p.name: DEFAULT_CATALOG[p.product].peak_flops(training.dtype) for p in pools}
        gpus = sorted((p.name for p in pools for _ in range(p.gpus)), key=lambda n: -flops[n])[
            : model.num_layers
        ]
        even = baseline(model, training, pools, gpus, [1.0] * len(gpus))
        prop = baseline(model, training, pools, gpus, [flops[n] for n in gpus])
        our_names = [s.pool for s in ours.stages]
        multi = len(our_names) > 1
        even_ours = baseline(model, training, pools, our_names, [1.0] * len(our_names))
        prop_ours = baseline(model, training, pools, our_names, [flops[n] for n in our_names])
        b = ours.bottleneck
        print(
            f"| {name} | {len(ours.stages)}, stage {b.stage} {b.resource} | "
            f"{ours.tokens_per_second:,.0f} | {fmt(even, ours)} | {fmt(prop, ours)} | "
            f"{fmt(even_ours if multi else None, ours)} | "
            f"{fmt(prop_ours if multi else None, ours)} |"
        )
    print()
    for name, description, *_ in FLEETS:
        print(f"- {name}: {description}")


def plan_time() -> None:
    _, _, model, training, pools = FLEETS[-1]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        result = plan(model, training, pools)
        times.append(time.perf_counter() - start)
    print("\n## Plan time: 64 GPUs (4 kinds x 16), 80 layers\n")
    print(
        f"- median of 3: {statistics.median(times):.3f} s ({result.search}, "
        f"{result.sequences_evaluated} sequences evaluated, {len(result.stages)} stages)"
    )


def heuristic_gap(instances: int = 40, seed: int = 7) -> None:
    rng = random.Random(seed)
    kinds = [H100, A100_80, A100_40, L40S, RTX4090, RTX3090, A10]
    gaps, heur_t, exh_t, misses = [], [], [], 0
    done = 0
    while done < instances:
        chosen = rng.sample(kinds, 3)
        pools = [
            Pool(
                f"p{i}", k, rng.randint(1, 3), rng.choice([200, 500, 1000]), rng.choice([5, 20, 50])
            )
            for i, k in enumerate(chosen)
        ]
        model = rng.choice([LLAMA3_8B, LLAMA2_13B])
        training = TrainingShape(
            1,
            rng.choice([8, 16, 32]),
            rng.choice([1024, 2048]),
            method=rng.choice(["lora", "qlora"]),
            compression=rng.choice(["int8", "int4"]),
        )
        try:
            start = time.perf_counter()
            exact = plan(model, training, pools, exhaustive_limit=10**9)
            exh_t.append(time.perf_counter() - start)
        except PlanError:
            continue
        start = time.perf_counter()
        try:
            heur = plan(model, training, pools, exhaustive_limit=0)
        except PlanError:
            misses += 1
            done += 1
            continue
        heur_t.append(time.perf_counter() - start)
        gaps.append(heur.step_seconds / exact.step_seconds - 1)
        done += 1
    print(f"\n## Heuristic vs exhaustive ({instances} random fleets of 3 kinds x 1-3 GPUs)\n")
    print(
        f"- equal (gap < 1e-9): {sum(g < 1e-9 for g in gaps)}/{len(gaps)}; "
        f"mean gap {100 * statistics.mean(gaps):.2f}%, max gap {100 * max(gaps):.2f}%; "
        f"heuristic found no fit where one exists: {misses}"
    )
    print(
        f"- time: heuristic median {1000 * statistics.median(heur_t):.1f} ms, "
        f"exhaustive median {1000 * statistics.median(exh_t):.1f} ms"
    )


if __name__ == "__main__":
    plan_time()
    compare_fleets()
    heuristic_gap()
