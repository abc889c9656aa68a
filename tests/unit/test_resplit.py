"""The re-split's rule and plan (domain/resplit.py): wait as long as a re-split costs, then
plan one pipeline on what is free, never with more stages than the job's certificates."""

from __future__ import annotations

from datetime import timedelta

import pytest
from relaytrain_operator.domain.planner import PlanError
from relaytrain_operator.domain.resplit import resplit_plan, resplit_wait, same_places
from relaytrain_operator.spec import FineTuneJob, PlanStatus, parse_job
from relaytrain_testkit.decide_cases import JOB, NOW, node, pod
from relaytrain_testkit.shapes import LLAMA31_8B_CONFIG

pytestmark = pytest.mark.unit

NODES = [node(f"rtx-{i}", "rtx") for i in range(4)] + [node("a100-0", "a100")]
LINK = (1000.0, 10.0)


def _job(stages: int | str) -> FineTuneJob:
    built = JOB.pipeline(stages=stages).dataset("s3://data/train.jsonl", sequence_length=2048)
    return parse_job(built.build())


def _places(plan: dict[str, object]) -> list[tuple[str, int, int]]:
    return [(s.pool, s.layer_start, s.layer_end) for s in PlanStatus.model_validate(plan).stages]


def test_the_wait_is_what_a_resplit_costs_from_when_the_replacement_was_created() -> None:
    assert resplit_wait(NOW - timedelta(seconds=30), NOW, 120) == timedelta(seconds=90)
    assert resplit_wait(NOW - timedelta(seconds=200), NOW, 120) == timedelta(0)


def test_never_more_stages_than_the_job_has_certificates_for() -> None:
    job = _job("auto")
    # Unbounded, the planner spreads an 8B model over several of these GPUs ...
    three = resplit_plan(job, LLAMA31_8B_CONFIG, NODES, [], stages_now=3, default_link=LINK)
    assert 1 < len(_places(three)) <= 3
    # ... but a job of one stage re-splits onto one GPU that holds the whole model.
    one = resplit_plan(job, LLAMA31_8B_CONFIG, NODES, [], stages_now=1, default_link=LINK)
    assert _places(one) == [("a100", 0, 32)]
    # Other jobs' pods hold GPUs: what is left is planned on.
    held = [pod(0, job="other", node_name="a100-0")]
    left = resplit_plan(job, LLAMA31_8B_CONFIG, NODES, held, stages_now=3, default_link=LINK)
    assert "a100" not in {pool for pool, _, _ in _places(left)}


def test_a_fixed_stage_count_is_kept_or_nothing_fits() -> None:
    two = resplit_plan(_job(2), LLAMA31_8B_CONFIG, NODES, [], stages_now=2, default_link=LINK)
    assert len(_places(two)) == 2
    with pytest.raises(PlanError):
        resplit_plan(_job(2), LLAMA31_8B_CONFIG, [node("a100-0", "a100")], [], stages_now=2,
                     default_link=LINK)  # fmt: skip
    # With `auto` too, when no count up to the bound fits, the planner says why.
    with pytest.raises(PlanError, match="do not fit on the 1 usable GPU"):
        resplit_plan(_job("auto"), LLAMA31_8B_CONFIG, [node("rtx-0", "rtx")], [],
                     stages_now=1, default_link=LINK)  # fmt: skip


def test_same_places_compares_pools_and_layers_stage_by_stage() -> None:
    plan = PlanStatus.model_validate(
        {"stages": [{"index": 0, "pool": "a", "layerStart": 0, "layerEnd": 4}]}
    )
    moved = PlanStatus.model_validate(
        {"stages": [{"index": 0, "pool": "b", "layerStart": 0, "layerEnd": 4}]}
    )
    assert same_places(plan.stages, plan.stages) and not same_places(plan.stages, moved.stages)
