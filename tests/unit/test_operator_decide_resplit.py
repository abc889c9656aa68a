"""A job of one pipeline whose replacement waits for a GPU is re-split for the GPUs it can
have once it has waited as long as a re-split costs (loop/decide/resplit.py,
domain/resplit.py; docs/operator.md, "A replacement that cannot fit")."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

import pytest
from relaytrain_operator.domain.builders.labels import SPLIT_ANNOTATION
from relaytrain_operator.domain.progress import Progress
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION
from relaytrain_operator.domain.status import rfc3339, to_manifest
from relaytrain_operator.loop.actions import PutPlan
from relaytrain_operator.loop.decide import (
    WAITING_ANNOTATION,
    Decision,
    ModelConfig,
    decide,
    needs,
    stage_pods,
)
from relaytrain_operator.spec import FormerPlan
from relaytrain_testkit.decide_cases import (
    JOB,
    NOW,
    SETTINGS,
    events,
    node,
    observed,
    pod,
    running_status,
    stage,
)
from relaytrain_testkit.decide_fleet import LLAMA_8B, run_pods
from relaytrain_testkit.decide_kueue import ADMITTED, kobserved, workload_of
from relaytrain_testkit.decide_views import created, ready_reason, summary

pytestmark = pytest.mark.unit

COST = SETTINGS.join_seconds
"""What a re-split costs (--join-seconds): how long a replacement waits first."""
NODES = [node("a100-0", "a100"), node("a100-1", "a100"), node("h100-0", "h100", zone="b")]
"""Stage 1's rtx node is gone; a100-1 and h100-0 are other jobs'."""
THEIRS = [pod(0, job="other", node_name="a100-1"), pod(1, job="other", node_name="h100-0")]


def _waiting(waited: float) -> dict[str, Any]:
    """Stage 1's successor (restart 1), unscheduled for `waited` seconds: no free GPU."""
    successor = pod(1, node_name="", incarnation=1, annotations={
        WAITING_ANNOTATION: "Stage 1 waits for a GPU on pool rtx: no free GPU."})  # fmt: skip
    successor["spec"]["nodeName"] = None
    successor["status"] = {"phase": "Pending"}
    successor["metadata"]["creationTimestamp"] = rfc3339(NOW - timedelta(seconds=waited))
    return successor


def _job(stages: int | str = "auto", **status: Any) -> dict[str, Any]:
    failed = stage(1, phase="Pending", restarts=1, ready=False, node=None,
                   lastFailure="NodeLost", lastFailureTime="2026-11-22T09:57:00Z")  # fmt: skip
    return JOB.pipeline(stages=stages).status(running_status(stage(0), failed, **status)).build()


def _decide(job: dict[str, Any], pods: list[dict[str, Any]]) -> Decision:
    return decide(observed(job, pods, nodes=NODES, cluster_pods=pods + THEIRS), SETTINGS)


def test_a_replacement_that_waited_as_long_as_a_resplit_costs_has_the_pipeline_resplit() -> None:
    pods = [pod(0), _waiting(COST + 5)]
    decision = _decide(_job(), pods)

    # The plan is written first, then every stage pod goes, the one waiting for a node
    # first (it would take the GPU stage 0's frees); no pod is created yet.
    assert summary(decision) == [
        "patch", "delete:j-stage-1", "delete:j-stage-0", "event:Replanned", "patch"
    ]  # fmt: skip
    assert decision.status is not None and decision.status.plan is not None
    plan = decision.status.plan
    assert [(s.pool, s.layer_start, s.layer_end) for s in plan.stages] == [("a100", 0, 30)]
    assert plan.predicted_tokens_per_second and not plan.several()
    # The stage keeps its failure record: a re-split resets no restart budget.
    assert [(s.index, s.pool, s.restarts, s.phase) for s in decision.status.stages] == [
        (0, "a100", 0, None)
    ]
    assert decision.status.phase == "Recovering" and ready_reason(decision) == "Replanned"
    # Every stage is replaced: a new plan epoch, which the new pods' documents carry.
    assert decision.status.plan_epoch == 1
    (event,) = events(decision)
    assert event.type == "Normal" and event.reason == "Replanned"
    assert f"waited {int(COST + 5)} s for a GPU" in event.message
    assert "1 stages a100[0:30) instead of 2 stages a100[0:15) → rtx[15:30)" in event.message
    assert decision.retry_after is not None and decision.retry_after <= 1.0

    # Next pass: the old pods are going (no failure counted, the stage was never seen in the
    # new plan), the one of a stage the plan no longer has is not touched again.
    status = to_manifest(decision.status)
    going = [copy.deepcopy(p) for p in pods]
    for p in going:
        p["metadata"]["deletionTimestamp"] = rfc3339(NOW)
    waiting = _decide(JOB.pipeline(stages="auto").status(status).build(), going)
    assert [a for a in summary(waiting) if not a.startswith(("patch", "event"))] == []
    assert waiting.restarts == 0

    # Once they are gone, the new plan's one stage is created, recording its split.
    after = _decide(JOB.pipeline(stages="auto").status(status).build(), [])
    zero = created(after, "j-stage-0")
    assert zero["metadata"]["annotations"][SPLIT_ANNOTATION] == "0-30"
    assert zero["spec"]["nodeSelector"]["relaytrain.io/pool"] == "a100"
    config = json.loads(zero["spec"]["containers"][0]["env"][0]["value"])
    assert (config["stage"]["layerStart"], config["stage"]["layerEnd"]) == (0, 30)
    assert config["stage"]["count"] == 1
    assert "create:j-stage-1" not in summary(after)
    # The job's store names the new plan's stages as its writers before any is created: a
    # stage of the old split still running (a node cut off) stops before it writes.
    assert summary(after).index("plan:1") < summary(after).index("create:j-stage-0")
    assert config["job"]["planEpoch"] == 1
    (put,) = [a for a in after.actions if isinstance(a, PutPlan)]
    assert put.document == {"uid": config["job"]["uid"], "epoch": 1}


def test_a_replacement_waits_first_as_long_as_a_resplit_costs() -> None:
    decision = _decide(_job(), [pod(0), _waiting(COST - 40)])
    assert "event:Replanned" not in summary(decision)
    assert ready_reason(decision) == "Unschedulable"
    assert decision.status is not None and len(decision.status.plan.stages) == 2  # type: ignore[union-attr]
    # Woken when the wait is over.
    assert decision.retry_after == pytest.approx(40.0)


def test_no_resplit_when_no_plan_fits_the_gpus_it_can_have() -> None:
    # Two fixed stages: the one GPU the job holds cannot take them.
    decision = _decide(_job(stages=2), [pod(0), _waiting(COST * 3)])
    assert "event:Replanned" not in summary(decision)
    assert ready_reason(decision) == "Unschedulable"


def test_a_plan_that_puts_every_stage_where_it_is_changes_nothing() -> None:
    # The re-split's own plan, with its stage's successor waiting long (its GPU not free).
    first = _decide(_job(), [pod(0), _waiting(COST + 5)])
    assert first.status is not None
    status = to_manifest(first.status)
    status["stages"][0].update(phase="Pending", restarts=1)
    successor = _waiting(COST * 2)
    successor["metadata"]["labels"]["relaytrain.io/stage"] = "0"
    successor["metadata"]["name"] = "j-stage-0"
    successor["metadata"]["annotations"][SPLIT_ANNOTATION] = "0-30"
    successor["metadata"]["annotations"][INCARNATION_ANNOTATION] = "1"
    job = JOB.pipeline(stages="auto").status(status).build()
    held = [pod(0, job="other", node_name="a100-0")]  # someone took its GPU meanwhile
    again = decide(
        observed(job, [successor], nodes=NODES, cluster_pods=[successor, *THEIRS, *held]),
        SETTINGS,
    )
    assert "event:Replanned" not in summary(again) and again.restarts == 0


def test_pods_of_the_old_split_go_without_a_failure_after_an_operator_crash() -> None:
    # The re-split's plan was written; the operator stopped before deleting the pods.
    first = _decide(_job(), [pod(0), _waiting(COST + 5)])
    assert first.status is not None
    status = to_manifest(first.status)
    old = pod(0, annotations={SPLIT_ANNOTATION: "0-15,15-30"})
    decision = _decide(JOB.pipeline(stages="auto").status(status).build(), [old, _waiting(COST)])
    assert summary(decision)[:2] == ["delete:j-stage-1", "delete:j-stage-0"]
    assert decision.restarts == 0 and events(decision) == []
    assert decision.status is not None
    assert [(s.index, s.restarts) for s in decision.status.stages] == [(0, 0)]


def test_no_resplit_without_the_models_config() -> None:
    pods = [pod(0), _waiting(COST * 3)]
    unread = ModelConfig(error="spec.model.uri s3://models/smol/ has no config.json")
    decision = decide(
        observed(_job(), pods, nodes=NODES, cluster_pods=pods + THEIRS, model=unread), SETTINGS
    )
    assert "event:Replanned" not in summary(decision)
    assert ready_reason(decision) == "Unschedulable"


def _queued(stages: int | str = "auto") -> tuple[dict[str, Any], Any]:
    """The job under Kueue and its Workload, admitted for the plan: a GPU of a100 and one
    of rtx."""
    queued = _job(stages)
    queued["metadata"] = {**queued["metadata"], "labels": {"kueue.x-k8s.io/queue-name": "team"}}
    return queued, workload_of(queued, *ADMITTED)


def test_a_job_under_kueue_is_resplit_within_what_its_workload_was_granted() -> None:
    # One stage on the a100 GPU it holds is within its grant. The Workload stays as
    # admitted (the quota it holds, the shape a re-split back returns to).
    job, workload = _queued()
    pods = [pod(0), _waiting(COST + 5)]
    seen = kobserved(job, pods, workload, nodes=NODES, cluster_pods=pods + THEIRS)
    decision = decide(seen, SETTINGS)
    assert "event:Replanned" in summary(decision)
    assert decision.status is not None and decision.status.plan is not None
    assert [s.pool for s in decision.status.plan.stages] == ["a100"]
    assert not [a for a in decision.actions if "Workload" in type(a).__name__]


def test_under_kueue_a_replacement_waits_marked_on_the_pool_its_workload_was_admitted_on() -> None:
    """Stage 1's node (pool rtx) is gone and its replacement is due: without a queue it
    goes to the H100 free on another pool; under Kueue it is created on rtx, the pool its
    Workload was admitted on (the H100 is quota Kueue did not grant), marked as waiting for a
    GPU there, so that the re-split within the admission (above) comes `--join-seconds`
    later, as it would without a queue."""
    free_h100 = [pod(0), *[t for t in THEIRS if t["spec"]["nodeName"] != "h100-0"]]
    plain = decide(observed(_job(), [pod(0)], nodes=NODES, cluster_pods=free_h100), SETTINGS)
    moved = created(plain, "j-stage-1")
    assert moved["spec"]["nodeSelector"]["relaytrain.io/pool"] == "h100"
    assert WAITING_ANNOTATION not in moved["metadata"]["annotations"]
    job, workload = _queued()
    seen = kobserved(job, [pod(0)], workload, nodes=NODES, cluster_pods=free_h100)
    stays = created(decide(seen, SETTINGS), "j-stage-1")
    assert stays["spec"]["nodeSelector"]["relaytrain.io/pool"] == "rtx"
    said = stays["metadata"]["annotations"][WAITING_ANNOTATION]
    assert said.startswith("Stage 1 waits for a GPU on pool rtx: none of its GPUs is free")
    # Waiting there, it stays while the H100 is free (no queue: it moves to it at once).
    pods = [pod(0), _waiting(COST / 2)]
    kept = decide(kobserved(job, pods, workload, nodes=NODES, cluster_pods=free_h100), SETTINGS)
    assert "delete:j-stage-1" not in summary(kept)
    plain = decide(observed(_job(), pods, nodes=NODES, cluster_pods=free_h100), SETTINGS)
    assert "delete:j-stage-1" in summary(plain) and "event:StageMoving" in summary(plain)


def test_a_job_under_kueue_is_not_resplit_onto_gpus_its_workload_was_not_granted() -> None:
    pods = [pod(0), _waiting(COST * 3)]
    free_a100 = pods + [t for t in THEIRS if t["spec"]["nodeName"] != "a100-1"]
    # Admitted for rtx alone (whose node is gone): an a100 GPU is quota Kueue did not grant.
    job, workload = _queued()
    only_rtx = copy.deepcopy(workload)
    admission = only_rtx["status"]["admission"]
    admission["podSetAssignments"] = [
        a for a in admission["podSetAssignments"] if a["flavors"]["nvidia.com/gpu"] == "fr"
    ]
    # Two stages fixed, a second a100 free: both on a100, where it was granted one GPU.
    two, granted = _queued(stages=2)
    for queued, workload in ((job, only_rtx), (two, granted)):
        seen = kobserved(queued, pods, workload, nodes=NODES, cluster_pods=free_a100)
        decision = decide(seen, SETTINGS)
        assert "event:Replanned" not in summary(decision), workload["status"]["admission"]
        assert ready_reason(decision) == "Unschedulable"
    # Without a queue the waiting stage moves to the free a100 alone: no re-split, which
    # would restart stage 0 too (waiting.py).
    plain = decide(observed(_job(stages=2), pods, nodes=NODES, cluster_pods=free_a100), SETTINGS)
    assert "event:Replanned" not in summary(plain)
    assert [a for a in summary(plain) if a.startswith(("delete", "event"))] == [
        "event:StageMoving", "delete:j-stage-1"
    ]  # fmt: skip


# --- re-split back when GPUs return ---------------------------------------------------

JOB_8B = JOB.pipeline(stages="auto")
"""A job of one pipeline of Llama-3.1-8B (LoRA: one GPU holds it)."""
H100_PLAN = FormerPlan(split="h100[0:32)", stages=1, predicted_tokens_per_second=14_710.0)
"""The plan it had on an H100 before the H100's node went and it was re-split."""
A100 = [node("a100-0", "a100")]


def _on_a100(former: FormerPlan | None = H100_PLAN) -> tuple[dict[str, Any], list[Any]]:
    """The job re-split onto the A100 (its plan remembering `former`) and training there."""
    first = decide(observed(JOB_8B.build(), nodes=A100, model=LLAMA_8B), SETTINGS)
    assert first.status is not None and first.status.plan is not None
    plan = first.status.plan.model_copy(update={"resplit_from": former})
    status = first.status.model_copy(update={"plan": plan})
    pods = run_pods(first, A100)
    running = decide(
        observed(JOB_8B.status(to_manifest(status)).build(), pods, nodes=A100, model=LLAMA_8B),
        SETTINGS,
    )
    assert running.status is not None and running.status.phase == "Running"
    return JOB_8B.status(to_manifest(running.status)).build(), pods


def _far(step: int, total: int) -> Progress:
    return Progress(
        status={"step": step, "totalSteps": total, "lastCommittedStep": step - 5},
        done=False,
        output=None,
    )


def _back(job: dict[str, Any], pods: list[Any], nodes: list[Any], at: Progress) -> Decision:
    """The pass with `nodes`, after one that recorded progress `at` (what prices it)."""
    seen = decide(observed(job, pods, nodes=A100, model=LLAMA_8B, progress=at), SETTINGS)
    assert seen.status is not None
    job = job | {"status": to_manifest(seen.status)}
    return decide(
        observed(job, pods, nodes=nodes, model=LLAMA_8B, progress=at, cluster_pods=pods),
        SETTINGS,
    )


def test_a_pipeline_resplit_onto_a_slower_gpu_goes_back_when_the_fast_one_returns() -> None:
    job, pods = _on_a100()
    assert needs(job, stage_pods(pods)).room  # the planner prices what is free each pass
    # Nothing new is free: it trains on.
    assert "event:Replanned" not in summary(_back(job, pods, A100, _far(40, 5000)))
    # An H100 joins: a re-split back pays (3x the tokens/s over 4,960 steps left against a
    # restart of --join-seconds and the 5 steps since the commit).
    joined = [*A100, node("h100-9", "h100")]
    back = _back(job, pods, joined, _far(40, 5000))
    assert summary(back) == ["patch", "delete:j-stage-0", "event:Replanned", "patch"]
    assert back.status is not None and back.status.plan is not None
    assert [(s.pool, s.layer_start, s.layer_end) for s in back.status.plan.stages] == [
        ("h100", 0, 32)
    ]
    assert back.status.plan.resplit_from is None  # as fast as before the re-split: done
    assert ready_reason(back) == "Replanned" and back.retry_after is not None
    (said,) = events(back)
    assert "re-split from h100[0:32)" in said.message
    assert "1 stages h100[0:32) instead of 1 stages a100[0:32)" in said.message
    assert "predicted tokens/s 4,640 -> 14,710" in said.message
    # Near the end the restart would not pay back: it finishes where it is.
    late = _back(job, pods, joined, _far(4_800, 5000))
    assert "event:Replanned" not in summary(late)


def test_a_resplit_back_that_falls_short_of_the_former_plan_keeps_looking() -> None:
    # Before its re-split it ran faster than an H100 does (say, a pool gone for good).
    faster = H100_PLAN.model_copy(update={"predicted_tokens_per_second": 20_000.0})
    job, pods = _on_a100(faster)
    back = _back(job, pods, [*A100, node("h100-9", "h100")], _far(40, 5000))
    assert back.status is not None and back.status.plan is not None
    assert back.status.plan.stages[0].pool == "h100"
    assert back.status.plan.resplit_from == faster


def test_no_resplit_back_that_gains_less_than_the_margin_or_while_a_stage_starts() -> None:
    job, pods = _on_a100()
    # Another A100 joins: no faster plan (the same places, or no gain by the margin).
    more = [*A100, node("a100-7", "a100")]
    assert "event:Replanned" not in summary(_back(job, pods, more, _far(40, 5000)))
    # An H100 joins while the stage is not training (starting again): not now.
    starting = copy.deepcopy(pods)
    starting[0]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    joined = [*A100, node("h100-9", "h100")]
    assert "event:Replanned" not in summary(_back(job, starting, joined, _far(40, 5000)))


def test_no_resplit_back_without_the_figures_to_price_it() -> None:
    job, pods = _on_a100()
    joined = [*A100, node("h100-9", "h100")]
    # No progress yet (the steps left unknown).
    quiet = decide(observed(job, pods, nodes=joined, model=LLAMA_8B, cluster_pods=pods), SETTINGS)
    assert "event:Replanned" not in summary(quiet)
    # The model's config unread.
    unread = decide(
        observed(job, pods, nodes=joined, model=ModelConfig(error="x"), progress=_far(40, 5000),
                 cluster_pods=pods),
        SETTINGS,
    )  # fmt: skip
    assert "event:Replanned" not in summary(unread)
    # Nodes the planner cannot make pools of.
    odd = node("h100-9", "h100")
    odd["metadata"]["annotations"] = {"relaytrain.io/link-bandwidth-mbps": "fast"}
    broken = _back(job, pods, [*A100, odd], _far(40, 5000))
    assert "event:Replanned" not in summary(broken)
    # A plan recorded without its predicted step time.
    blind = copy.deepcopy(job)
    del blind["status"]["plan"]["predictedStepSeconds"]
    assert "event:Replanned" not in summary(_back(blind, pods, joined, _far(40, 5000)))


def test_under_kueue_a_resplit_back_stays_on_the_pools_its_workload_was_granted() -> None:
    job, pods = _on_a100()
    job["metadata"] = {**job["metadata"], "labels": {"kueue.x-k8s.io/queue-name": "team"}}
    granted = workload_of(job, *ADMITTED)  # a100 and rtx: no h100
    joined = [*A100, node("h100-9", "h100")]
    at = _far(40, 5000)
    seen = decide(kobserved(job, pods, granted, nodes=A100, model=LLAMA_8B, progress=at), SETTINGS)
    assert seen.status is not None
    job = job | {"status": to_manifest(seen.status)}
    back = decide(
        kobserved(job, pods, granted, nodes=joined, model=LLAMA_8B, progress=at,
                  cluster_pods=pods),
        SETTINGS,
    )  # fmt: skip
    assert "event:Replanned" not in summary(back)
    assert back.status is not None and back.status.plan is not None
    assert back.status.plan.resplit_from == H100_PLAN  # it keeps looking
