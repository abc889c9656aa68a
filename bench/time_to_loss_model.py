"""Time to a target loss, ``delta`` against ``int8``, projected from a measured run to other
models and GPUs: what issue 24's goal (3x faster over 100 Mbit/s with 50 ms each way) takes.

Run: .venv/bin/python bench/time_to_loss_model.py [--steps-int8 N] [--steps-delta N]
    [--bandwidth-ratio R|R,R,R] [--gradient-ratio G|G,G,G] [--tokens-per-second T] [--rows R]
    [--micro-batches M] [--ahead K|best] [--json OUT]

The inputs are what bench/bench_delta_boundary.py measured on 2026-11-30 (the fine-tune,
``delta:int3+basis`` with a quarter of the gradients' tokens, to none's final loss + 1 %):
int8 reached the target after 35 steps and ``delta`` after 47, and over those steps
``delta``'s busiest link direction carried 3.57x fewer bytes than int8's (the ratio's
bandwidth term: its bytes per step and its extra steps both in it).

A step's time is 1F1B played out event by event (`steptime.step_seconds`): every
stage computes its micro-batches in the worker's order, each frame queues on its link's
direction for its bytes over the rate and arrives a latency later, a ``delta`` stage codes
on its encoder beside its compute. Its inputs, per micro-batch and stage:

- compute: the step's tokens over the pipeline's tokens/s (``--tokens-per-second``) over
  the micro-batches (``--micro-batches``, default one row each);
- a frame's send: int8's bytes (hidden x tokens x `link_cost.WIRE_BYTES`["int8"]) over the rate;
  ``delta``'s, both directions, those over the bandwidth ratio spread over its steps (its
  busiest direction's ratio: its gradients' frames, smaller at a share of the tokens, are
  charged as much), or with ``--gradient-ratio`` the gradients' frames over a ratio of their
  own (int8's gradients' bytes over delta's, each over its steps to the target: the
  backward's way up the links and 1F1B's gradient sends take their own bytes' time); with
  one ratio a link (``5.66,5.07,4.90``, as bench_delta_boundary.py prints them) each link
  carries its own boundary's bytes, where one ratio charges every link at the busiest
  boundary's, a bound from below on ``delta``'s gain where its boundaries differ (its
  timed runs' model, each link at its own bytes, came within 1.4 % of them, 2026-12-08);
- ``delta``'s encoder: the planner's `link_cost.DELTA_FORWARD_CODEC_SECONDS` (measured on an
  H200) a value for an activation frame, `link_cost.DELTA_BACKWARD_CODEC_SECONDS` for a
  gradient frame; int8's code is charged nothing.

The first row checks the model against the measured run (CPU stages, 2 micro-batches a
step, each code's step over loopback as measured: 0.25 s and 0.61 s, its codec inside).
Until 2026-12-01 the model was ``max(compute, codec, busiest direction's bytes / rate) +
2 (P - 1) latency``; over a link slow enough that the bytes decide, a step also takes the
last micro-batch's way down through every link and its gradient's way back up, and with
more micro-batches than stages 1F1B's window (bench_delta_boundary.py at 2 Mbit/s: int8
measured 38.7 s for 16 steps, 39.9 s this model, 13.8 s the old one;
bench_pipeline_time.py).

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "operator"), str(REPO / "worker_image")]

from relaytrain_operator.domain.planner.link_cost import (  # noqa: E402
    DELTA_BACKWARD_CODEC_SECONDS,
    DELTA_FORWARD_CODEC_SECONDS,
    WIRE_BYTES,
)
from relaytrain_operator.domain.planner.steptime import (  # noqa: E402
    StepShape,
    calibrate,
    step_seconds,
)

RATE = 100e6 / 8
"""The link: 100 Mbit/s each way, bytes per second."""
LATENCY = 0.05
"""One way, seconds."""
STAGES = 4
GOAL = 3.0


def steps_to(losses: Sequence[float], target: float) -> int | None:
    """Steps until a run's eval loss (``losses``, one a step) is first at or below
    ``target``; None: never. How the benches read the steps this model takes as input."""
    return next((s + 1 for s, loss in enumerate(losses) if loss <= target), None)


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    tokens: int
    """Tokens a step (every micro-batch's)."""
    micros: int
    compute: tuple[float, float]
    """A stage's seconds for one micro-batch, forward and backward: (int8, delta), the
    codec's CPU time inside where measured."""
    codec: bool
    """Whether ``delta``'s encoder is charged apart (a GPU stage's, beside its compute)."""
    ahead: int | None = 0
    """``pipeline.forwardsAhead``, both codes; None: each code its fastest (0 to the
    micro-batches)."""


@dataclass(frozen=True)
class Projection:
    case: str
    int8_seconds: float
    delta_seconds: float
    ratio: float
    ratio_equal_steps: float
    int8_link_seconds_a_step: float
    int8_link_seconds_for_goal: float | None


Ratio = float | tuple[float, ...]
"""One ratio for every link, or one each (link ``k`` between stages ``k`` and ``k + 1``)."""


def project(
    case: Case, steps_int8: int, steps_delta: int, bandwidth: Ratio, gradients: Ratio | None = None
) -> Projection:
    """``bandwidth``: int8's busiest direction's bytes over delta's, each over its steps to the
    target, every link charged at it (each step's most loaded boundary: a bound from below
    on delta's gain where its boundaries differ); or one a link, int8's activations' bytes
    on that link over delta's. ``gradients``: the same of the gradients' direction alone
    (None: ``bandwidth``)."""
    links = STAGES - 1
    down_ratio, up_ratio = (
        r if isinstance(r, tuple) else (r,) * links
        for r in (bandwidth, bandwidth if gradients is None else gradients)
    )
    if len(down_ratio) != links or len(up_ratio) != links:
        raise ValueError(f"a ratio a link: {links} links, not {len(down_ratio)} or {len(up_ratio)}")
    # int8's seconds a step in one direction of a link: its micro-batches' frames.
    link8 = case.hidden * case.tokens * WIRE_BYTES["int8"] / RATE
    values = case.hidden * case.tokens / case.micros
    forward, backward = (
        (values * DELTA_FORWARD_CODEC_SECONDS, values * DELTA_BACKWARD_CODEC_SECONDS)
        if case.codec
        else (0.0, 0.0)
    )

    def step(
        compute: float, down: Ratio, up: Ratio, encode: tuple[float, float] = (0.0, 0.0)
    ) -> float:
        aheads = range(case.micros + 1) if case.ahead is None else (case.ahead,)
        return min(
            step_seconds(
                StepShape(STAGES, case.micros, compute, down, up, LATENCY, *encode, ahead=a)
            )
            for a in aheads
        )

    def times(link: float, steps: int = steps_delta) -> tuple[float, float]:
        # delta's frames on each link in each direction, measured: int8's over the link's
        # ratio, spread over delta's steps and a step's micro-batches
        micros = case.micros
        down, up = (
            tuple(steps_int8 * link / (r * steps_delta * micros) for r in ratios)
            for ratios in (down_ratio, up_ratio)
        )
        t8 = steps_int8 * step(case.compute[0], link / micros, link / micros)
        return t8, steps * step(case.compute[1], down, up, (forward, backward))

    t8, td = times(link8)
    e8, ed = times(link8, steps_int8)
    lo, hi = 0.0, 1e6  # the int8 link seconds a step at which the ratio reaches GOAL
    for _ in range(60):  # 1e6 s halved 60 times: below a picosecond
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


def cases(rate: float, rows: int, micros: int, ahead: int | None) -> list[Case]:
    """The measured run, then an 8B's frames over GPU stages computing ``rate`` tokens/s."""
    tokens = rows * 2048
    gpu = tokens / rate / micros  # a stage's share of the pipeline's throughput
    eight_b = (
        f"Llama-3.1-8B shape, {rows} rows of 2048 a step in {micros} micro-batches,"
        f" {rate:,.0f} tokens/s"
        + (", each code its best forwards ahead" if ahead is None else "")
        + (f", {ahead} forwards ahead" if ahead else "")
    )
    # The measured run: tiny Llama (hidden 256), 2 micro-batches of 4 rows of 64 tokens, CPU
    # stages: a step over loopback 0.25 s (int8) and 0.61 s (delta, its codec on the CPU
    # inside), 1F1B's bubble included.
    measured = (calibrate(STAGES, 2, 0.25), calibrate(STAGES, 2, 0.61))
    return [
        Case("bench_delta_boundary.py as run (CPU stages)", 256, 512, 2, measured, False),
        Case(eight_b, 4096, tokens, micros, (gpu, gpu), True, ahead),
        Case(
            f"the same, 4x the compute ({4 * rate:,.0f} tokens/s)",
            4096,
            tokens,
            micros,
            (gpu / 4,) * 2,
            True,
            ahead,
        ),
    ]


def ratio(text: str) -> Ratio:
    """``--bandwidth-ratio`` and ``--gradient-ratio``: one ratio, or one a link, commas
    between (``5.66,5.07,4.90``)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(v > 0 for v in values) or len(values) not in (1, STAGES - 1):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a ratio above 0, or {STAGES - 1} of them, one a link, commas between"
        )
    return values[0] if len(values) == 1 else values


def shown(r: Ratio) -> str:
    return "/".join(f"{v:.2f}" for v in r) if isinstance(r, tuple) else f"{r:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-int8", type=int, default=35)
    parser.add_argument("--steps-delta", type=int, default=47)
    parser.add_argument(
        "--bandwidth-ratio",
        type=ratio,
        default=3.57,
        help="int8's busiest direction's bytes over delta's to the target, every link charged"
        " at it; or one a link, int8's activations' bytes on it over delta's (a,b,c)",
    )
    parser.add_argument(
        "--gradient-ratio",
        type=ratio,
        help="int8's gradients' bytes over delta's to the target, or one a link (default: the"
        " bandwidth ratio, the gradients charged as much as the activations)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=12_000.0,
        help="the GPU pipeline's compute (default: issue 24's four RTX 4090s on an 8B LoRA)",
    )
    parser.add_argument("--rows", type=int, default=8, help="rows of 2048 tokens a step")
    parser.add_argument(
        "--micro-batches", type=int, help="the 8B's micro-batches a step (default: a row each)"
    )
    parser.add_argument(
        "--ahead",
        default="0",
        help="the 8B's pipeline.forwardsAhead, both codes (best: each code its fastest)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [
        project(c, args.steps_int8, args.steps_delta, args.bandwidth_ratio, args.gradient_ratio)
        for c in cases(
            args.tokens_per_second,
            args.rows,
            args.micro_batches or args.rows,
            None if args.ahead == "best" else int(args.ahead),
        )
    ]
    print(
        f"100 Mbit/s, {LATENCY * 1000:.0f} ms each way, {STAGES} stages; int8 {args.steps_int8}"
        f" steps to the target, delta {args.steps_delta}, bandwidth ratio"
        f" {shown(args.bandwidth_ratio)}"
        + ("" if args.gradient_ratio is None else f", gradients {shown(args.gradient_ratio)}")
        + "\n"
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
