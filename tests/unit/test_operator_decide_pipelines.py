"""A job of several pipelines: planned, named and wired per pipeline; a failed stage takes
out its pipeline only; a pipeline out of restarts is given up while the others train on,
and the job fails with the last (decide/stages.py, decide/create.py, decide/progress.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION
from relaytrain_operator.domain.status import READY, condition, load_status, to_manifest
from relaytrain_operator.loop.actions import CreateLinkSecret, DeletePod
from relaytrain_operator.loop.decide import (
    WAITING_ANNOTATION,
    Decision,
    Needs,
    decide,
    needs,
    stage_pods,
)
from relaytrain_testkit.decide_cases import (
    SETTINGS,
    events,
    observed,
    pod,
)
from relaytrain_testkit.decide_fleet import FLEET, failed, fleet, named, run_pods, without
from relaytrain_testkit.decide_views import created, progress, ready_reason, summary

pytestmark = pytest.mark.unit


def stage_document(decision: Decision, name: str) -> dict[str, Any]:
    """The stage-contract document of the pod `decision` created as `name`."""
    env = created(decision, name)["spec"]["containers"][0]["env"]
    return json.loads(next(e["value"] for e in env if e["name"] == "RELAYTRAIN_STAGE_CONFIG"))  # type: ignore[no-any-return]


def test_several_pipelines_are_planned_named_and_wired_per_pipeline() -> None:
    decision = decide(observed(FLEET.build()), SETTINGS)
    assert decision.status is not None and decision.status.plan is not None
    plan = decision.status.plan
    assert [len(p.stages) for p in plan.pipelines] == [2, 2] and plan.stages == []
    assert sum(p.micro_batches for p in plan.pipelines) == 8
    assert summary(decision) == [
        "patch",
        "event:Planned",
        "secret",
        "create:j",
        "create:j-p0-s0",
        "create:j-p0-s1",
        "create:j-p1-s0",
        "create:j-p1-s1",
        "patch",
    ]
    assert events(decision)[0].message.startswith("Planned 2 pipelines on 4 GPUs: pipeline 0 (")
    secret = next(a for a in decision.actions if isinstance(a, CreateLinkSecret))
    assert secret.stage_counts == (2, 2)
    pod10 = created(decision, "j-p1-s0")
    assert pod10["metadata"]["labels"]["relaytrain.io/pipeline"] == "1"
    assert pod10["metadata"]["labels"]["relaytrain.io/stage"] == "0"
    assert pod10["spec"]["hostname"] == "j-p1-s0"
    container = pod10["spec"]["containers"][0]
    assert {"name": "replica", "containerPort": 29501, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    (link,) = [v for v in pod10["spec"]["volumes"] if "secret" in v]
    assert {i["path"]: i["key"] for i in link["secret"]["items"]}["tls.crt"] == "p1-s0.crt"
    config = json.loads(env["RELAYTRAIN_STAGE_CONFIG"]["value"])
    assert config["links"]["next"] == "j-p1-s1.j.ns.svc:29500"
    assert config["replicas"]["pipeline"] == 1 and config["replicas"]["listen"] == "0.0.0.0:29501"
    assert config["replicas"]["shares"] == [p.micro_batches for p in plan.pipelines]
    # Pipeline 0 dials pipeline 1's stages at their stable names; it listens for nobody.
    config00 = stage_document(decision, "j-p0-s0")
    assert "listen" not in config00["replicas"] or config00["replicas"]["listen"] is None
    assert {peer["address"] for peer in config00["replicas"]["peers"]} <= {
        "j-p1-s0.j.ns.svc:29501",
        "j-p1-s1.j.ns.svc:29501",
    }
    assert [(s.pipeline, s.index) for s in decision.status.stages] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert [(p.index, p.phase, p.ready_stages) for p in decision.status.pipelines] == [
        (0, "Pending", "0/2"),
        (1, "Pending", "0/2"),
    ]
    assert decision.status.ready_pipelines == "0/2"


def test_several_pipelines_running_are_ready_and_not_degraded() -> None:
    job, pods = fleet()
    status = load_status(job["status"])
    assert status.phase == "Running" and status.ready_pipelines == "2/2"
    degraded = condition(status, "Degraded")
    assert degraded is not None and degraded.status == "False"
    assert condition(status, READY).message == "All 2 pipelines (4 stages) are training."  # type: ignore[union-attr]
    # A quiet fleet costs nothing.
    assert summary(decide(observed(job, pods), SETTINGS)) == []


def _held(p: dict[str, Any]) -> dict[str, Any]:
    """`p` Pending, its container held by the kubelet for a missing Secret."""
    p = copy.deepcopy(p)
    state = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s" not found'}}
    p["status"] = {"phase": "Pending", "containerStatuses": [{"name": "worker", "state": state}]}
    return p


def test_a_stage_that_cannot_start_says_why_its_pipeline_is_out() -> None:
    job, pods = fleet()
    held = [*without(pods, "j-p1-s0"), _held(named(pods, "j-p1-s0"))]
    decision = decide(observed(job, held), SETTINGS)
    assert decision.status is not None and ready_reason(decision) == "PipelinesDegraded"
    assert condition(decision.status, READY).message == (  # type: ignore[union-attr]
        "1/2 pipelines are training (pipeline 1 is pending: Stage p1/s0 cannot start its "
        'container (CreateContainerConfigError): secret "s" not found); the others train on '
        "with the step's micro-batches shared among them."
    )
    # Held in every pipeline: the job says so as for one pipeline.
    all_held = [_held(named(pods, n)) if n.endswith("s0") else named(pods, n)
                for n in sorted(p["metadata"]["name"] for p in pods)]  # fmt: skip
    stuck = decide(observed(job, all_held), SETTINGS)
    assert stuck.status is not None and ready_reason(stuck) == "CreateContainerConfigError"


def test_a_failed_stage_takes_out_its_pipeline_only() -> None:
    job, pods = fleet()
    broken = [*without(pods, "j-p1-s0"), failed(named(pods, "j-p1-s0"))]
    decision = decide(observed(job, broken), SETTINGS)
    # Only the failed pod goes; no pod of pipeline 0 is touched.
    assert summary(decision) == ["patch", "event:StageRestarting", "delete:j-p1-s0", "patch"]
    assert events(decision)[0].message == (
        "Stage p1/s0 pod j-p1-s0 ended (Failed); replacing it (restart 1 of 2)."
    )
    status = decision.status
    assert status is not None and status.phase == "Running"
    assert [(p.phase, p.restarts) for p in status.pipelines] == [("Running", 0), ("Recovering", 1)]
    assert status.ready_pipelines == "1/2"
    degraded = condition(status, "Degraded")
    assert degraded is not None and degraded.status == "True"
    assert "pipeline 1 is recovering" in degraded.message
    # The successor rejoins from the live pipeline, not from a checkpoint.
    gone = without(pods, "j-p1-s0")
    job = FLEET.status(to_manifest(status)).build()
    job["status"]["progress"] = {"step": 9, "lastCommittedStep": 5}
    successor = decide(observed(job, gone), SETTINGS)
    assert "create:j-p1-s0" in summary(successor)
    assert successor.status is not None
    assert successor.status.stages[2].restored_from_step is None
    # Once it runs, the fleet is whole again.
    back = run_pods(successor)
    whole = decide(
        observed(FLEET.status(to_manifest(successor.status)).build(), [*gone, *back]), SETTINGS
    )
    assert whole.status is not None and whole.status.ready_pipelines == "2/2"
    assert condition(whole.status, "Degraded").status == "False"  # type: ignore[union-attr]


def test_with_no_pipeline_training_a_replacement_restores_the_commit() -> None:
    job, pods = fleet()
    job["status"]["progress"] = {"step": 9, "lastCommittedStep": 5}
    broken = [*without(pods, "j-p0-s1", "j-p1-s0"), failed(named(pods, "j-p1-s0"))]
    decision = decide(observed(job, broken), SETTINGS)
    assert decision.status is not None and decision.status.phase == "Recovering"
    assert ready_reason(decision) == "StageRestarting"
    assert "Replacing stage p0/s1, p1/s0" in condition(decision.status, READY).message  # type: ignore[union-attr]
    assert [s.restored_from_step for s in decision.status.stages] == [None, 5, None, None]


def test_a_pipeline_out_of_restarts_is_given_up_and_the_others_train_on() -> None:
    job, pods = fleet()
    job["status"]["stages"][2]["restarts"] = 2
    last_try = failed(named(pods, "j-p1-s0"))
    last_try["metadata"]["annotations"][INCARNATION_ANNOTATION] = "2"
    broken = [*without(pods, "j-p1-s0"), last_try]
    decision = decide(observed(job, broken), SETTINGS)
    assert summary(decision) == [
        "patch",
        "delete:j-p1-s0",
        "delete:j-p1-s1",
        "event:PipelineFailed",
        "given-up:1",
        "patch",
    ]
    assert "Pipeline 1 is given up" in events(decision)[0].message
    status = decision.status
    assert status is not None and status.phase == "Running"
    assert [p.phase for p in status.pipelines] == ["Running", "Failed"]
    assert [s.pod for s in status.stages] == ["j-p0-s0", "j-p0-s1", None, None]
    assert condition(status, "Degraded").status == "True"  # type: ignore[union-attr]
    # Later passes leave pipeline 1 alone until it may come back, and look for room for it;
    # they read what the store tells the stages, and write it again only when it is not that.
    job = FLEET.status(to_manifest(status)).build()
    alive = without(pods, "j-p1-s0", "j-p1-s1")
    assert needs(job, stage_pods(alive)) == Needs(
        room=True, model=True, progress=True, given_up=True
    )
    told = replace(observed(job, alive), told_given_up=(1,))
    assert summary(decide(told, SETTINGS)) == []
    assert summary(decide(observed(job, alive), SETTINGS)) == ["given-up:1"]
    # The job finishes when the pipelines left finish.
    done = [p | {"status": {"phase": "Succeeded"}} for p in alive]
    finished = decide(observed(job, done), SETTINGS)
    assert finished.status is not None and finished.status.phase == "Succeeded"
    assert finished.status.pipelines is not None
    assert [p.phase for p in finished.status.pipelines] == ["Succeeded", "Failed"]
    assert condition(finished.status, "Degraded").status == "False"  # type: ignore[union-attr]
    # The last pipeline out of restarts fails the job.
    job["status"]["stages"][0]["restarts"] = 2
    end = failed(named(pods, "j-p0-s0"))
    end["metadata"]["annotations"][INCARNATION_ANNOTATION] = "2"
    last = decide(observed(job, [end, named(pods, "j-p0-s1")]), SETTINGS)
    assert last.status is not None and ready_reason(last) == "BackoffLimitExceeded"
    assert "Stage p0/s0 failed again" in condition(last.status, READY).message  # type: ignore[union-attr]


def test_pipeline_0_out_of_restarts_is_given_up_like_any_other_as_the_next_writes() -> None:
    # The lowest pipeline training writes the checkpoints and the result (docs/worker.md):
    # pipeline 0 given up leaves the job Running on pipeline 1, which takes the writing over.
    job, pods = fleet()
    job["status"]["stages"][1]["restarts"] = 2
    last_try = failed(named(pods, "j-p0-s1"))
    last_try["metadata"]["annotations"][INCARNATION_ANNOTATION] = "2"
    decision = decide(observed(job, [*without(pods, "j-p0-s1"), last_try]), SETTINGS)
    status = decision.status
    assert status is not None and status.phase == "Running"
    assert [p.phase for p in status.pipelines or ()] == ["Failed", "Running"]
    assert condition(status, "Degraded").status == "True"  # type: ignore[union-attr]
    assert "Pipeline 0 is given up" in events(decision)[0].message
    assert sorted(a.name for a in decision.actions if isinstance(a, DeletePod)) == [
        "j-p0-s0",
        "j-p0-s1",
    ]
    # The job finishes when pipeline 1 does: by its pods, or by progress.json while they
    # still run (pipeline 1 finished with the job either way).
    job = FLEET.status(to_manifest(status)).build()
    alive = without(pods, "j-p0-s0", "j-p0-s1")
    done = [p | {"status": {"phase": "Succeeded"}} for p in alive]
    for finished in (
        decide(observed(job, done), SETTINGS),
        decide(observed(job, alive, progress=progress(100, 100, done=True)), SETTINGS),
    ):  # fmt: skip
        assert finished.status is not None and finished.status.phase == "Succeeded"
        assert [p.phase for p in finished.status.pipelines or ()] == ["Failed", "Succeeded"]


def test_a_replacement_that_waits_for_a_gpu_says_which_pipeline() -> None:
    job, pods = fleet()
    gone = without(pods, "j-p1-s1")
    # Every GPU is held: the successor waits on its pool.
    nodes_held = [*gone, pod(0, job="other", node_name=named(pods, "j-p1-s1")["spec"]["nodeName"])]
    decision = decide(observed(job, gone, cluster_pods=nodes_held), SETTINGS)
    successor = created(decision, "j-p1-s1")
    assert "Stage p1/s1 waits for a GPU" in successor["metadata"]["annotations"][WAITING_ANNOTATION]
    assert decision.status is not None and decision.status.phase == "Running"


def test_periodic_sync_reaches_every_stage_of_every_pipeline() -> None:
    sync = {"mode": "periodic", "everySteps": 4, "outerCode": "int2", "loraMerge": "exact"}
    decision = decide(observed(FLEET.sync("periodic", 4, "int2", "exact").build()), SETTINGS)
    assert decision.status is not None and decision.status.plan is not None
    assert decision.status.phase != "Failed"
    configs = {
        name: stage_document(decision, name)
        for name in ("j-p0-s0", "j-p0-s1", "j-p1-s0", "j-p1-s1")
    }
    assert {name: c["replicas"]["sync"] for name, c in configs.items()} == dict.fromkeys(
        configs, sync
    )
    # Synchronous, the default, is left out of the documents.
    synchronous = decide(observed(FLEET.build()), SETTINGS)
    assert "sync" not in stage_document(synchronous, "j-p1-s0")["replicas"]


def test_the_plan_prices_the_jobs_outer_code() -> None:
    # The operator plans a periodic job as `relaytrain plan` does: its outer code's bytes
    # (2.25 bits a value with int2, against float64 weights' 64), not always float64's; the
    # sync's latency part stays. (Until 2026-11-29 the operator priced every periodic job
    # as float64 weights.)
    priced = {}
    for code in ("float64", "int2"):
        decision = decide(observed(FLEET.sync("periodic", 4, code).build()), SETTINGS)
        assert decision.status is not None and decision.status.plan is not None
        priced[code] = decision.status.plan.predicted_sync_seconds
    assert priced["float64"] is not None and priced["int2"] is not None
    assert 0 < priced["int2"] < 0.75 * priced["float64"]
