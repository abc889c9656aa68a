"""`plan_growth`: pipelines added to a running job on GPUs that became free, its running
pipelines kept, and the rule that keeps a changing fleet from churning the job."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from relaytrain_operator.domain.planner import (
    ModelShape,
    Pool,
    Sync,
    TrainingShape,
    plan_fleet,
    pools_from_file,
)
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN, plan_growth

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ModelShape.from_hf_config(
    json.loads((ROOT / "operator/relaytrain_operator/known_models/llama-3.1-8b.json").read_text())
)
# examples/finetunejob-lora.yaml's settings with 64 micro-batches per step.
TRAINING = TrainingShape(4, 64, 256, compression="int8")
PERIODIC = Sync("periodic", every=8)
POOLS = {p.name: p for p in pools_from_file(yaml.safe_load((ROOT / "hack/pools.yaml").read_text()))}


def _pools(*names: str) -> list[Pool]:
    return [POOLS[n] for n in names]


def test_free_gpus_are_added_as_a_fresh_plan_of_the_whole_fleet_would_use_them() -> None:
    """A job that started on the A100s alone; the H100s and 4090s become free. Its two
    pipelines stay; the pipelines added bring it to what planning the whole fleet afresh
    predicts (that plan has the same two A100 pipelines)."""
    start = plan_fleet(LLAMA, TRAINING, _pools("a100"), sync=PERIODIC)
    fleet = _pools("a100", "h100", "rtx4090")
    growth = plan_growth(
        LLAMA, TRAINING, start.pipelines, fleet, _pools("h100", "rtx4090"),
        steps_left=1000, sync=PERIODIC,
    )  # fmt: skip
    fresh = plan_fleet(LLAMA, TRAINING, fleet, sync=PERIODIC)
    assert growth.tokens_per_second_before == pytest.approx(start.tokens_per_second)
    assert growth.tokens_per_second_after == pytest.approx(fresh.tokens_per_second)
    added = sorted(tuple(s.pool for s in p.stages) for p in growth.added)
    assert added == [("h100",), ("h100",), ("rtx4090", "rtx4090")]
    # Every pipeline keeps a share, the running ones first; they add up to the step's.
    assert len(growth.shares) == 5 and min(growth.shares) >= 1
    assert sum(growth.shares) == TRAINING.micro_batches
    assert [p.micro_batches for p in growth.added] == list(growth.shares[2:])
    assert growth.pays and "save about" in growth.reason


def test_nothing_is_added_where_the_sync_eats_the_gain_or_no_gpu_is_free() -> None:
    # Synchronous: the gradients every step cost more than a third pipeline saves, as
    # plan_fleet finds too (it keeps two H100 pipelines on the whole fleet).
    start = plan_fleet(LLAMA, TRAINING, _pools("h100"))
    fleet = _pools("h100", "a100", "rtx4090")
    growth = plan_growth(
        LLAMA, TRAINING, start.pipelines, fleet, _pools("a100", "rtx4090"), steps_left=1000
    )
    fresh = plan_fleet(LLAMA, TRAINING, fleet)
    assert growth.added == () and not growth.pays
    assert growth.reason == "no pipeline on the free GPUs would shorten the step"
    assert growth.tokens_per_second_before == pytest.approx(fresh.tokens_per_second)
    none_free = plan_growth(LLAMA, TRAINING, start.pipelines, fleet, [], steps_left=1000)
    assert none_free.added == () and none_free.shares == tuple(
        p.micro_batches for p in start.pipelines
    )


def test_a_small_gain_or_a_job_near_its_end_keeps_its_fleet() -> None:
    start = plan_fleet(LLAMA, TRAINING, _pools("a100"), sync=PERIODIC)
    args = (LLAMA, TRAINING, start.pipelines, _pools("a100", "h100"), _pools("h100"))
    gain = plan_growth(*args, steps_left=1000, sync=PERIODIC)
    assert gain.pays and gain.gain > GROWTH_MARGIN
    # The same pipelines, judged against a margin above their gain: not worth the churn.
    high = plan_growth(*args, steps_left=1000, sync=PERIODIC, margin=gain.gain + 0.01)
    assert not high.pays and f"less than the {gain.gain + 0.01:.0%} margin" in high.reason
    assert high.added == gain.added  # what would be added is the same; only the verdict
    # Three steps left: what they save is less than what joining costs.
    late = plan_growth(*args, steps_left=3, sync=PERIODIC)
    assert not late.pays and "no more than joining costs (120 s)" in late.reason


def test_the_job_s_bounds_on_pipelines_and_stages_hold() -> None:
    start = plan_fleet(LLAMA, TRAINING, _pools("a100"), sync=PERIODIC)
    fleet, free = _pools("a100", "h100", "rtx4090"), _pools("h100", "rtx4090")
    three = plan_growth(
        LLAMA, TRAINING, start.pipelines, fleet, free, steps_left=1000, sync=PERIODIC,
        max_pipelines=3,
    )  # fmt: skip
    assert len(three.shares) == 3 and len(three.added) == 1
    two_stage = plan_growth(
        LLAMA, TRAINING, start.pipelines, fleet, free, steps_left=1000, sync=PERIODIC, stages=2
    )
    assert two_stage.added and all(len(p.stages) == 2 for p in two_stage.added)
    full = plan_growth(
        LLAMA, TRAINING, start.pipelines, fleet, free, steps_left=1000, sync=PERIODIC,
        max_pipelines=2,
    )  # fmt: skip
    assert full.added == () and full.tokens_per_second_after == full.tokens_per_second_before
    assert full.reason == "the job runs as many pipelines as it may (2)"


def test_growth_never_predicts_more_than_planning_the_whole_fleet_afresh() -> None:
    """Every way of splitting the lab fleet into what runs and what just became free: the
    running pipelines kept cannot beat a plan free to move them (where that plan's search
    was exhaustive), and adding never makes the step longer."""
    names = ["h100", "a100", "rtx4090"]
    small = TrainingShape(4, 8, 256, compression="int8")
    for r in range(1, len(names)):
        for running in itertools.combinations(names, r):
            free = [n for n in names if n not in running]
            start = plan_fleet(LLAMA, small, _pools(*running), sync=PERIODIC)
            growth = plan_growth(
                LLAMA, small, start.pipelines, _pools(*names), _pools(*free),
                steps_left=10_000, sync=PERIODIC,
            )  # fmt: skip
            assert growth.step_seconds_after <= growth.step_seconds_before * (1 + 1e-9)
            fresh = plan_fleet(LLAMA, small, _pools(*names), sync=PERIODIC)
            if fresh.search == "exhaustive":
                assert growth.step_seconds_after >= fresh.step_seconds * (1 - 1e-9), running


def test_bad_inputs_are_refused() -> None:
    start = plan_fleet(LLAMA, TRAINING, _pools("a100"), sync=PERIODIC)
    with pytest.raises(ValueError, match="at least one pipeline"):
        plan_growth(LLAMA, TRAINING, (), _pools("a100"), _pools("h100"), steps_left=10)
    with pytest.raises(ValueError, match=r"use pools the fleet lacks: \['a100'\]"):
        plan_growth(LLAMA, TRAINING, start.pipelines, _pools("h100"), [], steps_left=10)


def test_two_copies_are_added_where_one_alone_would_not_pay() -> None:
    """24 H100 run six 4-stage pipelines of Llama-3-70B QLoRA (64 micro-batches: shares 11
    and 10); 8 more H100 come free. One more pipeline leaves the slowest share at 10 and
    adds to the sync; two even the shares out at 8: the search prices every count of
    copies, and lands where planning the 32 H100 afresh does."""
    llama_70b = ModelShape(80, 8192, 28672, 64, 8, 128, 128256)
    qlora = TrainingShape(1, 64, 2048, method="qlora")
    h100 = Pool("h100", "NVIDIA-H100-80GB-HBM3", 32, 1000, 10)
    start = plan_fleet(llama_70b, qlora, [replace(h100, gpus=24)])
    assert [len(p.stages) for p in start.pipelines] == [4] * 6
    growth = plan_growth(
        llama_70b, qlora, start.pipelines, [h100], [replace(h100, gpus=8)], steps_left=10_000
    )
    assert [len(p.stages) for p in growth.added] == [4, 4] and growth.shares == (8,) * 8
    fresh = plan_fleet(llama_70b, qlora, [h100])
    assert growth.tokens_per_second_after == pytest.approx(fresh.tokens_per_second)
    assert growth.pays  # 5.3 %: just over the margin
