"""`membership.if_left`: what the operator's rules do when GPUs of a running job's fleet
leave (`relaytrain plan --leave`): one pipeline moves its stage, several lose the pipelines
with a stage there, which train on elsewhere or come back where their stages fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
from relaytrain_operator.cli.plan_format import format_if_left, if_left_dict
from relaytrain_operator.domain.membership import (
    if_left,
    price_return,
    shrunk_pools,
)
from relaytrain_operator.domain.planner import (
    ModelShape,
    PlanError,
    Pool,
    TrainingShape,
    plan,
    plan_fleet,
)
from relaytrain_operator.domain.planner.cost import GIB
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN
from relaytrain_testkit.shapes import LLAMA3_8B_CONFIG

pytestmark = pytest.mark.unit

MODEL = ModelShape.from_hf_config(LLAMA3_8B_CONFIG)
TRAINING = TrainingShape(1, 8, 256, method="lora", lora_rank=16)
"""Llama-3.1-8B LoRA whose one-stage pipeline fits an RTX 4090 (about 17 GiB)."""
H100 = Pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 100_000.0, 0.1)
A100 = Pool("a100", "NVIDIA-A100-SXM4-80GB", 1, 100_000.0, 0.1)
RTX = Pool("rtx", "NVIDIA-GeForce-RTX-4090", 1, 100_000.0, 0.1)


def _two_pipelines() -> tuple[list[Pool], tuple]:
    pools = [H100, A100]
    fleet = plan_fleet(MODEL, TRAINING, pools, replicas=2)
    assert sorted(p.stages[0].pool for p in fleet.pipelines) == ["a100", "h100"]
    return pools, fleet.pipelines


def test_the_pipeline_on_a_leaving_gpu_leaves_and_the_other_takes_the_step() -> None:
    pools, pipes = _two_pipelines()
    on_a100 = next(i for i, p in enumerate(pipes) if p.stages[0].pool == "a100")
    left = if_left(MODEL, TRAINING, pipes, pools, [A100])
    assert left.hit == ((on_a100, 0),) and left.leaving == (on_a100,)
    # Nothing is free for it: it waits, and the H100 trains every micro-batch of the step.
    assert left.waiting == (on_a100,) and left.shares_out == (8,)
    alone = plan(MODEL, TRAINING, [H100]).tokens_per_second
    assert left.tokens_per_second_out == pytest.approx(alone, rel=1e-6)
    assert left.tokens_per_second_out < left.tokens_per_second_before
    assert left.tokens_per_second_after == left.tokens_per_second_out


def test_a_pipeline_that_fits_the_free_gpus_comes_back_at_once() -> None:
    pools, pipes = _two_pipelines()
    on_a100 = next(i for i, p in enumerate(pipes) if p.stages[0].pool == "a100")
    left = if_left(MODEL, TRAINING, pipes, [*pools, RTX], [A100])
    assert left.waiting == () and left.moves == {(on_a100, 0): "rtx"}
    # Back on a slower card: faster than the H100 alone, slower than before.
    assert left.tokens_per_second_out < left.tokens_per_second_after
    assert left.tokens_per_second_after < left.tokens_per_second_before


def test_one_pipeline_moves_its_stage_to_the_smallest_gpu_that_fits() -> None:
    pools = [H100, A100, RTX]
    single = plan(MODEL, TRAINING, [H100])
    left = if_left(MODEL, TRAINING, (single,), pools, [H100])
    assert left.leaving == () and left.moves == {(0, 0): "rtx"}  # 24 GB fits before 80 GB
    assert left.tokens_per_second_out == 0 and left.shares_out == ()
    on_rtx = plan(MODEL, TRAINING, [RTX]).tokens_per_second
    assert left.tokens_per_second_after == pytest.approx(on_rtx, rel=1e-6)
    # A stage of 21.3 GiB fits the 4090's 24 GiB but not the 20.6 GiB a plan may use of it
    # (the planner's margin and reserve): it goes to the A100, as the planner would put it.
    big = replace(TRAINING, micro_batch_size=4)
    heavy = plan(MODEL, big, [H100])
    assert 20.6 * GIB < heavy.stages[0].memory_bytes < 24 * GIB
    assert if_left(MODEL, big, (heavy,), pools, [H100]).moves == {(0, 0): "a100"}
    # With no free GPU it waits.
    stuck = if_left(MODEL, TRAINING, (single,), [H100], [H100])
    assert stuck.waiting == (0,) and stuck.tokens_per_second_after == 0


def test_one_pipeline_whose_stage_fits_nowhere_is_resplit_on_the_gpus_left() -> None:
    """Two stages over an H100 and an A100, nothing else free: the H100 leaves, its stage
    fits nowhere, and the operator re-splits the job onto the A100 once it has waited as long
    as that costs (domain/resplit.py) — as one stage, never more than the job had."""
    two = plan(MODEL, TRAINING, [H100, A100], stages=2)
    left = if_left(MODEL, TRAINING, (two,), [H100, A100], [H100])
    assert left.waiting == (0,) and left.resplit is not None
    assert [(s.pool, s.layer_start, s.layer_end) for s in left.resplit.stages] == [
        ("a100", 0, MODEL.num_layers)
    ]
    alone = plan(MODEL, TRAINING, [A100]).tokens_per_second
    assert alone > 0 and left.tokens_per_second_after == pytest.approx(alone, rel=1e-6)
    shown = format_if_left("h100-0", left, (two,))
    assert "re-split for the GPUs left: 1 stages a100[0:32), from the last commit." in shown
    assert if_left_dict(left)["resplit"]["stages"][0]["pool"] == "a100"
    # A job that fixes two stages cannot be re-split onto one GPU: it waits.
    fixed = if_left(MODEL, TRAINING, (two,), [H100, A100], [H100], fixed_stages=2)
    assert fixed.resplit is None and fixed.tokens_per_second_after == 0
    assert "no plan fits the GPUs left either" in format_if_left("h100-0", fixed, (two,))


def test_a_gpu_no_stage_uses_changes_nothing_and_unknown_pools_are_refused() -> None:
    two = Pool("h100", "NVIDIA-H100-80GB-HBM3", 2, 100_000.0, 0.1)
    single = plan(MODEL, TRAINING, [two], stages=1)
    left = if_left(MODEL, TRAINING, (single,), [two, RTX], [RTX])
    assert left.hit == () and left.tokens_per_second_after == left.tokens_per_second_before
    assert [p.gpus for p in shrunk_pools([two, RTX], [H100])] == [1, 1]
    with pytest.raises(ValueError, match=r"pool 'a100' \(NVIDIA-A100-SXM4-80GB\) is not in"):
        shrunk_pools([two], [A100])


def test_a_return_is_priced_against_the_pipelines_training_and_alone_always_pays() -> None:
    pools = [H100, A100, RTX]
    # The H100 trains; the pipeline out would come back on the A100, or on the RTX.
    on_h100 = (8, [("h100", MODEL.num_layers)])
    alone = plan(MODEL, TRAINING, [H100]).tokens_per_second
    to_a100 = price_return(MODEL, TRAINING, [on_h100], (8, [("a100", MODEL.num_layers)]), pools)
    to_rtx = price_return(MODEL, TRAINING, [on_h100], (8, [("rtx", MODEL.num_layers)]), pools)
    assert to_a100.before == to_rtx.before == pytest.approx(alone, rel=1e-6)
    assert to_a100.after > to_rtx.after > alone * (1 + GROWTH_MARGIN)  # on 100 Gbit/s, both pay
    assert to_a100.pays and to_rtx.pays
    assert (
        to_rtx.words() == f"{to_rtx.before:,.0f} -> {to_rtx.after:,.0f} predicted tokens/s (+10%)"
    )
    # The RTX behind 1 Gbit/s: the adapters' sync each step costs more than its share brings.
    slow = [H100, A100, replace(RTX, link_bandwidth_mbps=1000.0)]
    behind = price_return(MODEL, TRAINING, [on_h100], (8, [("rtx", MODEL.num_layers)]), slow)
    assert behind.after < behind.before and not behind.pays
    # With no pipeline training, a return is the job's only speed: it pays.
    first = price_return(MODEL, TRAINING, [], on_h100, pools)
    assert first.before == 0 and first.pays
    assert first.words() == f"{first.after:,.0f} predicted tokens/s"
    with pytest.raises(PlanError, match="not usable here: l40s"):
        price_return(MODEL, TRAINING, [on_h100], (8, [("l40s", MODEL.num_layers)]), pools)


def test_with_replicas_auto_a_return_that_does_not_pay_is_held_out() -> None:
    pools, pipes = _two_pipelines()
    on_a100 = next(i for i, p in enumerate(pipes) if p.stages[0].pool == "a100")
    # The only free GPU is an RTX behind 1 Gbit/s: coming back there slows the job.
    fleet = [*pools, replace(RTX, link_bandwidth_mbps=1000.0)]
    plain = if_left(MODEL, TRAINING, pipes, fleet, [A100])
    assert plain.moves == {(on_a100, 0): "rtx"} and plain.held_out == {}
    assert plain.tokens_per_second_after < plain.tokens_per_second_out
    paying = if_left(MODEL, TRAINING, pipes, fleet, [A100], paying_only=True)
    assert paying.moves == {} and paying.waiting == ()
    assert list(paying.held_out) == [on_a100]
    where, price = paying.held_out[on_a100]
    assert where == ("rtx",) and not price.pays
    assert price.before == pytest.approx(paying.tokens_per_second_out)
    assert price.after == pytest.approx(plain.tokens_per_second_after)
    assert paying.tokens_per_second_after == pytest.approx(paying.tokens_per_second_out)
    shown = format_if_left("a100-0", paying, pipes)
    assert (
        f"- pipeline {on_a100} would fit on rtx but stays out: its return would not raise "
        f"tokens/s by 5% ({price.words()})." in shown
    )
    assert "- then" not in shown  # nothing comes back
    assert if_left_dict(paying)["heldOut"] == [
        {
            "pipeline": on_a100,
            "pools": ["rtx"],
            "tokensPerSecondWithout": round(price.before, 1),
            "tokensPerSecondWith": round(price.after, 1),
        }
    ]
