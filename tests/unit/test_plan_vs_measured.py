"""The plan-vs-measured benchmark's own arithmetic: step times from a run's loss history, the
calibrated CPU entry as the planner prices it, CPU time from /proc, and the fit of what the
cost model misses. (The measurements themselves run in bench/bench_plan_vs_measured.py.)"""

from __future__ import annotations

import os
import time

import pytest
from relaytrain_operator.domain.planner import ModelShape
from relaytrain_operator.domain.planner.steptime import step_seconds

from bench import bench_plan_vs_measured as pvm

pytestmark = pytest.mark.unit

SHAPE = ModelShape(4, 256, 512, 4, 2, 64, 2048, tie_word_embeddings=True)


def _calibration(gflops: float, mbps: float = 800.0, one_way_ms: float = 0.5) -> pvm.Calibration:
    return pvm.Calibration(gflops * 1e9, 1.0, 16384, 10.0, mbps, one_way_ms)


def test_step_seconds_are_label_tokens_over_rate_after_the_first_step() -> None:
    history = [
        {"step": 1, "loss": 5.0, "tokensPerSecond": 10.0},
        {"step": 2, "loss": 4.9, "tokensPerSecond": 1000.0},
        {"step": 3, "loss": 4.8, "tokensPerSecond": 500.0},
    ]
    case = pvm.Case(hidden=256, layers=4, seq=65, mbs=2, micro_batches=4, stages=2)
    assert case.label_tokens == 4 * 2 * 64  # packed rows learn all positions but the first
    assert pvm.step_seconds(history, case.label_tokens) == [0.512, 1.024]


def test_calibrated_entry_prices_compute_by_the_measured_rate() -> None:
    case = pvm.Case(hidden=256, layers=4, seq=64, mbs=2, micro_batches=4, stages=2)
    split = [(0, 2), (2, 4)]
    slow = pvm.predict(case, SHAPE, split, _calibration(50.0))
    fast = pvm.predict(case, SHAPE, split, _calibration(100.0))
    for a, b in zip(slow.stages, fast.stages, strict=True):
        assert a.compute_seconds == pytest.approx(2 * b.compute_seconds)
    # 1F1B played out over the calibrated link: at least M beats of the slowest stage, at most
    # M + P - 1 of them plus the first activation's and the last gradient's crossing.
    assert slow.timeline is not None
    assert slow.step_seconds == pytest.approx(step_seconds(slow.timeline))
    crossing = 2 * max(s.link_seconds for s in slow.stages)
    assert (
        4 * slow.micro_batch_seconds < slow.step_seconds <= 5 * slow.micro_batch_seconds + crossing
    )


def test_a_send_over_the_calibrated_link_costs_bytes_over_rate_plus_one_way_time() -> None:
    case = pvm.Case(hidden=256, layers=4, seq=64, mbs=2, micro_batches=4, stages=2)
    plan = pvm.predict(case, SHAPE, [(0, 2), (2, 4)], _calibration(50.0, 800.0, 0.5))
    tokens = 2 * 64
    forward = tokens * 256 * 4 + tokens * 16  # fp32 activations, labels and mask
    assert plan.stages[0].link_seconds == pytest.approx(forward / 100e6 + 0.5e-3)


def test_cpu_seconds_reads_this_process_from_proc() -> None:
    began = pvm.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    spent = pvm.cpu_seconds(os.getpid()) - began
    assert 0.15 <= spent <= 1.0


def _terms(
    compute: float, layers: int, stages: int, efficiency: float, overhead: float
) -> pvm.Terms:
    t = pvm.Terms(8, (compute,) * stages, (layers,) * stages, (0.0,) * stages, 1.0, ())
    busy = tuple(t.stage_busy(efficiency, overhead))
    return pvm.Terms(8, t.compute, t.layers, t.link, t.step_time(efficiency, overhead), busy)


def test_fit_recovers_efficiency_and_per_layer_overhead() -> None:
    cases = [
        _terms(0.002, 4, 1, 0.5, 1e-3),
        _terms(0.010, 6, 2, 0.5, 1e-3),
        _terms(0.030, 3, 2, 0.5, 1e-3),
    ]
    efficiency, overhead = pvm.fit(cases, with_overhead=True)
    assert efficiency == pytest.approx(0.5, rel=0.03)
    assert overhead == pytest.approx(1e-3, abs=5e-5)
    only_efficiency = pvm.fit(cases, with_overhead=False)
    assert only_efficiency[1] == 0.0
    worse = sum(abs(e) for t in cases for e in pvm.busy_errors(t, only_efficiency))
    better = sum(abs(e) for t in cases for e in pvm.busy_errors(t, (efficiency, overhead)))
    assert better < worse
