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
the slowest resource plus the latencies was 47-65 % short). The planner plays each plan's
step (`Problem.timeline`) to rank plans, to choose ``pipeline.forwardsAhead: auto``
(`choose.choose_forwards_ahead`) and to say what a link-bound plan would gain; the
time-to-loss projection (bench/time_to_loss_model.py) and bench_delta_boundary.py's model of
its timed runs are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relaytrain_contract.order import warmup

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
    played = _played(shape, (shape.micros,))
    return played[-1] if played else 0.0


def step_seconds_each(shape: StepShape) -> list[float]:
    """`step_seconds` for 1, 2, ... ``shape.micros`` micro-batches (the same floats), in one
    play: about the cost of the longest step and ``M`` drains, where playing each count
    anew costs ``M / 2`` longest steps."""
    return _played(shape, None)


def _played(shape: StepShape, counts: tuple[int, ...] | None) -> list[float]:
    """The step played out for each of ``counts`` micro-batches, in increasing order, up to
    ``shape.micros`` (None: every count from 1), in one play.

    1F1B without polling (`relaytrain_contract.order`): with ``w_k`` the forwards stage k
    runs before its first backward (`warmup`), its order for m micro-batches is a prefix,
    F(i) for i < m, each from the (w_k + 1)-th on followed by B(i - w_k), then its drain,
    the backwards left. Each micro-batch more adds one forward (and maybe one backward) to
    every stage's prefix, and taking the stages first to last meets every dependency: F(i)
    at k needs F(i) at k - 1, just done; B(j) at k needs B(j) at k + 1, done ``w_k -
    w_(k+1) >= 1`` micro-batches earlier. A drain takes the stages last to first, each
    stage's B(j) after its successor's. Each stage's compute and encoder and each link
    direction see their work in the stage's own order, so every count's step is the same
    floats as that count played alone. A drain's gradients are written where its prefix's
    would be; each is read only by that drain, and the prefix writes its own before its
    predecessor reads it."""
    p, m_total = shape.stages, shape.micros
    compute = _each(shape.compute, p, "compute")
    forward = [c * (1 - BACKWARD_SHARE) for c in compute]
    backward = [c * BACKWARD_SHARE for c in compute]
    links = max(p - 1, 0)
    down, up = _each(shape.down, links, "down"), _each(shape.up, links, "up")
    latency = _each(shape.latency, links, "latency")
    encode_down = _each(shape.encode_down, p, "encode_down")
    encode_up = _each(shape.encode_up, p, "encode_up")
    warm = [warmup(k, p, shape.ahead) for k in range(p)]
    last = p - 1
    # When micro-batch i's activation (ins[k][i]) or gradient (grads[k][i]) is at stage k.
    ins = [[0.0] * m_total for _ in range(p)]
    grads = [[0.0] * m_total for _ in range(p)]
    busy, coder = [0.0] * p, [0.0] * p
    link_down, link_up = [0.0] * links, [0.0] * links  # link k: between stages k and k + 1
    steps: list[float] = []
    # The loops below are the planner's hot path: conditional expressions rather than
    # max() (the same floats: no NaN or -0.0 arises), and each stage's constants at hand.
    stages = [
        (k, ins[k], ins[k + 1] if k < last else None, grads[k], grads[k - 1] if k else None,
         forward[k], backward[k], warm[k])
        for k in range(p)
    ]  # fmt: skip
    for m in range(m_total):  # every stage's prefix for m micro-batches, to m + 1
        for k, ins_k, ins_next, grads_k, grads_prev, fwd, bwd, w in stages:
            b = busy[k]
            r = ins_k[m]
            b = (b if b >= r else r) + fwd
            if ins_next is not None:
                c = coder[k]
                c = coder[k] = (c if c >= b else b) + encode_down[k]
                sent = link_down[k]
                sent = link_down[k] = (sent if sent >= c else c) + down[k]
                ins_next[m] = sent + latency[k]
            j = m - w
            if j >= 0:
                if ins_next is not None:
                    r = grads_k[j]
                    b = (b if b >= r else r) + bwd
                else:
                    b = b + bwd
                if grads_prev is not None:
                    c = coder[k]
                    c = coder[k] = (c if c >= b else b) + encode_up[k]
                    sent = link_up[k - 1]
                    sent = link_up[k - 1] = (sent if sent >= c else c) + up[k - 1]
                    grads_prev[j] = sent + latency[k - 1]
            busy[k] = b
        if counts is not None and m + 1 not in counts:
            continue
        done = m + 1  # the drain of a step of `done` micro-batches
        end = busy[last]
        for k, _, _, grads_k, grads_prev, _, bwd, w in reversed(stages[:last]):
            b, c = busy[k], coder[k]
            if grads_prev is None:
                for j in range(max(done - w, 0), done):
                    r = grads_k[j]
                    b = (b if b >= r else r) + bwd
            else:
                enc, one, lat = encode_up[k], up[k - 1], latency[k - 1]
                sent = link_up[k - 1]
                for j in range(max(done - w, 0), done):
                    r = grads_k[j]
                    b = (b if b >= r else r) + bwd
                    c = (c if c >= b else b) + enc
                    sent = (sent if sent >= c else c) + one
                    grads_prev[j] = sent + lat
            end = end if end >= b else b
        steps.append(end)
    return steps


PLAYED_MICROS = 64
"""The most micro-batches the planner plays a step out for (`planned_step_seconds`)."""


def planned_step_seconds(shape: StepShape) -> float:
    """The step as the planner prices it (`PlannedSteps`)."""
    if shape.micros <= PLAYED_MICROS:
        return step_seconds(shape)
    return PlannedSteps(shape)(shape.micros)


class PlannedSteps:
    """A shape's step as the planner prices it, for any count of micro-batches:
    `step_seconds` to ``PLAYED_MICROS`` micro-batches (every count in one play,
    `step_seconds_each`, the first time one is asked for); beyond, that step and then each
    further micro-batch at its mean over the last half of those (at least the busiest
    resource's time per micro-batch, `busiest_seconds`). A fleet's pipeline is asked for
    every count to the step's (`shares.Lane`): each count to a thousand over 15 stages takes
    17 ms to play, to 64 about 1 ms; once its window is full, 1F1B's step grows by about
    the same time a micro-batch."""

    def __init__(self, shape: StepShape) -> None:
        self.shape = shape
        self._steps: list[float] | None = None
        """The step for 1 to ``PLAYED_MICROS`` micro-batches."""
        self._tail: tuple[float, float] | None = None
        """Beyond ``PLAYED_MICROS``: (its step, the seconds of each further micro-batch)."""

    def __call__(self, micros: int) -> float:
        if micros <= PLAYED_MICROS:
            if self._steps is None:
                self._steps = step_seconds_each(replace(self.shape, micros=PLAYED_MICROS))
            return self._steps[micros - 1]
        if self._tail is None:
            half = PLAYED_MICROS // 2
            if self._steps is None:  # a plan's step alone: two counts, not every one
                at_half, full = _played(
                    replace(self.shape, micros=PLAYED_MICROS), (half, PLAYED_MICROS)
                )
            else:
                at_half, full = self._steps[half - 1], self._steps[-1]
            slope = (full - at_half) / (PLAYED_MICROS - half)
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
