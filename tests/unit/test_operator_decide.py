"""Reconcile as a pure decision: observed state in, ordered actions and the new status out.

A table covers the branches a job goes through (first creation, suspend and resume, a stage
failure and its replacement, a lost node, the back-off and the restart limit, completion,
deletion); the tests after it check the pass's flow as a whole (what it reads, what it
writes, when it posts an Event). The concerns have their own modules:
test_operator_decide_admission.py (the first plan, Kueue), test_operator_decide_stages.py
(replacements: where they go, what is counted and patched), test_operator_decide_pipelines.py
(several pipelines), test_operator_decide_progress.py (progress and completion); the
jobs, nodes and pods they decide on are relaytrain_testkit.decide_cases', and the views of
a decision they share are relaytrain_testkit.decide_views'.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace

import pytest
from relaytrain_operator.domain.recovery import REPLACING
from relaytrain_operator.domain.status import READY, condition, to_manifest
from relaytrain_operator.loop.decide import (
    Decision,
    InputProblem,
    ModelConfig,
    Needs,
    Observed,
    decide,
    needs,
    parse_spec,
    stage_pods,
)
from relaytrain_testkit.decide_cases import (
    JOB,
    SETTINGS,
    T_RUNNING,
    node,
    observed,
    pod,
    running_status,
    stage,
)
from relaytrain_testkit.decide_views import (
    RUNNING,
    created,
    patches,
    progress,
    ready_reason,
    summary,
)

pytestmark = pytest.mark.unit


SUCCEEDED = running_status(
    stage(0, pod=None, node=None, phase=None, ready=None),
    stage(1, pod=None, node=None, phase=None, ready=None),
    phase="Succeeded",
    conditions=[
        {
            "type": kind,
            "status": "True" if kind == "Ready" else "False",
            "reason": "Succeeded",
            "message": "done",
            "lastTransitionTime": T_RUNNING,
        }
        for kind in ("Progressing", "Ready")
    ],
)


@dataclass(frozen=True)
class Case:
    """One branch: what was observed, and what the decision must be."""

    id: str
    observed: Observed
    actions: list[str]
    phase: str | None = None
    reason: str | None = None
    restarts: list[int] = field(default_factory=list)


CASES = [
    # --- first creation ---
    Case(
        "first pass plans, records the plan, then creates the pods",
        observed(JOB.build(), nodes=[node("a100-0", "a100"), node("rtx-0", "rtx")]),
        [
            "patch",
            "event:Planned",
            "secret",
            "create:j",
            "create:j-stage-0",
            "create:j-stage-1",
            "patch",
        ],
        "Pending",
        "StagesStarting",
        [0, 0],
    ),
    Case(
        "a model config that cannot be read",
        observed(JOB.build(), model=ModelConfig(error="no config.json")),
        ["patch", "event:ModelUnavailable"],
        "Pending",
        "ModelUnavailable",
    ),
    Case(
        "a data set the store has not (or holds empty): nothing is created",
        observed(JOB.build(), inputs=InputProblem("DatasetUnavailable", "no such object")),
        ["patch", "event:DatasetUnavailable"],
        "Pending",
        "DatasetUnavailable",
    ),
    Case(
        "no free GPU anywhere: Unschedulable",
        observed(JOB.build(), nodes=[node("a100-0", "a100", ready=False)]),
        ["patch", "event:Unschedulable"],
        "Pending",
        "Unschedulable",
    ),
    Case(
        "an invalid spec",
        observed(JOB.method(target_modules=["lm_head"]).build()),
        ["patch", "event:InvalidSpec"],
        "Failed",
        "InvalidSpec",
    ),
    Case(
        "pods starting",
        observed(JOB.status(running_status()).build(), [pod(0), pod(1, "Pending")]),
        ["patch"],
        "Pending",
        "StagesStarting",
        [0, 0],
    ),
    Case(
        "all running and nothing changed: no action at all",
        observed(JOB.status(running_status()).build(), RUNNING),
        [],
        "Running",
        "StagesRunning",
        [0, 0],
    ),
    # --- suspend / resume ---
    Case(
        "suspend removes the pods",
        observed(JOB.status(running_status()).suspend().build(), RUNNING),
        ["patch", "delete:j-stage-0", "delete:j-stage-1", "patch", "event:Suspended"],
        "Suspended",
        "Suspended",
        [0, 0],
    ),
    Case(
        "resume creates the pods again from the same plan",
        observed(
            JOB.status(
                running_status(
                    stage(0, pod=None, node=None, phase=None, ready=None),
                    stage(1, pod=None, node=None, phase=None, ready=None),
                )
            ).build(),
            [],
        ),
        ["secret", "create:j", "create:j-stage-0", "create:j-stage-1", "patch"],
        "Pending",
        "StagesStarting",
        [0, 0],
    ),
    # --- stage failure and replacement ---
    Case(
        "a failed pod is counted, then deleted",
        observed(
            JOB.status(running_status()).build(), [pod(0, "Failed", reason="OOMKilled"), pod(1)]
        ),
        ["patch", "event:StageRestarting", "delete:j-stage-0", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    Case(
        "a pod deleted by someone else is counted and replaced at once",
        observed(JOB.status(running_status()).build(), [pod(1)]),
        [
            "patch",
            "event:StageRestarting",
            "secret",
            "create:j",
            "create:j-stage-0",
            "patch",
        ],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    Case(
        "a pod being deleted is counted and waited for",
        observed(JOB.status(running_status()).build(), [pod(0, deleting=True), pod(1)]),
        ["patch", "event:StageRestarting", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    Case(
        "the successor of a counted failure is created",
        observed(
            JOB.status(
                running_status(
                    stage(0, phase=REPLACING, restarts=1, ready=False, lastFailure="Error"),
                    stage(1),
                )
            ).build(),
            [pod(1)],
        ),
        ["secret", "create:j", "create:j-stage-0", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    # --- node gone ---
    Case(
        "a pod whose node is gone is counted and force-deleted",
        observed(JOB.status(running_status()).build(), RUNNING, nodes=[node("rtx-0", "rtx")]),
        ["patch", "event:StageRestarting", "delete:j-stage-0!", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    # --- back-off limit ---
    Case(
        "a failure past maxStageRestarts fails the job and removes its pods",
        observed(
            JOB.status(running_status(stage(0, restarts=2), stage(1))).build(),
            [pod(0, "Failed", incarnation=2), pod(1), pod(2, deleting=True)],
        ),
        [
            "delete:j-stage-0",
            "delete:j-stage-1",
            "patch",
            "event:BackoffLimitExceeded",
        ],
        "Failed",
        "BackoffLimitExceeded",
        [2, 0],
    ),
    Case(
        "a stage that stops on bad input fails the job at once, counting no restart",
        observed(
            JOB.status(running_status()).build(),
            [
                pod(0, "Failed", exit_code=3, message="relaytrain-worker: stage 0: no records"),
                pod(1),
            ],
        ),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:InvalidInput"],
        "Failed",
        "InvalidInput",
        [0, 0],
    ),
    Case(
        "a stage the store refused fails the job at once",
        observed(JOB.status(running_status()).build(), [pod(0), pod(1, "Failed", exit_code=5)]),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:StoreAccessDenied"],
        "Failed",
        "StoreAccessDenied",
        [0, 0],
    ),
    Case(
        "a stage refused by a neighbour's link check is restarted (a replacement may fix it)",
        observed(JOB.status(running_status()).build(), [pod(0, "Failed", exit_code=4), pod(1)]),
        ["patch", "event:StageRestarting", "delete:j-stage-0", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    # --- completion ---
    Case(
        "progress.json says done: Succeeded, pods removed",
        observed(
            JOB.status(running_status()).build(),
            RUNNING,
            progress=progress(100, 100, done=True, output="s3://out/adapter/"),
        ),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:Succeeded"],
        "Succeeded",
        "Succeeded",
        [0, 0],
    ),
    Case(
        # The workers wrote the output and said done; a stage then died on its way out
        # (even past maxStageRestarts): the job is done, not failed.
        "progress.json says done and a stage ends badly after it: Succeeded",
        observed(
            JOB.status(running_status(stage(0, restarts=2), stage(1))).build(),
            [pod(0, "Failed", incarnation=2), pod(1)],
            progress=progress(100, 100, done=True, output="s3://out/adapter/"),
        ),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:Succeeded"],
        "Succeeded",
        "Succeeded",
        [2, 0],
    ),
    Case(
        "every stage pod Succeeded: Succeeded",
        observed(JOB.status(running_status()).build(), [pod(0, "Succeeded"), pod(1, "Succeeded")]),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:Succeeded"],
        "Succeeded",
        "Succeeded",
        [0, 0],
    ),
    Case(
        "a finished job only has its pods removed",
        observed(JOB.status(SUCCEEDED).build(), [pod(0, "Succeeded"), pod(1, deleting=True)]),
        ["delete:j-stage-0"],
        "Succeeded",
        "Succeeded",
        [0, 0],
    ),
    # --- deletion ---
    Case("the job is gone", observed(None), []),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decision_table(case: Case) -> None:
    decision = decide(case.observed, SETTINGS)
    assert summary(decision) == case.actions
    if case.phase is None:
        assert decision.status is None
        return
    assert decision.status is not None
    assert decision.status.phase == case.phase
    assert ready_reason(decision) == case.reason
    assert [s.restarts for s in decision.status.stages] == case.restarts
    # Status is patched only when it changes, and the last patch is the new status.
    if any(a == "patch" for a in case.actions):
        assert patches(decision)[-1] == decision.status


def test_a_job_being_deleted_gets_no_action() -> None:
    job = JOB.status(running_status()).set("metadata.deletionTimestamp", "2026-11-22T09:59:00Z")
    assert decide(observed(job.build(), RUNNING), SETTINGS) == Decision()


def test_needs_reads_only_what_the_decision_uses() -> None:
    started = JOB.status(running_status()).build()
    assert needs(started, stage_pods(RUNNING)) == Needs(progress=True)
    assert needs(started, stage_pods([pod(1)])) == Needs(pods=True, room=True, progress=True)
    assert needs(JOB.build(), {}) == Needs(room=True, model=True, inputs=True)
    local = JOB.status(running_status()).set("spec.checkpoint", {"uri": "/ckpt"}).build()
    assert needs(local, stage_pods(RUNNING)) == Needs()
    # Nothing costly for jobs that do not run: invalid, suspended, finished.
    assert needs(JOB.method(target_modules=["lm_head"]).build(), {}) == Needs()
    assert needs(JOB.status(running_status()).suspend().build(), {}) == Needs()
    assert needs(JOB.status(SUCCEEDED).build(), {}) == Needs()


def test_parse_spec_says_why_a_job_cannot_run() -> None:
    assert "spec.training" in str(parse_spec(JOB.training(steps=0).build()))
    assert "lm_head" in str(parse_spec(JOB.method(target_modules=["lm_head"]).build()))
    assert not isinstance(parse_spec(JOB.build()), str)


def test_stage_pods_are_keyed_by_their_stage_label() -> None:
    stray = pod(0)
    stray["metadata"]["labels"]["relaytrain.io/stage"] = "x"
    # A pod without a pipeline label (an older operator's) is of pipeline 0.
    other = pod(1)
    other["metadata"]["labels"]["relaytrain.io/pipeline"] = "2"
    assert stage_pods([pod(1), stray, other]) == {(0, 1): pod(1), (2, 1): other}


def test_resuming_a_suspended_job_posts_no_second_suspended_event() -> None:
    suspended = decide(observed(JOB.status(running_status()).suspend().build(), RUNNING), SETTINGS)
    assert suspended.status is not None
    again = decide(
        observed(
            JOB.status(to_manifest(suspended.status)).suspend().build(), [pod(0, deleting=True)]
        ),
        SETTINGS,
    )
    assert summary(again) == []


def test_the_generation_and_transition_times_are_kept_in_status() -> None:
    decision = decide(
        observed(JOB.status(running_status()).build(), [pod(0), pod(1, "Pending")]), SETTINGS
    )
    assert decision.status is not None
    assert decision.status.observed_generation == 4
    ready = condition(decision.status, READY)
    # Ready flipped True → False now; Progressing stayed True, its time stays.
    assert ready is not None and ready.last_transition_time == "2026-11-22T10:00:00Z"
    progressing = condition(decision.status, "Progressing")
    assert progressing is not None and progressing.last_transition_time == T_RUNNING


def test_a_decision_is_deterministic() -> None:
    obs = observed(JOB.status(running_status()).build(), [pod(0, "Failed"), pod(1)])
    assert decide(obs, SETTINGS) == decide(replace(obs), SETTINGS)


def test_a_suspension_moves_the_plan_epoch_on_once_and_the_resumed_stages_carry_it() -> None:
    """A job suspended (or preempted by Kueue) has every stage pod deleted, but a pod on a
    node cut off from the control plane runs on. The plan epoch moves on, written before
    the pods go and once however long the suspension lasts, and the job's store names it
    before the resumed stages start: a stage of before, still running, writes no more."""
    suspended = decide(observed(JOB.status(running_status()).suspend().build(), RUNNING), SETTINGS)
    assert suspended.status is not None and suspended.status.plan_epoch == 1
    assert summary(suspended)[:2] == ["patch", "delete:j-stage-0"]
    assert patches(suspended)[0].plan_epoch == 1
    status = to_manifest(suspended.status)
    going = copy.deepcopy(RUNNING)
    for p in going:
        p["metadata"]["deletionTimestamp"] = "2026-11-22T10:00:00Z"
    still = decide(observed(JOB.status(status).suspend().build(), going), SETTINGS)
    assert still.status is not None and still.status.plan_epoch == 1
    resumed = decide(observed(JOB.status(status).build(), []), SETTINGS)
    actions = summary(resumed)
    assert actions.index("plan:1") < actions.index("create:j-stage-0"), actions
    config = created(resumed, "j-stage-0")["spec"]["containers"][0]["env"][0]["value"]
    assert json.loads(config)["job"]["planEpoch"] == 1
