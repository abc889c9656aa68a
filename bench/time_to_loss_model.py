"""Time to a target loss, ``delta`` against ``int8``, projected from a measured run to other
models and GPUs: what issue 24's goal (3x faster over 100 Mbit/s with 50 ms each way) takes.

Run: .venv/bin/python bench/time_to_loss_model.py [--steps-int8 N] [--steps-delta N]
    [--bandwidth-ratio R] [--json OUT]

The inputs are what bench/bench_delta_boundary.py measured on 2026-11-30 (the fine-tune,
``delta:int3+basis`` with a quarter of the gradients' tokens, to none's final loss + 1 %):
int8 reached the target after 35 steps and ``delta`` after 47, and over those steps
``delta``'s busiest link direction carried 3.57x fewer bytes than int8's (the ratio's
bandwidth term: its bytes per step and its extra steps both in it).

A step's time, in a pipeline whose stages compute while their links send (1F1B keeps the
stages busy with other micro-batches), is taken as the slowest of its three resources, plus
the latencies no schedule hides::

    step = max(compute, codec, bytes / rate) + 2 (P - 1) latency

``compute`` is the step's tokens over the pipeline's tokens/s (``--tokens-per-second``),
``codec`` the ``delta`` encoder's time for the step's activation values (the planner's
`cost.DELTA_FORWARD_CODEC_SECONDS`, measured on an H200; 0 for int8), ``bytes`` the step's
int8 bytes in the busiest direction of a boundary (hidden x tokens x
`cost.WIRE_BYTES`["int8"]), and ``delta``'s those over the bandwidth ratio, spread over its
steps. Both codes are given the overlap; the first row checks the model against the
measured run, whose CPU stages were timed per step (``--step-compute``).

Each row: both times to the target and their ratio; then the ratio had ``delta`` reached
the target in as many steps as int8 with the same bytes a step (its learning as fast; a
little optimistic, as its early steps carry more bytes than its average); then the fewest
seconds of int8 bytes a step at which 3x is reached, at that compute ("never": not even
where the link is everything, the bandwidth ratio being below 3x).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "worker_image")]

from relaytrain_operator.domain.planner.cost import (  # noqa: E402
    DELTA_FORWARD_CODEC_SECONDS,
    WIRE_BYTES,
)

RATE = 100e6 / 8
"""The link: 100 Mbit/s each way, bytes per second."""
LATENCY = 0.05
"""One way, seconds."""
STAGES = 4
GOAL = 3.0


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    tokens: int
    """Tokens a step (every micro-batch's)."""
    compute: tuple[float, float]
    """Seconds of compute a step: (int8, delta), the codec's CPU time inside where measured."""
    codec: bool
    """Whether ``delta``'s encoder is charged apart (a GPU stage's, overlapped)."""


@dataclass(frozen=True)
class Projection:
    case: str
    int8_seconds: float
    delta_seconds: float
    ratio: float
    ratio_equal_steps: float
    int8_link_seconds_a_step: float
    int8_link_seconds_for_goal: float | None


def step_seconds(compute: float, codec: float, link: float) -> float:
    return max(compute, codec, link) + 2 * (STAGES - 1) * LATENCY


def project(case: Case, steps_int8: int, steps_delta: int, bandwidth: float) -> Projection:
    link8 = case.hidden * case.tokens * WIRE_BYTES["int8"] / RATE
    codec = case.hidden * case.tokens * DELTA_FORWARD_CODEC_SECONDS if case.codec else 0.0

    def times(link: float, steps: int = steps_delta) -> tuple[float, float]:
        linkd = steps_int8 * link / (bandwidth * steps_delta)  # delta's bytes a step, measured
        t8 = steps_int8 * step_seconds(case.compute[0], 0.0, link)
        return t8, steps * step_seconds(case.compute[1], codec, linkd)

    t8, td = times(link8)
    e8, ed = times(link8, steps_int8)
    lo, hi = 0.0, 1e6  # the int8 link seconds a step at which the ratio reaches GOAL
    for _ in range(200):
        mid = (lo + hi) / 2
        a, b = times(mid)
        lo, hi = (mid, hi) if a / b < GOAL else (lo, mid)
    top = times(1e6)
    return Projection(
        case=case.name,
        int8_seconds=t8,
        delta_seconds=td,
        ratio=t8 / td,
        ratio_equal_steps=e8 / ed,
        int8_link_seconds_a_step=link8,
        int8_link_seconds_for_goal=hi if top[0] / top[1] >= GOAL else None,
    )


def cases(rate: float, rows: int) -> list[Case]:
    """The measured run, then an 8B's frames over GPU stages computing ``rate`` tokens/s."""
    tokens = rows * 2048
    gpu = tokens / rate
    eight_b = f"Llama-3.1-8B shape, {rows} rows of 2048 a step, {rate:,.0f} tokens/s"
    return [
        # The measured run: tiny Llama (hidden 256), 2 micro-batches of 4 rows of 64 tokens,
        # CPU stages: a step's compute over loopback 0.25 s (int8) and 0.61 s (delta, its
        # codec on the CPU inside).
        Case("bench_delta_boundary.py as run (CPU stages)", 256, 512, (0.25, 0.61), False),
        Case(eight_b, 4096, tokens, (gpu, gpu), True),
        Case(
            f"the same, 4x the compute ({4 * rate:,.0f} tokens/s)",
            4096,
            tokens,
            (gpu / 4,) * 2,
            True,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-int8", type=int, default=35)
    parser.add_argument("--steps-delta", type=int, default=47)
    parser.add_argument("--bandwidth-ratio", type=float, default=3.57)
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=12_000.0,
        help="the GPU pipeline's compute (default: issue 24's four RTX 4090s on an 8B LoRA)",
    )
    parser.add_argument("--rows", type=int, default=8, help="rows of 2048 tokens a step")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [
        project(c, args.steps_int8, args.steps_delta, args.bandwidth_ratio)
        for c in cases(args.tokens_per_second, args.rows)
    ]
    print(
        f"100 Mbit/s, {LATENCY * 1000:.0f} ms each way, {STAGES} stages; int8 {args.steps_int8}"
        f" steps to the target, delta {args.steps_delta}, bandwidth ratio"
        f" {args.bandwidth_ratio:.2f}\n"
    )
    print(
        "| case | int8 link a step | int8 | delta | delta vs int8 | at equal steps |"
        " int8 link a step for 3x |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        need = r.int8_link_seconds_for_goal
        goal = "never" if need is None else f"{need:.2f} s"
        print(
            f"| {r.case} | {r.int8_link_seconds_a_step:.3f} s | {r.int8_seconds:.1f} s"
            f" | {r.delta_seconds:.1f} s | {r.ratio:.2f}x | {r.ratio_equal_steps:.2f}x | {goal} |"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
