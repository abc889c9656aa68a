"""The paced-link fleet benchmark's prediction and its runner: the planner prices the set-up
the bench runs (the measured compute, the paced links, the planner's shares), and every
pipeline link and every replica link of a threaded data-parallel run is paced. (The
measurements themselves run in bench/bench_fleet_measured.py.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from relaytrain_operator.domain.planner import ModelShape
from relaytrain_operator.domain.planner.steptime import step_seconds
from relaytrain_testkit.inputs import random_batches
from relaytrain_testkit.pipelines import run_data_parallel_threads
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.pipeline.transport import Link

from bench import bench_fleet_measured as fm

pytestmark = pytest.mark.unit

SHAPE = ModelShape(2, 512, 512, 4, 2, 128, 320, tie_word_embeddings=True)


def test_planner_gets_the_measured_compute_and_the_paced_links() -> None:
    s = fm.QUICK
    beat = 0.05
    one, two = fm.predict(SHAPE, s, fm.calibrate_tflops(SHAPE, s, beat), 10.0)
    (single,) = one.pipelines
    assert max(st.compute_seconds for st in single.stages) == pytest.approx(beat)
    # Stage 0 sends fp32 activations plus labels and mask over the paced link.
    tokens = s.mbs * s.seq
    forward = tokens * 512 * 4 + tokens * 16
    assert single.stages[0].link_seconds == pytest.approx(
        forward / (10.0 * fm.MBIT) + fm.LOOPBACK_MS / 1000
    )
    # The step is 1F1B played out over the paced links (each frame's bytes over the rate, and
    # the loopback's latency), at least M + 1 compute beats.
    assert single.timeline is not None
    assert one.step_seconds == pytest.approx(step_seconds(single.timeline))
    assert one.step_seconds >= (s.micro_batches + 1) * beat
    # Two identical 2-stage pipelines share the step evenly, each played out for its half.
    assert [p.micro_batches for p in two.pipelines] == [s.micro_batches // 2] * 2
    assert [len(p.stages) for p in two.pipelines] == [2, 2]
    half = step_seconds(replace(single.timeline, micros=s.micro_batches // 2))
    assert two.step_seconds == pytest.approx(half + two.sync.per_step_seconds)
    # The sync of LoRA r4 on q/v moves one copy of a stage's gradients over a paced link.
    lora_bytes = 4 * 4 * ((512 + 512) + (512 + 256))
    assert two.sync.bandwidth_seconds == pytest.approx(lora_bytes / (10.0 * fm.MBIT))
    assert 1.7 < two.tokens_per_second / one.tokens_per_second < 9 / 5


def test_data_parallel_threads_pace_every_pipeline_and_replica_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rates: list[float | None] = []
    original = Link.limit_rate

    def record(self: Link, rate: float | None) -> None:
        rates.append(rate)
        original(self, rate)

    monkeypatch.setattr(Link, "limit_rate", record)
    model = tiny_model_dir(tmp_path / "m", layers=2)
    splits = [[(0, 1), (1, 2)], [(0, 1), (1, 2)]]
    runs = run_data_parallel_threads(
        model, splits, [1, 1], random_batches(1, 2, 1, 8, 300),
        fm.training_spec(replace(fm.QUICK, micro_batches=2, mbs=1, seq=8), 1),
        credentials=fm.credentials([2, 2]), lora=fm.LORA, replicas="links", link_rate=1e7,
    )  # fmt: skip
    assert len(runs) == 2 and all(len(r.losses) == 1 for r in runs)
    # Both ends of each pipeline's link (2) and of each replica link (s0-s0, s1-s1: 2).
    assert rates == [1e7] * 8
