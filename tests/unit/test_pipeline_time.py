"""The planner's steptime: a step's time through 1F1B over slow links, the model the
time-to-loss projection rests on (bench_pipeline_time.py measures it against the worker's real
steps)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relaytrain_contract.order import one_f_one_b
from relaytrain_operator.domain.planner.problem import floor_lines, round_trip_floor
from relaytrain_operator.domain.planner.steptime import (
    BACKWARD_SHARE,
    PLAYED_MICROS,
    PlannedSteps,
    StepShape,
    calibrate,
    planned_step_seconds,
    step_seconds,
    step_seconds_each,
)

pytestmark = pytest.mark.unit


def test_over_instant_links_a_step_is_one_f_one_bs_micro_batches_plus_its_fill_and_drain() -> None:
    for micros in (1, 2, 4, 8, 16):
        assert step_seconds(StepShape(4, micros, 1.0, 0.0, 0.0)) == pytest.approx(micros + 3)


def test_a_step_over_slow_links_pays_the_last_activations_way_down_and_its_gradients_way_up() -> (
    None
):
    # 2 micro-batches over 4 stages: the second activation leaves one frame after the first
    # and crosses 3 links (4 frames down), then its gradient crosses 3 links up. The busiest
    # direction carries only 2 frames: a step's bytes over the rate miss 5 of the 7.
    assert step_seconds(StepShape(4, 2, 0.0, 1.0, 1.0)) == pytest.approx(7.0)
    assert step_seconds(StepShape(4, 2, 0.0, 1.0, 0.5)) == pytest.approx(4 * 1.0 + 3 * 0.5)


def test_latency_one_round_trip_while_every_micro_batch_is_in_flight_then_more() -> None:
    for micros in (1, 2):
        assert step_seconds(StepShape(4, micros, 0.0, 0.0, 0.0, 0.05)) == pytest.approx(0.3)
    # A third micro-batch waits at the third stage for the first one's gradient (its 1F1B
    # warm-up is one forward), and so on: each one more costs a round trip of two links.
    assert step_seconds(StepShape(4, 3, 0.0, 0.0, 0.0, 0.05)) == pytest.approx(0.4)
    assert step_seconds(StepShape(4, 4, 0.0, 0.0, 0.0, 0.05)) == pytest.approx(0.5)


def test_forwards_ahead_widen_the_window_a_long_round_trip_starves() -> None:
    """With more micro-batches than stages, 1F1B lets the first stage run a forward only once
    a gradient has come back: a round trip long against the compute leaves it idle."""
    slow = StepShape(4, 8, 0.1, 0.0, 0.0, 0.5)
    ahead = StepShape(4, 8, 0.1, 0.0, 0.0, 0.5, ahead=4)
    assert step_seconds(ahead) < 0.8 * step_seconds(slow)
    # Over instant links the window costs nothing: 1F1B is already as fast as it gets.
    assert step_seconds(StepShape(4, 8, 1.0, 0.0, 0.0, ahead=4)) == pytest.approx(11.0)


def test_an_encoder_slower_than_the_compute_sets_the_pace() -> None:
    fast = step_seconds(StepShape(4, 32, 0.1, 0.0, 0.0))
    coded = step_seconds(StepShape(4, 32, 0.1, 0.0, 0.0, encode_down=0.5))
    assert coded >= 32 * 0.5 > 2 * fast


def test_calibrate_gives_the_compute_that_reproduces_a_measured_loopback_step() -> None:
    for stages, micros in ((4, 2), (4, 8), (2, 3)):
        compute = calibrate(stages, micros, 2.0)
        assert step_seconds(StepShape(stages, micros, compute, 0.0, 0.0)) == pytest.approx(2.0)


def test_steps_to_a_target_counts_to_the_first_step_at_or_below_it_or_says_never() -> None:
    from bench.time_to_loss_model import steps_to

    losses = [3.0, 2.5, 2.0, 2.1, 1.9]
    assert steps_to(losses, 2.0) == 3  # reached at the third step, left and reached again
    assert steps_to(losses, 3.0) == 1
    assert steps_to(losses, 1.0) is None


def test_the_projection_charges_the_gradients_their_own_bytes_when_measured_apart() -> None:
    from bench.time_to_loss_model import cases, project

    eight_b = cases(12_000.0, 8, 8, None)[1]
    charged_alike = project(eight_b, 21, 22, 2.95)
    assert project(eight_b, 21, 22, 2.95, 2.95) == charged_alike
    # Gradients 8x smaller than int8's: the backward's way up and 1F1B's gradient sends take
    # less time, so delta is sooner, but never sooner than with both directions that small.
    apart = project(eight_b, 21, 22, 2.95, 8.0)
    assert apart.delta_seconds < charged_alike.delta_seconds
    assert apart.int8_seconds == charged_alike.int8_seconds
    assert apart.delta_seconds > project(eight_b, 21, 22, 8.0).delta_seconds


def test_the_projection_gives_each_link_its_own_ratio() -> None:
    """Every link at the busiest boundary's bytes is a bound from below on delta's gain where
    its boundaries differ: each link at its own ratio, lighter links fill and drain sooner."""
    from bench.time_to_loss_model import cases, project, ratio

    eight_b = cases(12_000.0, 8, 8, None)[1]
    alike = project(eight_b, 19, 20, 4.75, 6.13)
    assert project(eight_b, 19, 20, (4.75,) * 3, (6.13,) * 3) == alike
    each = project(eight_b, 19, 20, (5.66, 5.07, 4.90), (7.12, 6.59, 6.39))
    assert each.int8_seconds == alike.int8_seconds
    assert each.delta_seconds < alike.delta_seconds
    # ...but no sooner than with every link as light as the lightest.
    assert each.delta_seconds > project(eight_b, 19, 20, 5.66, 7.12).delta_seconds
    with pytest.raises(ValueError, match="3 links"):
        project(eight_b, 19, 20, (5.0, 5.0))
    assert ratio("5.66,5.07,4.90") == (5.66, 5.07, 4.90) and ratio("4.75") == 4.75
    for bad in ("5,5", "0", "x", "5,-1,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="one a link"):
            ratio(bad)


@st.composite
def slow_shapes(draw: st.DrawFn) -> StepShape:
    p = draw(st.integers(1, 6))
    each = st.floats(0.0, 0.4)
    return StepShape(
        p,
        draw(st.integers(1, 40)),
        tuple(draw(st.floats(0.01, 0.5)) for _ in range(p)),
        tuple(draw(each) for _ in range(p - 1)),
        tuple(draw(each) for _ in range(p - 1)),
        tuple(draw(st.floats(0.0, 0.3)) for _ in range(p - 1)),
        ahead=draw(st.sampled_from([0, 1, 2, 5])),
    )


@settings(max_examples=300, deadline=None)
@given(slow_shapes())
def test_the_planners_floors_are_never_above_the_step_played_out(shape: StepShape) -> None:
    """What the planner's search prunes by (`problem.step_floor`) and the fleet's micro-batch
    split and set bounds rely on (`Problem.lane`): each resource's M micro-batches after the
    first reaches it, and the round trips 1F1B's window waits on, never exceed the step."""
    step = step_seconds(shape)
    for a, b in floor_lines(shape):
        assert a + shape.micros * b <= step * (1 + 1e-9)
    assert round_trip_floor(shape) <= step * (1 + 1e-9)


def test_the_round_trip_floor_is_the_step_where_round_trips_alone_pace_it() -> None:
    # No compute, no bytes: 2 stages, 1 ms a way; the first stage's window is 2 micro-batches,
    # so 8 of them take 4 round trips of 4 ms (both ends' latency, there and back).
    shape = StepShape(2, 8, 0.0, 0.0, 0.0, 0.002)
    assert round_trip_floor(shape) == pytest.approx(step_seconds(shape)) == pytest.approx(0.016)


@settings(max_examples=60, deadline=None)
@given(slow_shapes(), st.sampled_from([65, 100, 300]))
def test_the_planned_step_past_64_micro_batches_stays_within_2_percent_of_the_played(
    shape: StepShape, micros: int
) -> None:
    """Past `PLAYED_MICROS` the planner extends a step at its mean slope over the last 32
    micro-batches played (its window full, 1F1B's step grows by about the same time a
    micro-batch): within 1.2 % of the played step on 150 random shapes on 2026-12-02."""
    shape = replace(shape, micros=micros)
    assert planned_step_seconds(shape) == pytest.approx(step_seconds(shape), rel=0.02)
    assert planned_step_seconds(replace(shape, micros=PLAYED_MICROS)) == step_seconds(
        replace(shape, micros=PLAYED_MICROS)
    )


def _each(value: float | tuple[float, ...], count: int) -> tuple[float, ...]:
    return value if isinstance(value, tuple) else (value,) * count


def played_by_polling(shape: StepShape) -> float:
    """The step played as the worker runs it, the plain way: each stage takes the next
    operation of its own `one_f_one_b` order as soon as its input has arrived, every stage in
    turn until all are done (steptime's implementation until 2026-12-02)."""
    p, m = shape.stages, shape.micros
    compute = _each(shape.compute, p)
    forward = [c * (1 - BACKWARD_SHARE) for c in compute]
    backward = [c * BACKWARD_SHARE for c in compute]
    links = max(p - 1, 0)
    down, up, latency = (_each(v, links) for v in (shape.down, shape.up, shape.latency))
    encode_down, encode_up = _each(shape.encode_down, p), _each(shape.encode_up, p)
    orders = [one_f_one_b(k, p, m, shape.ahead) for k in range(p)]
    ins: list[list[float | None]] = [[0.0] * m] + [[None] * m for _ in range(p - 1)]
    grads: list[list[float | None]] = [[None] * m for _ in range(p)]
    link_down, link_up = [0.0] * links, [0.0] * links
    nxt, free, encoder = [0] * p, [0.0] * p, [0.0] * p
    while sum(nxt) < sum(len(o) for o in orders):
        before = list(nxt)
        for k in range(p):
            while nxt[k] < len(orders[k]):
                op, i = orders[k][nxt[k]]
                if op == "F":
                    ready = ins[k][i]
                    if ready is None:
                        break
                    free[k] = max(free[k], ready) + forward[k]
                    if k < p - 1:
                        encoder[k] = max(encoder[k], free[k]) + encode_down[k]
                        link_down[k] = max(link_down[k], encoder[k]) + down[k]
                        ins[k + 1][i] = link_down[k] + latency[k]
                else:
                    ready = grads[k][i] if k < p - 1 else free[k]
                    if ready is None:
                        break
                    free[k] = max(free[k], ready) + backward[k]
                    if k > 0:
                        encoder[k] = max(encoder[k], free[k]) + encode_up[k]
                        link_up[k - 1] = max(link_up[k - 1], encoder[k]) + up[k - 1]
                        grads[k - 1][i] = link_up[k - 1] + latency[k - 1]
                nxt[k] += 1
        assert nxt != before, "the schedule is stuck"
    return max(free)


@settings(max_examples=300, deadline=None)
@given(slow_shapes())
def test_every_count_of_micro_batches_plays_the_same_floats_as_the_worker_order_played_alone(
    shape: StepShape,
) -> None:
    """steptime plays 1F1B without polling, a stage's prefix per micro-batch and its drain,
    and every count of micro-batches in one play (`step_seconds_each`, what each pipeline of
    a fleet is priced by): each must be the step of the worker's own order played alone,
    to the bit."""
    each = step_seconds_each(shape)
    assert len(each) == shape.micros
    for m, seconds in enumerate(each, start=1):
        assert seconds == played_by_polling(replace(shape, micros=m)), m
    assert step_seconds(shape) == each[-1]
    steps = PlannedSteps(shape)
    assert [steps(m) for m in range(1, shape.micros + 1)] == each
