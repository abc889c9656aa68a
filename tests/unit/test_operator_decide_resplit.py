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
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION
from relaytrain_operator.domain.status import rfc3339, to_manifest
from relaytrain_operator.loop.decide import WAITING_ANNOTATION, Decision, ModelConfig, decide
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

    # The plan is written first, then every stage pod goes; no pod is created yet.
    assert summary(decision) == [
        "patch", "delete:j-stage-0", "delete:j-stage-1", "event:Replanned", "patch"
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


def test_a_job_under_kueue_is_never_resplit() -> None:
    # Its quota is Kueue's to give (and one of several pipelines comes back instead: the
    # membership tests).
    queued = (
        JOB.pipeline(stages="auto")
        .label("kueue.x-k8s.io/queue-name", "team")
        .status(running_status(stage(0), stage(1, phase="Pending", restarts=1, ready=False)))
        .build()
    )
    pods = [pod(0), _waiting(COST * 3)]
    decision = decide(observed(queued, pods, nodes=NODES, cluster_pods=pods + THEIRS), SETTINGS)
    assert "event:Replanned" not in summary(decision)
