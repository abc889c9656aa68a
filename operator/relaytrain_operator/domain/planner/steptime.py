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

from dataclasses import dataclass, replace

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
    forward = [c * (1 - BACKWARD_SHARE) for c in compute]
    backward = [c * BACKWARD_SHARE for c in compute]
    links = max(p - 1, 0)
    down, up = _each(shape.down, links, "down"), _each(shape.up, links, "up")
    latency = _each(shape.latency, links, "latency")
    encode_down = _each(shape.encode_down, p, "encode_down")
    encode_up = _each(shape.encode_up, p, "encode_up")
    orders = [one_f_one_b(k, p, m, shape.ahead) for k in range(p)]
    # When micro-batch i's activation (ins[k][i]) or gradient (grads[k][i]) is at stage k.
    ins: list[list[float | None]] = [[None] * m for _ in range(p)]
    ins[0] = [0.0] * m
    grads: list[list[float | None]] = [[None] * m for _ in range(p)]
    # Per link k (between stages k and k + 1): when each direction is next free.
    link_down, link_up = [0.0] * links, [0.0] * links
    nxt, free, encoder = [0] * p, [0.0] * p, [0.0] * p
    last, left = p - 1, p * 2 * m
    while left:
        progressed = False
        for k in range(p):
            order, j, busy, coder = orders[k], nxt[k], free[k], encoder[k]
            while j < len(order):
                op, i = order[j]
                if op == "F":
                    ready = ins[k][i]
                    if ready is None:
                        break
                    busy = max(busy, ready) + forward[k]
                    if k < last:
                        coder = max(coder, busy) + encode_down[k]
                        link_down[k] = max(link_down[k], coder) + down[k]
                        ins[k + 1][i] = link_down[k] + latency[k]
                else:
                    ready = grads[k][i] if k < last else busy
                    if ready is None:
                        break
                    busy = max(busy, ready) + backward[k]
                    if k > 0:
                        coder = max(coder, busy) + encode_up[k]
                        link_up[k - 1] = max(link_up[k - 1], coder) + up[k - 1]
                        grads[k - 1][i] = link_up[k - 1] + latency[k - 1]
                j += 1
            if j > nxt[k]:
                left -= j - nxt[k]
                nxt[k], free[k], encoder[k], progressed = j, busy, coder, True
        if not progressed:  # 1F1B cannot deadlock; a change that breaks it must not hang
            raise RuntimeError(f"the schedule is stuck: {nxt} of {[len(o) for o in orders]}")
    return max(free)


PLAYED_MICROS = 64
"""The most micro-batches the planner plays a step out for (`planned_step_seconds`)."""


def planned_step_seconds(shape: StepShape) -> float:
    """The step as the planner prices it (`PlannedSteps`)."""
    return PlannedSteps(shape)(shape.micros)


class PlannedSteps:
    """A shape's step as the planner prices it, for any count of micro-batches, each count
    played once: `step_seconds` to ``PLAYED_MICROS`` micro-batches; beyond, that step and then
    each further micro-batch at its mean over the last half of those (at least the busiest
    resource's time per micro-batch, `busiest_seconds`). A step of a thousand micro-batches
    over 15 stages takes a fifth of a second to play, and the search plays many; once its
    window is full, 1F1B's step grows by about the same time a micro-batch."""

    def __init__(self, shape: StepShape) -> None:
        self.shape = shape
        self._played: dict[int, float] = {}
        self._tail: tuple[float, float] | None = None
        """Beyond ``PLAYED_MICROS``: (its step, the seconds of each further micro-batch)."""

    def _play(self, micros: int) -> float:
        if micros not in self._played:
            self._played[micros] = step_seconds(replace(self.shape, micros=micros))
        return self._played[micros]

    def __call__(self, micros: int) -> float:
        if micros <= PLAYED_MICROS:
            return self._play(micros)
        if self._tail is None:
            half = PLAYED_MICROS // 2
            full = self._play(PLAYED_MICROS)
            slope = (full - self._play(half)) / (PLAYED_MICROS - half)
            self._tail = (full, max(slope, busiest_seconds(self.shape)))
        full, slope = self._tail
        return full + (micros - PLAYED_MICROS) * slope


def busiest_seconds(shape: StepShape) -> float:
    """The busiest resource's time per micro-batch: a stage's compute or its encoder, or a
    link direction's frame. No step grows by less a micro-batch."""
    p = shape.stages
    links = max(p - 1, 0)
    encoders = [
        a + b
        for a, b in zip(
            _each(shape.encode_down, p, "encode_down"),
            _each(shape.encode_up, p, "encode_up"),
            strict=True,
        )
    ]
    return max(
        *_each(shape.compute, p, "compute"),
        *_each(shape.down, links, "down"),
        *_each(shape.up, links, "up"),
        *encoders,
    )


def calibrate(stages: int, micros: int, step: float) -> float:
    """The per-micro-batch ``compute`` at which a step over instant links takes ``step``
    seconds (the step's time is proportional to it there)."""
    return step / step_seconds(StepShape(stages, micros, 1.0, 0.0, 0.0))
