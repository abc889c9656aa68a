"""The stages of a started job: what each pod holds, where a replacement goes and when, what
is counted and when it is patched, and what a kept pod reports (decide/stages.py,
decide/create.py).
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import pytest
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION, REPLACING
from relaytrain_operator.domain.status import READY, condition, rfc3339, to_manifest
from relaytrain_operator.loop.actions import Create
from relaytrain_operator.loop.decide import WAITING_ANNOTATION, decide
from relaytrain_operator.spec import StageStatus
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
    unbound,
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


def test_a_job_image_and_no_credentials() -> None:
    job = (
        JOB.status(running_status(stage(0, pod=None, node=None, phase=None, ready=None), stage(1)))
        .image("custom:2")
        .set("spec.checkpoint", {"uri": "/ckpt"})
        .build()
    )
    p = created(decide(observed(job, [pod(1)]), SETTINGS), "j-stage-0")
    container = p["spec"]["containers"][0]
    assert container["image"] == "custom:2"
    assert "AWS_ACCESS_KEY_ID" not in {e["name"] for e in container["env"]}


# --- replacements ---------------------------------------------------------------------


REPLACING_JOB = JOB.status(
    running_status(
        stage(0, phase=REPLACING, restarts=1, ready=False, lastFailure="NodeLost"), stage(1)
    )
)
"""Stage 0 failed (counted: restarts 1, Replacing); its pod is gone."""


def test_a_replacement_never_lands_on_a_node_the_node_selector_excludes() -> None:
    # Stage 0's pool (a100) is full: its node is gone and the other holds another job's pod.
    # The only free GPU big enough is an H100 in zone b; the job asks for zone a.
    job = REPLACING_JOB.placement(node_selector={"zone": "a"}).build()
    nodes = [node("a100-1", "a100"), node("rtx-0", "rtx"), node("h100-0", "h100", zone="b")]
    held = [pod(1), pod(0, job="other", node_name="a100-1")]
    decision = decide(observed(job, [pod(1)], nodes=nodes, cluster_pods=held), SETTINGS)

    successor = created(decision, "j-stage-0")
    selector = successor["spec"]["nodeSelector"]
    assert selector["zone"] == "a" and selector["relaytrain.io/pool"] == "a100"
    assert successor["metadata"]["annotations"]["relaytrain.io/pool"] == "a100"
    # ... and the job says why it waits, in its condition and an Event.
    assert decision.status is not None
    ready = condition(decision.status, READY)
    assert ready is not None and ready.reason == "Unschedulable" and ready.status == "False"
    assert "zone=a" in ready.message and "pool h100" in ready.message
    assert "pool a100: no free GPU" in ready.message
    assert decision.status.phase == "Recovering"
    assert [(e.type, e.reason, e.message) for e in events(decision)] == [
        ("Warning", "Unschedulable", ready.message)
    ]
    assert successor["metadata"]["annotations"][WAITING_ANNOTATION] == ready.message

    # While the successor waits unscheduled, later passes keep saying so, without new Events.
    waiting = unbound(successor)
    later = decide(
        observed(
            JOB.status(to_manifest(decision.status)).placement(node_selector={"zone": "a"}).build(),
            [waiting, pod(1)],
            nodes=nodes,
        ),
        SETTINGS,
    )
    assert ready_reason(later) == "Unschedulable" and events(later) == []
    # Once scheduled, the job recovers as usual.
    bound = copy.deepcopy(successor)
    bound["spec"]["nodeName"] = "a100-1"
    bound["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    after = decide(
        observed(
            JOB.status(to_manifest(later.status)).placement(node_selector={"zone": "a"}).build(),  # type: ignore[arg-type]
            [bound, pod(1)],
            nodes=nodes,
        ),
        SETTINGS,
    )
    assert ready_reason(after) == "StagesRunning"


def test_a_replacement_moves_to_an_eligible_pool_whose_memory_fits() -> None:
    job = REPLACING_JOB.placement(node_selector={"zone": "a"}).build()
    nodes = [
        node("a100-1", "a100"),
        node("rtx-0", "rtx"),
        node("rtx-1", "rtx"),
        node("h100-0", "h100", zone="b"),
    ]
    held = [pod(1), pod(0, job="other", node_name="a100-1")]
    decision = decide(observed(job, [pod(1)], nodes=nodes, cluster_pods=held), SETTINGS)
    successor = created(decision, "j-stage-0")
    assert successor["spec"]["nodeSelector"]["relaytrain.io/pool"] == "rtx"
    assert decision.status is not None and decision.status.stages[0].pool == "rtx"
    assert WAITING_ANNOTATION not in successor["metadata"]["annotations"]
    assert ready_reason(decision) == "StageRestarting"


def test_a_waiting_replacement_moves_to_a_pool_that_gets_a_free_gpu() -> None:
    """Stage 0's replacement waits on its full a100 pool; then an RTX node joins (or one the
    operator had not seen yet when it placed the replacement): the waiting pod goes, the
    move written first and counted as no restart, and the next pass creates it on rtx."""
    nodes = [node("a100-1", "a100"), node("rtx-0", "rtx")]
    held = [pod(1), pod(0, job="other", node_name="a100-1")]
    first = decide(observed(REPLACING_JOB.build(), [pod(1)], nodes=nodes, cluster_pods=held),
                   SETTINGS)  # fmt: skip
    waiting = unbound(created(first, "j-stage-0"))
    assert WAITING_ANNOTATION in waiting["metadata"]["annotations"]
    waiting["metadata"]["creationTimestamp"] = rfc3339(NOW)  # read back from the API server
    assert first.status is not None
    job = JOB.status(to_manifest(first.status)).build()
    # Its own pool gets the GPU back: the scheduler binds the pod where it is, nothing moves.
    mine = decide(observed(job, [waiting, pod(1)], nodes=nodes, cluster_pods=[pod(1), waiting]),
                  SETTINGS)  # fmt: skip
    assert summary(mine) == [] and ready_reason(mine) == "Unschedulable"
    # Another pool gets one: the pod moves there.
    joined = [*nodes, node("rtx-1", "rtx")]
    moving = decide(observed(job, [waiting, pod(1)], nodes=joined, cluster_pods=[*held, waiting]),
                    SETTINGS)  # fmt: skip
    assert summary(moving)[:3] == ["patch", "event:StageMoving", "delete:j-stage-0"]
    assert moving.restarts == 0
    written = patches(moving)[0].stages[0]
    assert (written.phase, written.restarts, written.pool) == (REPLACING, 1, "a100")
    (said,) = events(moving)
    assert said.message == (
        "Stage 0 pod j-stage-0 waited for a GPU on pool a100; pool rtx has one free: moving it "
        "there, not counted as a restart."
    )
    assert moving.status is not None
    gone = decide(observed(JOB.status(to_manifest(moving.status)).build(), [pod(1)],
                           nodes=joined, cluster_pods=held), SETTINGS)  # fmt: skip
    successor = created(gone, "j-stage-0")
    assert successor["spec"]["nodeSelector"]["relaytrain.io/pool"] == "rtx"
    assert WAITING_ANNOTATION not in successor["metadata"]["annotations"]
    assert gone.restarts == 0 and gone.status is not None
    assert (gone.status.stages[0].restarts, gone.status.stages[0].pool) == (1, "rtx")


def test_a_replacement_stays_on_its_pool_when_it_has_room() -> None:
    decision = decide(observed(REPLACING_JOB.build(), [pod(1)]), SETTINGS)
    successor = created(decision, "j-stage-0")
    assert successor["spec"]["nodeSelector"]["relaytrain.io/pool"] == "a100"
    assert successor["metadata"]["annotations"][INCARNATION_ANNOTATION] == "1"


def test_a_replacement_runs_the_image_its_job_s_stages_run() -> None:
    """Its neighbours run the image the job started with; the operator's default has moved
    since (an upgrade), or spec.image has: a replacement of either would speak another link
    protocol, refused by its neighbours at every start. It runs theirs."""
    assert SETTINGS.worker_image == "img:1"
    for job in (REPLACING_JOB.build(), REPLACING_JOB.image("custom:3").build()):
        decision = decide(observed(job, [pod(1, image="img:0")]), SETTINGS)
        assert created(decision, "j-stage-0")["spec"]["containers"][0]["image"] == "img:0"
    # A pod on its way out (every stage replaced at once), or one that never started (an
    # image that cannot be pulled, since corrected in spec.image), runs nothing the new
    # ones link to: they take the job's image.
    job = REPLACING_JOB.image("custom:3").build()
    stuck = ("ImagePullBackOff", "Back-off pulling image")
    for other in (
        pod(1, image="img:0", deleting=True),
        pod(1, "Pending", image="custm:3", waiting=stuck),
    ):
        decision = decide(observed(job, [other]), SETTINGS)
        assert created(decision, "j-stage-0")["spec"]["containers"][0]["image"] == "custom:3"


def test_a_replacement_records_the_newest_committed_step() -> None:
    job = REPLACING_JOB.build()
    job["status"]["progress"] = {"step": 12, "lastCommittedStep": 10}
    fresh = decide(observed(job, [pod(1)], progress=progress(14, 12)), SETTINGS)
    assert fresh.status is not None and fresh.status.stages[0].restored_from_step == 12
    # The store had no newer commit to say: the one status last folded in.
    stale = decide(observed(job, [pod(1)], progress=progress(14)), SETTINGS)
    assert stale.status is not None and stale.status.stages[0].restored_from_step == 10
    # No commit known at all: nothing to say.
    nothing = decide(observed(REPLACING_JOB.build(), [pod(1)]), SETTINGS)
    assert nothing.status is not None and nothing.status.stages[0].restored_from_step is None


def test_the_backoff_delays_a_replacement_and_asks_to_be_woken() -> None:
    job = REPLACING_JOB.failure_policy(backoff_seconds=30).build()
    job["status"]["stages"][0]["lastFailureTime"] = "2026-11-22T09:59:50Z"
    early = decide(observed(job, [pod(1)]), SETTINGS)
    assert not any(isinstance(a, Create) for a in early.actions)
    assert early.retry_after == 20.0
    due = decide(observed(job, [pod(1)], now=NOW + timedelta(seconds=20)), SETTINGS)
    assert "create:j-stage-0" in summary(due)
    # A failure counted in this very pass waits the whole back-off, from the time recorded.
    counted = decide(
        observed(JOB.status(running_status()).failure_policy(backoff_seconds=30).build(), [pod(1)]),
        SETTINGS,
    )
    assert counted.retry_after == 30.0 and not any(isinstance(a, Create) for a in counted.actions)
    assert counted.status is not None
    assert counted.status.stages[0].last_failure_time == "2026-11-22T10:00:00Z"
    later = decide(
        observed(
            JOB.status(to_manifest(counted.status)).failure_policy(backoff_seconds=30).build(),
            [pod(1)],
            now=NOW + timedelta(seconds=30),
        ),
        SETTINGS,
    )
    assert "create:j-stage-0" in summary(later)
    # No record of when it failed (a status from before the field): the wait starts now and
    # the time is recorded, so it does not start over at every pass.
    del job["status"]["stages"][0]["lastFailureTime"]
    unknown = decide(observed(job, [pod(1)]), SETTINGS)
    assert unknown.retry_after == 30.0 and unknown.status is not None
    assert unknown.status.stages[0].last_failure_time == "2026-11-22T10:00:00Z"
    # Two stages waiting: woken for the first that is due.
    job["status"]["stages"][0]["lastFailureTime"] = "2026-11-22T09:59:50Z"
    job["status"]["stages"][1] = stage(
        1, phase=REPLACING, restarts=1, ready=False, lastFailureTime="2026-11-22T09:59:40Z"
    )
    both = decide(observed(job, []), SETTINGS)
    assert both.retry_after == 10.0


def test_two_replacements_do_not_take_one_free_gpu() -> None:
    status = running_status(
        stage(0, phase=REPLACING, restarts=1, ready=False),
        stage(1, phase=REPLACING, restarts=1, ready=False),
    )
    # One free A100 (40 GiB) and nothing else: both stages fit it, only one gets it.
    nodes = [node("a100-0", "a100")]
    decision = decide(observed(JOB.status(status).build(), [], nodes=nodes), SETTINGS)
    zero, one = created(decision, "j-stage-0"), created(decision, "j-stage-1")
    assert zero["spec"]["nodeSelector"]["relaytrain.io/pool"] == "a100"
    assert WAITING_ANNOTATION not in zero["metadata"]["annotations"]
    # The other waits on its own pool (whose nodes are all gone).
    assert one["metadata"]["annotations"]["relaytrain.io/pool"] == "rtx"
    assert (
        "Stage 1 waits for a GPU on pool rtx" in one["metadata"]["annotations"][WAITING_ANNOTATION]
    )


def test_a_failure_counted_before_a_crash_is_not_counted_again() -> None:
    # The count reached 1 and the operator died before deleting the failed pod.
    status = running_status(stage(0, phase=REPLACING, restarts=1, ready=False), stage(1))
    decision = decide(observed(JOB.status(status).build(), [pod(0, "Failed"), pod(1)]), SETTINGS)
    assert summary(decision)[0] == "delete:j-stage-0" and events(decision) == []
    assert decision.restarts == 0
    assert decision.status is not None and decision.status.stages[0].restarts == 1


def test_counting_is_patched_before_the_delete_and_events_follow_the_count() -> None:
    decision = decide(
        observed(JOB.status(running_status()).build(), [pod(0, "Failed"), pod(1)]), SETTINGS
    )
    assert decision.restarts == 1
    counted = patches(decision)[0]
    assert counted.stages[0].restarts == 1 and counted.stages[0].phase == REPLACING
    assert counted.restarts == 1
    assert events(decision)[0].message == (
        "Stage 0 pod j-stage-0 ended (Failed); replacing it (restart 1 of 2)."
    )


def test_a_stage_stopped_on_bad_input_is_quoted_in_the_condition_and_its_one_event() -> None:
    said = "relaytrain-worker: stage 1: dataset.uri 's3://b/d.jsonl': no records"
    decision = decide(
        observed(JOB.status(running_status()).build(), [pod(0), pod(1, "Failed", exit_code=3,
                                                                   message=said + "\n")]),
        SETTINGS,
    )  # fmt: skip
    want = f"Stage 1 stopped, not to be restarted (InvalidInput): {said}"
    assert decision.status is not None
    ready = condition(decision.status, READY)
    assert ready is not None and (ready.reason, ready.message) == ("InvalidInput", want)
    assert [(e.type, e.reason, e.message) for e in events(decision)] == [
        ("Warning", "InvalidInput", want)
    ]
    assert decision.restarts == 0 and [s.restarts for s in decision.status.stages] == [0, 0]
    # Without a termination message, the condition says where to look.
    silent = decide(
        observed(JOB.status(running_status()).build(), [pod(0, "Failed", exit_code=2), pod(1)]),
        SETTINGS,
    )
    assert silent.status is not None and ready_reason(silent) == "InvalidStageConfig"
    silent_ready = condition(silent.status, READY)
    assert silent_ready is not None and silent_ready.message.endswith(
        "it left no termination message (see its pod's log)"
    )


def test_a_crash_ends_the_restart_event_and_the_failure_with_its_last_words() -> None:
    log = "Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error: " + "x" * 500
    crashed = pod(0, "Failed", exit_code=1, message=log)
    first = decide(observed(JOB.status(running_status()).build(), [crashed, pod(1)]), SETTINGS)
    words = " Its last words: RuntimeError: CUDA error: " + "x" * 373 + "…"  # 400 characters
    assert events(first)[0].message == (
        "Stage 0 pod j-stage-0 ended (Failed); replacing it (restart 1 of 2)." + words
    )
    spent = JOB.status(running_status(stage(0, restarts=2), stage(1))).build()
    last = decide(observed(spent, [pod(0, "Failed", incarnation=2, exit_code=1, message=log),
                                   pod(1)]), SETTINGS)  # fmt: skip
    assert last.status is not None and ready_reason(last) == "BackoffLimitExceeded"
    last_ready = condition(last.status, READY)
    assert last_ready is not None and last_ready.message == (
        "Stage 0 failed again (Failed) after 2 restarts; spec.failurePolicy.maxStageRestarts "
        "is 2." + words
    )
    # A crash without any words (nothing logged) adds nothing.
    silent_crash = pod(0, "Failed", exit_code=137, message=" \n")
    mute = decide(observed(JOB.status(running_status()).build(), [silent_crash, pod(1)]), SETTINGS)
    assert events(mute)[0].message.endswith("(restart 1 of 2).")


def test_a_container_that_cannot_start_is_named_in_the_condition_once() -> None:
    # The Secret went after the plan: the kubelet holds the container (its words).
    no_secret = ("CreateContainerConfigError", 'secret "s3" not found')
    first = decide(
        observed(
            JOB.status(running_status()).build(), [pod(0), pod(1, "Pending", waiting=no_secret)]
        ),
        SETTINGS,
    )
    want = 'Stage 1 cannot start its container (CreateContainerConfigError): secret "s3" not found'
    assert first.status is not None and ready_reason(first) == "CreateContainerConfigError"
    assert condition(first.status, READY).message == want  # type: ignore[union-attr]
    assert [(e.type, e.reason) for e in events(first)] == [
        ("Warning", "CreateContainerConfigError")
    ]
    again = decide(
        observed(JOB.status(to_manifest(first.status)).build(),
                 [pod(0), pod(1, "Pending", waiting=no_secret)]),
        SETTINGS,
    )  # fmt: skip
    assert events(again) == []  # the same words: no second Event
    # An image pull's two alternating reasons read as one, with words that do not change.
    for kubelet in (("ErrImagePull", "rpc error: not found"), ("ImagePullBackOff", "Back-off")):
        pulling = decide(
            observed(
                JOB.status(running_status()).build(), [pod(0, "Pending", waiting=kubelet), pod(1)]
            ),
            SETTINGS,
        )
        assert pulling.status is not None and ready_reason(pulling) == "ImagePullBackOff"
        assert condition(pulling.status, READY).message == (  # type: ignore[union-attr]
            "Stage 0 cannot start its container (ImagePullBackOff): the kubelet cannot pull "
            "image 'w:1' (its Events on the pod say why; a private registry needs "
            "imagePullSecrets)"
        )
    # A container that merely starts (ContainerCreating) is no problem.
    creating = ("ContainerCreating", "")
    fine = decide(
        observed(
            JOB.status(running_status()).build(), [pod(0, "Pending", waiting=creating), pod(1)]
        ),
        SETTINGS,
    )
    assert ready_reason(fine) == "StagesStarting"


def test_a_pod_of_a_lost_node_in_grace_is_kept() -> None:
    nodes = [
        node("a100-0", "a100", ready=False, since="2026-11-22T09:59:50Z"),
        node("rtx-0", "rtx"),
    ]
    decision = decide(
        observed(JOB.status(running_status()).build(), RUNNING, nodes=nodes), SETTINGS
    )
    assert summary(decision) == []


def test_a_kept_pod_reports_its_node_phase_and_pool() -> None:
    moved = pod(1, pool="h100", node_name="h100-0")
    decision = decide(observed(JOB.status(running_status()).build(), [pod(0), moved]), SETTINGS)
    assert decision.status is not None
    assert decision.status.stages[1] == StageStatus(
        index=1, pod="j-stage-1", node="h100-0", pool="h100", phase="Running", ready=True
    )


def test_a_replacement_takes_the_boundary_code_the_plan_chose_for_compression_auto() -> None:
    # spec.pipeline.compression auto: status.plan.compression is the planner's choice, and a
    # pod made later (a replacement here) gets that code, not the word auto.
    job = REPLACING_JOB.pipeline(compression="auto").set("status.plan.compression", "delta").build()
    successor = created(decide(observed(job, [pod(1)]), SETTINGS), "j-stage-0")
    env = {e["name"]: e for e in successor["spec"]["containers"][0]["env"]}
    config = json.loads(env["RELAYTRAIN_STAGE_CONFIG"]["value"])
    assert config["pipeline"]["compression"] == "delta"
