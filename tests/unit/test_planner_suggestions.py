"""What an Unschedulable condition suggests (issue 25): every change it offers, applied to the
job or the fleet, plans with the operator's own entry point (`planning.make_plan`), and one
fleet gives one message however its nodes and pods are listed, so a pass that sees the same
cluster posts no second Event.

The fleet has only small GPUs free: the H100 and the A100 are taken by another job's pods, two
RTX 4090s (24 GiB) are free, and four V100s (16 GiB) that cannot train in bfloat16.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from relaytrain_operator.domain.planning import PlanError, make_plan
from relaytrain_operator.domain.status import READY, condition, to_manifest
from relaytrain_operator.loop.decide import ModelConfig, decide
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.decide_cases import (
    JOB,
    SETTINGS,
    events,
    node,
    observed,
    pod,
    unbound,
)
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import LLAMA3_8B_CONFIG

pytestmark = pytest.mark.unit

JsonDict = dict[str, Any]

LLAMA3_8B = LLAMA3_8B_CONFIG


def v100(name: str, gpus: int) -> JsonDict:
    """A node of V100 16 GB GPUs (no bfloat16), in pool `v100`."""
    n = node(name, "rtx", gpus=gpus)
    n["metadata"]["labels"].update(
        {
            "nvidia.com/gpu.product": "Tesla-V100-SXM2-16GB",
            "nvidia.com/gpu.memory": "16384",
            "relaytrain.io/pool": "v100",
        }
    )
    return n


def grown(nodes: list[JsonDict], pool: str, gpus: int) -> list[JsonDict]:
    """`nodes` and one more node of `pool` with `gpus` free GPUs."""
    if pool == "v100":
        return [*nodes, v100("v100-more", gpus)]
    return [*nodes, node(f"{pool}-more", pool, gpus=gpus)]


NODES = [
    node("h100-0", "h100"),
    node("a100-0", "a100"),
    node("rtx-0", "rtx"),
    node("rtx-1", "rtx"),
    v100("v100-0", 4),
]
HELD = [pod(0, job="other", node_name="h100-0"), pod(1, job="other", node_name="a100-0")]
"""Another job's pods on the H100 and the A100: only the RTX 4090s and the V100s are free."""

LLAMA_JOB = (
    JOB.model("s3://models/llama/", dtype="bfloat16")
    .dataset(sequence_length=1024)
    .training(micro_batch_size=4, micro_batches=8)
    .method("lora")
    .pipeline(stages="auto", replicas=1)
)
"""The decide cases' job, fine-tuning Llama 3 8B in bfloat16 (too big for the free GPUs)."""

FULL = LLAMA_JOB.method("full").training(micro_batch_size=1)
LONG = LLAMA_JOB.dataset(sequence_length=4096).training(micro_batch_size=2)
UNFIT = {
    "the float16 suggestion (auto stages)": LLAMA_JOB,
    "two stages": LLAMA_JOB.pipeline(stages=2),
    "two stages, full fine-tuning": FULL.pipeline(stages=2),
    "two pipelines": LONG.pipeline(replicas=2),
    "two pipelines, full fine-tuning": FULL.pipeline(replicas=2),
}
"""Jobs that do not fit NODES; before issue 25 each was offered a change that did not fit."""


def plan_of(job: Job, nodes: list[JsonDict], pods: list[JsonDict] = HELD) -> JsonDict:
    """status.plan as the operator makes it (raises PlanError)."""
    return make_plan(
        parse_job(job.build()), LLAMA3_8B, nodes, pods, default_link=SETTINGS.default_link
    )


def unfit(job: Job, nodes: list[JsonDict] = NODES) -> PlanError:
    with pytest.raises(PlanError) as err:
        plan_of(job, nodes)
    return err.value


def applied(job: Job, nodes: list[JsonDict], suggestion: str) -> tuple[Job, list[JsonDict]]:
    """The job and the fleet with `suggestion` (as a condition words it) carried out."""
    if match := re.fullmatch(r"dtype (\w+)( \(.*\))?", suggestion):
        return job.model(dtype=match[1]), nodes
    if match := re.fullmatch(r"method (\w+) \(.*\)", suggestion):
        return job.method(match[1]), nodes
    if match := re.fullmatch(r"microBatchSize (\d+) \(now \d+\)", suggestion):
        return job.training(micro_batch_size=int(match[1])), nodes
    if match := re.fullmatch(r"sequenceLength (\d+) \(now \d+\)", suggestion):
        return job.dataset(sequence_length=int(match[1])), nodes
    if match := re.fullmatch(r"(\d+) more \S+ GPU\(s\) in pool '(\w+)'", suggestion):
        return job, grown(nodes, match[2], int(match[1]))
    raise AssertionError(f"a suggestion this test cannot carry out: {suggestion!r}")


@pytest.mark.parametrize("job", UNFIT.values(), ids=UNFIT.keys())
def test_every_suggestion_plans_when_carried_out(job: Job) -> None:
    err = unfit(job)
    assert err.suggestions, str(err)
    for suggestion in err.suggestions:
        changed, nodes = applied(job, NODES, suggestion)
        try:
            plan_of(changed, nodes)
        except PlanError as refused:
            pytest.fail(f"suggested {suggestion!r}, but then: {refused}")


def test_a_dtype_that_does_not_fit_either_is_not_suggested() -> None:
    # Only the V100s are free: no pool trains in bfloat16, and in float16 the full
    # fine-tuning of an 8B model does not fit 4 x 16 GiB either.
    only_v100 = [v100("v100-0", 4)]
    err = unfit(LLAMA_JOB.method("full"), only_v100)
    assert "No pool can train in bfloat16" in str(err)
    assert "dtype float16" not in err.suggestions
    for suggestion in err.suggestions:
        plan_of(*applied(LLAMA_JOB.method("full"), only_v100, suggestion))


def test_a_dtype_that_fits_is_suggested_and_plans() -> None:
    only_v100 = [v100("v100-0", 4)]
    job = LLAMA_JOB.method("qlora").dataset(sequence_length=256).training(micro_batch_size=1)
    err = unfit(job, only_v100)
    assert err.suggestions == ["dtype float16"]
    plan_of(*applied(job, only_v100, "dtype float16"))


@pytest.mark.parametrize("job", UNFIT.values(), ids=UNFIT.keys())
def test_one_fleet_gives_one_message_however_it_is_listed(job: Job) -> None:
    first = str(unfit(job))
    again = str(unfit(job))
    with pytest.raises(PlanError) as reordered:
        plan_of(job, NODES[::-1], HELD[::-1])
    assert first == again == str(reordered.value)


def test_a_pool_with_a_pinned_pod_gives_one_message_however_its_nodes_are_listed() -> None:
    # Another job's stage pod waits pinned to pool rtx, whose two free GPUs differ in memory.
    small = node("rtx-1", "rtx")
    small["metadata"]["labels"]["nvidia.com/gpu.memory"] = "20000"
    nodes = [node("rtx-0", "rtx"), small, v100("v100-0", 4)]
    pinned = [unbound(pod(0, "Pending", job="other", pool="rtx"))]
    messages = set()
    for listed in (nodes, nodes[::-1]):
        with pytest.raises(PlanError) as err:
            plan_of(LLAMA_JOB, listed, pinned)
        messages.add(str(err.value))
    assert len(messages) == 1, messages


def test_a_job_that_stays_unschedulable_posts_one_event() -> None:
    job = LLAMA_JOB.pipeline(stages=2)
    model = ModelConfig(LLAMA3_8B)
    decision = decide(observed(job.build(), nodes=NODES, cluster_pods=HELD, model=model), SETTINGS)
    assert decision.status is not None
    ready = condition(decision.status, READY)
    assert ready is not None and ready.reason == "Unschedulable"
    assert "It would fit with: " in ready.message
    assert [e.reason for e in events(decision)] == ["Unschedulable"]
    status = to_manifest(decision.status)
    for nodes, held in [(NODES, HELD), (NODES[::-1], HELD[::-1])]:
        later = decide(
            observed(job.status(status).build(), nodes=nodes, cluster_pods=held, model=model),
            SETTINGS,
        )
        assert later.status is not None
        assert condition(later.status, READY) == ready
        assert events(later) == []


def test_a_refusal_is_not_planned_again_for_the_same_fleet(monkeypatch: Any) -> None:
    # Its diagnosis re-plans every suggestion (seconds on a large fleet), and the operator
    # plans an Unschedulable job again on every pass: the same inputs, the same refusal.
    from relaytrain_operator.domain import planning

    calls: list[int] = []
    real = planning.plan_fleet

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "plan_fleet", counted)
    job = LLAMA_JOB.pipeline(stages=2).dataset(sequence_length=1000)  # a job of its own
    first, again = unfit(job), unfit(job)
    assert str(first) == str(again) and len(calls) == 1
    more = [*NODES, node("rtx-9", "rtx")]  # the fleet moved: planned afresh
    with pytest.raises(PlanError):
        plan_of(job, more)
    assert len(calls) == 2
