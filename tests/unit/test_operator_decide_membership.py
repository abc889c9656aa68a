"""The job follows its fleet: a pipeline whose node announces its end leaves without a
failure counted, and a pipeline out of the job — left, or given up — comes back where its
stages fit on free GPUs (domain/membership.py, decide/membership.py)."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from relaytrain_operator.domain.membership import (
    DEPARTURE_TAINTS,
    MAX_DOUBLINGS,
    departure,
    return_wait,
)
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION
from relaytrain_operator.domain.status import condition, to_manifest
from relaytrain_operator.loop.decide import Decision, ModelConfig, decide, needs, stage_pods
from relaytrain_operator.spec import FailurePolicy, PipelineStatus
from relaytrain_testkit.decide_cases import (
    JOB,
    NODES,
    NOW,
    SETTINGS,
    events,
    node,
    observed,
    pod,
    running_status,
    stage,
)
from relaytrain_testkit.decide_fleet import (
    FLEET,
    LLAMA_8B,
    failed,
    far_a100,
    fleet,
    named,
    without,
)
from relaytrain_testkit.decide_kueue import ADMITTED, kobserved, workload_of
from relaytrain_testkit.decide_views import created, progress, ready_reason, summary

pytestmark = pytest.mark.unit

SPOT = {"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}


def cordoned(name: str) -> list[dict[str, Any]]:
    """NODES with `name` cordoned, as `kubectl drain` leaves it."""
    nodes = copy.deepcopy(NODES)
    for n in nodes:
        if n["metadata"]["name"] == name:
            n["spec"]["unschedulable"] = True
    return nodes


def tainted(name: str, taint: dict[str, str]) -> list[dict[str, Any]]:
    nodes = copy.deepcopy(NODES)
    for n in nodes:
        if n["metadata"]["name"] == name:
            n["spec"]["taints"] = [taint]
    return nodes


def stored(decision: Decision, job: dict[str, Any]) -> dict[str, Any]:
    assert decision.status is not None
    return FLEET.status(to_manifest(decision.status)).build() | {"spec": job["spec"]}


def pipeline(decision: Decision, p: int) -> Any:
    assert decision.status is not None and decision.status.pipelines is not None
    return decision.status.pipelines[p]


def test_a_cordoned_node_takes_its_pipeline_out_without_a_failure_and_it_comes_back() -> None:
    job, pods = fleet()  # pipeline 1 on a100-1 and a100-0
    left = decide(observed(job, pods, nodes=cordoned("a100-0"), progress=progress(40)), SETTINGS)
    assert summary(left) == [
        "delete:j-p1-s0",
        "delete:j-p1-s1",
        "event:PipelineLeaving",
        "given-up:1",
        "patch",
    ]
    said = events(left)[0].message
    assert "Pipeline 1 leaves at step 40: node a100-0 is cordoned" in said
    gone = pipeline(left, 1)
    assert (gone.phase, gone.left_at_step, gone.restarts) == ("Left", 40, 0)
    assert gone.left_reason == "node a100-0 is cordoned (a drain or maintenance)"
    assert left.status is not None and left.status.phase == "Running"
    assert left.status.restarts == 0  # no failure counted
    assert "pipeline 1 left: node a100-0 is cordoned" in condition(left.status, "Degraded").message  # type: ignore[union-attr]
    job = stored(left, job)
    alive = without(pods, "j-p1-s0", "j-p1-s1")
    # The drained node's pods still going: nothing is created under their names.
    going = [p | {"metadata": p["metadata"] | {"deletionTimestamp": "x"}} for p in pods[2:]]
    assert summary(decide(observed(job, alive + going, nodes=cordoned("a100-0")), SETTINGS)) == [
        "given-up:1"
    ]
    # Gone, and one GPU free (a100-1, its other stage's): it waits for a second (the
    # cordoned node is not eligible).
    waiting = decide(observed(job, alive, nodes=cordoned("a100-0")), SETTINGS)
    assert summary(waiting) == ["given-up:1"]
    assert pipeline(waiting, 1).phase == "Left"
    # A new a100 joins: the pipeline comes back there and on the a100 its other stage left.
    # The store stops naming it before its pods are created.
    joined = [*cordoned("a100-0"), node("a100-9", "a100")]
    back = decide(observed(job, alive, nodes=joined, progress=progress(55)), SETTINGS)
    assert [s for s in summary(back) if s.startswith(("create:j-", "given-up"))] == [
        "given-up:",
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]
    assert "Pipeline 1 comes back after step 55 (it left at step 40: node a100-0" in next(
        e.message for e in events(back) if e.reason == "PipelineAdded"
    )
    for k in (0, 1):
        assert created(back, f"j-p1-s{k}")["spec"]["nodeSelector"]["relaytrain.io/pool"] == "a100"
    again = pipeline(back, 1)
    assert (again.phase, again.returns, again.returned_at_step) == ("Pending", 1, 55)
    assert again.left_at_step == 40  # its last departure stays on record
    assert back.retry_after is not None  # the next pass soon: another may fit then


def test_a_job_of_one_pipeline_moves_a_drained_stage_without_counting_a_restart() -> None:
    # Nothing to hand the job to: its stage trains on until the drain evicts it.
    job = JOB.status(running_status(stage(0), stage(1))).build()
    pods = [pod(0), pod(1)]  # on a100-0 and rtx-0
    assert summary(decide(observed(job, pods, nodes=cordoned("a100-0")), SETTINGS)) == []
    # Evicted, then gone: replaced elsewhere as a failed stage is, but no restart counted,
    # and the Event says why.
    moved = decide(observed(job, [pod(1)], nodes=cordoned("a100-0")), SETTINGS)
    assert "create:j-stage-0" in summary(moved)
    assert moved.status is not None and moved.status.restarts == 0
    assert moved.status.stages[0].restarts == 0
    assert moved.status.stages[0].last_failure == (
        "NodeLeaving: node a100-0 is cordoned (a drain or maintenance)"
    )
    (said,) = [e for e in events(moved) if e.reason == "StageMoving"]
    assert said.type == "Normal" and "not counted as a restart" in said.message
    # The same pod gone from a node that announced nothing is a failure, counted.
    failed_here = decide(observed(job, [pod(1)]), SETTINGS)
    assert failed_here.status is not None and failed_here.status.stages[0].restarts == 1


def test_a_drain_eviction_and_a_spot_taint_are_departures_too() -> None:
    job, pods = fleet()
    # kubectl drain: cordon, then evict. A pass that sees the eviction first still counts
    # no failure: the pod is going from a node that announced its end.
    evicted = [
        p | {"metadata": p["metadata"] | {"deletionTimestamp": "2026-11-22T10:00:00Z"}}
        if p["metadata"]["name"] == "j-p0-s1"
        else p
        for p in pods
    ]
    drained = decide(observed(job, evicted, nodes=cordoned("h100-0")), SETTINGS)
    assert summary(drained)[:2] == ["delete:j-p0-s0", "event:PipelineLeaving"]
    assert pipeline(drained, 0).phase == "Left" and pipeline(drained, 0).restarts == 0
    # The evicted pod already gone when the pass looks: its recorded node still says why.
    gone = decide(observed(job, without(pods, "j-p0-s1"), nodes=cordoned("h100-0")), SETTINGS)
    assert summary(gone)[:2] == ["delete:j-p0-s0", "event:PipelineLeaving"]
    assert gone.status is not None and gone.status.restarts == 0
    assert pipeline(gone, 0).left_reason == "node h100-0 is cordoned (a drain or maintenance)"
    spot = decide(observed(job, pods, nodes=tainted("rtx-0", SPOT)), SETTINGS)
    assert pipeline(spot, 0).left_reason == (
        "node rtx-0 has the taint cloud.google.com/impending-node-termination: "
        "its spot or preemptible VM ends soon"
    )
    # A taint that announces nothing leaves the pipeline training.
    other = {"key": "example.com/maintenance-window", "effect": "PreferNoSchedule"}
    assert summary(decide(observed(job, pods, nodes=tainted("rtx-0", other)), SETTINGS)) == []


def test_when_every_pipeline_leaves_the_job_waits_suspended_and_resumes_from_the_commit() -> None:
    job, pods = fleet()
    nodes = copy.deepcopy(NODES)
    for n in nodes:
        n["spec"]["unschedulable"] = True
    gone = decide(observed(job, pods, nodes=nodes, progress=progress(40, 30)), SETTINGS)
    assert gone.status is not None
    assert (gone.status.phase, ready_reason(gone)) == ("Suspended", "FleetGone")
    assert "Every pipeline left" in condition(gone.status, "Ready").message  # type: ignore[union-attr]
    assert [p.phase for p in gone.status.pipelines or ()] == ["Left", "Left"]
    assert "event:FleetGone" in summary(gone)
    # The GPUs come back: one pipeline a pass, the first restoring the last commit.
    job = stored(gone, job)
    first = decide(observed(job, [], progress=progress(40, 30)), SETTINGS)
    assert [s for s in summary(first) if s.startswith("create:j-")] == [
        "create:j-p0-s0",
        "create:j-p0-s1",
    ]
    assert first.status is not None and first.status.phase != "Suspended"
    assert pipeline(first, 1).phase == "Left"


def test_a_given_up_pipeline_comes_back_after_its_wait_doubled_by_each_return() -> None:
    job, pods = fleet()
    job["spec"]["failurePolicy"]["returnAfterSeconds"] = 600
    job["status"]["stages"][2]["restarts"] = 2
    last_try = failed(named(pods, "j-p1-s0"))
    last_try["metadata"]["annotations"][INCARNATION_ANNOTATION] = "2"
    given = decide(observed(job, [*without(pods, "j-p1-s0"), last_try]), SETTINGS)
    out = pipeline(given, 1)
    assert (out.phase, out.left_time) == ("Failed", "2026-11-22T10:00:00Z")
    assert out.left_reason is not None and "Stage p1/s0 failed again" in out.left_reason
    job = stored(given, job)
    alive = without(pods, "j-p1-s0", "j-p1-s1")
    early = decide(observed(job, alive, now=NOW + timedelta(seconds=599)), SETTINGS)
    assert [s for s in summary(early) if s.startswith("create:j-")] == []
    assert early.retry_after == 1.0  # woken when the wait is over
    later = decide(observed(job, alive, now=NOW + timedelta(seconds=600)), SETTINGS)
    assert [s for s in summary(later) if s.startswith("create:j-")] == [
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]
    back = pipeline(later, 1)
    assert (back.returns, back.restarts) == (1, 0)  # the restart budget is whole again
    # Given up again: the next wait is twice as long.
    status = job["status"]
    status["pipelines"][1] |= {"returns": 1}
    wait = decide(observed(job, alive, now=NOW + timedelta(seconds=900)), SETTINGS)
    assert [s for s in summary(wait) if s.startswith("create:j-")] == []
    assert wait.retry_after == 300.0


def out_of_the_job(**entry: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The fleet with pipeline 1 out of the job: its pods gone, `entry` in its status."""
    job, pods = fleet()
    job["status"]["pipelines"][1] |= entry
    return job, without(pods, "j-p1-s0", "j-p1-s1")


def test_a_pipeline_given_up_stays_out_with_return_after_zero_or_near_the_end() -> None:
    job, alive = out_of_the_job(phase="Failed", leftTime="2026-11-22T09:00:00Z")
    never = copy.deepcopy(job)
    never["spec"]["failurePolicy"]["returnAfterSeconds"] = 0
    assert [s for s in summary(decide(observed(never, alive), SETTINGS)) if "create" in s] == []
    assert not needs(never, stage_pods(alive)).room  # nothing to place: no cluster-wide read
    assert needs(job, stage_pods(alive)).room
    # Beside a pipeline that left (and comes back), the one given up still stays out.
    never["status"]["pipelines"][0] |= {"phase": "Failed", "leftTime": "2026-11-22T09:00:00Z"}
    never["status"]["pipelines"][1] |= {"phase": "Left"}
    both = decide(observed(never, []), SETTINGS)
    assert [s for s in summary(both) if s.startswith("create:j-")] == [
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]
    # The job ends in under two minutes: joining would not pay.
    near = copy.deepcopy(job)
    near["status"]["progress"] = {"step": 99, "eta": "2026-11-22T10:01:00Z"}
    assert [s for s in summary(decide(observed(near, alive), SETTINGS)) if "create" in s] == []
    # Where a join costs 30 s (--join-seconds: a small model), the minute left pays for it.
    quick = replace(SETTINGS, join_seconds=30.0)
    assert [s for s in summary(decide(observed(near, alive), quick)) if "create:j-" in s] == [
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]
    # Given up before the time was recorded: its wait counts from this pass.
    undated = copy.deepcopy(job)
    del undated["status"]["pipelines"][1]["leftTime"]
    dated = decide(observed(undated, alive), SETTINGS)
    assert pipeline(dated, 1).left_time == "2026-11-22T10:00:00Z"
    assert dated.retry_after == 300.0


def test_under_kueue_a_pipeline_comes_back_only_on_its_admitted_pools() -> None:
    job, alive = out_of_the_job(phase="Left", leftReason="node a100-0 is cordoned")
    queued = copy.deepcopy(job)
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "q"}
    # a100-0 is gone; an h100 is free, which fits beside a100-1 but is not what Kueue
    # admitted.
    nodes = [n for n in NODES if n["metadata"]["name"] != "a100-0"] + [node("h100-9", "h100")]
    plain = decide(observed(job, alive, nodes=nodes), SETTINGS)
    assert [s for s in summary(plain) if s.startswith("create:j-")] == [
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]
    pools = [created(plain, f"j-p1-s{k}")["spec"]["nodeSelector"] for k in (0, 1)]
    assert [p["relaytrain.io/pool"] for p in pools] == ["a100", "h100"]
    # Both pipelines' Workloads admitted: pipeline 1 waits for a GPU of the pools Kueue
    # granted it.
    workloads = {p: workload_of(queued, *ADMITTED, pipeline=p) for p in (0, 1)}
    held = decide(kobserved(queued, alive, nodes=nodes, workloads=workloads), SETTINGS)
    assert [s for s in summary(held) if s.startswith("create:")] == []
    assert held.status is not None and held.status.pipelines[1].phase == "Left"  # type: ignore[index]
    # A free GPU on its own pool (a100): it comes back there.
    back = decide(
        kobserved(queued, alive, nodes=[*nodes, node("a100-7", "a100")], workloads=workloads),
        SETTINGS,
    )
    assert [s for s in summary(back) if s.startswith("create:j-")] == [
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]


@pytest.mark.parametrize("key", sorted(DEPARTURE_TAINTS))
def test_every_taint_that_announces_an_end_is_a_departure(key: str) -> None:
    n = node("n1", "a100") | {"spec": {"taints": [{"key": key, "effect": "NoExecute"}]}}
    assert departure(n) == f"node n1 has the taint {key}: {DEPARTURE_TAINTS[key]}"


def test_the_wait_of_a_pipeline_given_up_again_and_again_stops_doubling() -> None:
    policy = FailurePolicy(return_after_seconds=60)
    given = PipelineStatus(
        index=1, phase="Failed", ready_stages="0/2", micro_batches=4, returns=50,
        left_time="2026-11-22T10:00:00Z",
    )  # fmt: skip
    assert return_wait(given, policy, NOW) == timedelta(seconds=60 * 2**MAX_DOUBLINGS)


BIG = (
    JOB.dataset("s3://data/train.jsonl", sequence_length=2048)
    .training(steps=100, micro_batch_size=1, micro_batches=64)
    .pipeline(stages=1, replicas="auto")
)
"""Llama-3.1-8B, 64 micro-batches a step: `auto` plans a pipeline on each of NODES' H100
and A100s (the RTX is too small for the whole model)."""


def a100_left() -> tuple[dict[str, Any], list[dict[str, Any]], int, str]:
    """BIG running, then one of its A100 pipelines left (its node cordoned): the job, the
    pods left, that pipeline and its node."""
    job, pods = fleet(BIG, LLAMA_8B)
    assert job["status"]["plan"]["pipelines"], "auto planned several pipelines"
    p = next(
        i
        for i in range(len(job["status"]["plan"]["pipelines"]))
        if named(pods, f"j-p{i}-s0")["spec"]["nodeSelector"]["relaytrain.io/pool"] == "a100"
    )
    name = named(pods, f"j-p{p}-s0")["spec"]["nodeName"]
    left = decide(observed(job, pods, nodes=cordoned(name), model=LLAMA_8B), SETTINGS)
    assert pipeline(left, p).phase == "Left"
    # The Event says what the job trains at without it (the model's prediction).
    said = next(e.message for e in events(left) if e.reason == "PipelineLeaving")
    change = re.search(r"the other pipelines train on \(([\d,]+) -> ([\d,]+) predicted", said)
    assert change is not None, said
    assert int(change[1].replace(",", "")) > int(change[2].replace(",", "")) > 0
    alive = [q for q in pods if not q["metadata"]["name"].startswith(f"j-p{p}-")]
    return stored(left, job), alive, p, name


def test_with_replicas_auto_a_pipeline_comes_back_only_where_its_return_pays() -> None:
    job, alive, p, gone = a100_left()
    # The only free GPU that fits is an A100 behind 100 Mbit/s: the sync of the adapters
    # with it would cost the job more than its share brings. It stays out.
    joined = [*cordoned(gone), far_a100(100)]
    held = decide(observed(job, alive, nodes=joined, model=LLAMA_8B), SETTINGS)
    assert summary(held) == ["event:PipelineHeldOut", f"given-up:{p}", "patch"]
    out = pipeline(held, p)
    assert out.phase == "Left" and out.held_out is not None
    assert out.held_out.startswith("its stages fit on free GPUs (far), but its return would ")
    assert "would not raise the job's predicted tokens/s by 5%" in out.held_out
    change = re.search(r"([\d,]+) -> ([\d,]+) predicted tokens/s \((-\d+)%\)", out.held_out)
    assert change is not None, out.held_out
    assert f"Pipeline {p} stays out: {out.held_out}" in events(held)[0].message
    # The same reason on the next pass: no second Event.
    job = stored(held, job)
    again = decide(observed(job, alive, nodes=joined, model=LLAMA_8B), SETTINGS)
    assert summary(again) == [f"given-up:{p}"]
    # Behind 1 Gbit/s the same GPU pays: it comes back there, and says by how much.
    near = [*cordoned(gone), far_a100(1000)]
    back = decide(observed(job, alive, nodes=near, model=LLAMA_8B), SETTINGS)
    assert [s for s in summary(back) if s.startswith("create:j-")] == [f"create:j-p{p}-s0"]
    assert created(back, f"j-p{p}-s0")["spec"]["nodeSelector"]["relaytrain.io/pool"] == "far"
    added = next(e.message for e in events(back) if e.reason == "PipelineAdded")
    gain = re.search(r"With it: ([\d,]+) -> ([\d,]+) predicted tokens/s \(\+(\d+)%\)", added)
    assert gain is not None and int(gain[3]) >= 5, added
    assert pipeline(back, p).held_out is None  # cleared on its return
    # The user fixed three pipelines: it comes back behind 100 Mbit/s too, paying or not.
    fixed = copy.deepcopy(job)
    fixed["spec"]["pipeline"]["replicas"] = 3
    assert f"create:j-p{p}-s0" in summary(decide(observed(fixed, alive, nodes=joined), SETTINGS))
    # A model config that cannot be priced any more, or not read: it comes back as before
    # the rule, and its Event names no figure.
    for model in (ModelConfig({"model_type": "mystery"}), ModelConfig(error="timed out")):
        blind = decide(observed(job, alive, nodes=joined, model=model), SETTINGS)
        assert f"create:j-p{p}-s0" in summary(blind)
        added = next(e.message for e in events(blind) if e.reason == "PipelineAdded")
        assert "With it" not in added
