"""A step's time through a pipeline of slow links: 1F1B played out event by event.

Each stage runs its micro-batches' forwards and backwards in the worker's own order
(`relaytrain_contract.order.one_f_one_b`); a forward waits for its activation to arrive, a
backward for its gradient. A frame leaves once its stage has computed it and, where a code
runs beside the compute (a GPU stage's side stream), once the stage's encoder has coded it;
it then queues on its link's direction (one frame at a time, ``bytes / rate`` each, the two
directions independent) and arrives one latency after its last byte left. The step ends
when the last stage's work is done (the first stage's last backward): the step-end norms
ride behind the last gradients and the total ahead of the next step's first activation (the
worker's `schedule.StepRunner._finish`), so they add no latency of their own.

Where the links are fast this is 1F1B's ``(M + P - 1)`` micro-batch times; where they are
slow, the first activation's ``P - 1`` sends down and the last gradient's ``P - 1`` up are
paid on top of the ``M`` frames the busiest link carries: with 2 micro-batches over 4
stages an int8 step takes about 7 frame times, not 2. bench/bench_pipeline_time.py checks it
against the worker's real steps over paced links (within -3 to +6 % on 2026-12-01, where
the slowest resource plus the latencies was 47-65 % short). The planner plays a plan's step
(`api.timeline`) to choose ``pipeline.forwardsAhead: auto`` (`choose.choose_forwards_ahead`)
and to say what a link-bound plan would gain; the time-to-loss projection
(bench/time_to_loss_model.py) and bench_delta_boundary.py's model of its timed runs are built
on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain_contract.order import one_f_one_b

BACKWARD_SHARE = 2 / 3
"""A micro-batch's backward's share of its forward plus backward on a stage."""


Each = float | tuple[float, ...]
"""One value for every stage (or link), or one each: stage ``k``'s, link ``k``'s (between
stages ``k`` and ``k + 1``)."""


@dataclass(frozen=True)
class StepShape:
    stages: int
    micros: int
    compute: Each
    """A stage's forward plus backward of one micro-batch, seconds (codes on the CPU inside)."""
    down: Each
    """Seconds an activation frame takes to leave over a link (its bytes over the rate)."""
    up: Each
    """The same for a gradient frame."""
    latency: Each = 0.0
    """One way, seconds."""
    encode_down: Each = 0.0
    """A stage's encoder's seconds for an activation frame, beside its compute (0: none, or
    inside ``compute``)."""
    encode_up: Each = 0.0
    ahead: int = 0
    """Forwards run ahead of 1F1B (``pipeline.forwardsAhead``): a wider window of micro-batches
    in flight, for links whose round trip is long against a micro-batch's compute."""


def _each(value: Each, count: int, what: str) -> tuple[float, ...]:
    if isinstance(value, tuple):
        if len(value) != count:
            raise ValueError(f"{what}: {len(value)} values for {count}")
        return value
    return (value,) * count


def step_seconds(shape: StepShape) -> float:
    """The step's wall time: from the first stage's first forward to the last work done."""
    p, m = shape.stages, shape.micros
    compute = _each(shape.compute, p, "compute")
    links = max(p - 1, 0)
    send = {"F": _each(shape.down, links, "down"), "B": _each(shape.up, links, "up")}
    latency = _each(shape.latency, links, "latency")
    encode = {
        "F": _each(shape.encode_down, p, "encode_down"),
        "B": _each(shape.encode_up, p, "encode_up"),
    }
    orders = [one_f_one_b(k, p, m, shape.ahead) for k in range(p)]
    nxt = [0] * p
    free = [0.0] * p
    encoder = [0.0] * p
    # Per link k (between stages k and k + 1): when its direction is next free.
    link = {("F", k): 0.0 for k in range(links)} | {("B", k): 0.0 for k in range(links)}
    arrive: dict[tuple[str, int, int], float] = {}
    """(F|B, stage, micro): when that op's input is at the stage."""
    for i in range(m):
        arrive["F", 0, i] = 0.0
    left = p * 2 * m
    while left:
        progressed = False
        for k in range(p):
            while nxt[k] < len(orders[k]):
                op, i = orders[k][nxt[k]]
                ready = arrive.get((op, k, i)) if op == "F" or k < p - 1 else free[k]
                if ready is None:
                    break
                share = BACKWARD_SHARE if op == "B" else 1 - BACKWARD_SHARE
                free[k] = max(free[k], ready) + compute[k] * share
                nxt[k] += 1
                left -= 1
                progressed = True
                to, edge = (k + 1, k) if op == "F" else (k - 1, k - 1)
                if 0 <= to < p:
                    encoder[k] = max(encoder[k], free[k]) + encode[op][k]
                    link[op, edge] = max(link[op, edge], encoder[k]) + send[op][edge]
                    arrive[op, to, i] = link[op, edge] + latency[edge]
        if not progressed:  # 1F1B cannot deadlock; a change that breaks it must not hang
            raise RuntimeError(f"the schedule is stuck: {nxt} of {[len(o) for o in orders]}")
    return max(free)


def calibrate(stages: int, micros: int, step: float) -> float:
    """The per-micro-batch ``compute`` at which a step over instant links takes ``step``
    seconds (the step's time is proportional to it there)."""
    return step / step_seconds(StepShape(stages, micros, 1.0, 0.0, 0.0))
