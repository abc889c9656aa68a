"""The first plan, and Kueue's admission: what a job's first pass records before any pod,
why a plan cannot be made, and a queued job's Workload, its waiting, admission, eviction,
suspension and end (decide/admission.py).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION, REPLACING
from relaytrain_operator.domain.status import READY, condition, load_status, to_manifest
from relaytrain_operator.loop.actions import Create, CreateLinkSecret
from relaytrain_operator.loop.decide import Decision, ModelConfig, Settings, decide
from relaytrain_testkit.decide_cases import (
    GIB,
    JOB,
    NODES,
    NOW,
    PLAN,
    SETTINGS,
    events,
    node,
    observed,
    pod,
    running_status,
    stage,
)
from relaytrain_testkit.decide_fleet import FLEET, fleet, run_pods
from relaytrain_testkit.decide_kueue import (
    ADMITTED,
    EVICTED,
    PENDING,
    QUEUED,
    applied,
    kobserved,
    workload_of,
)
from relaytrain_testkit.decide_views import (
    RUNNING,
    created,
    patches,
    progress,
    ready_reason,
    summary,
)
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.unit


# --- the first plan -------------------------------------------------------------------


def test_first_pass_records_the_plan_before_any_pod_and_builds_pods_from_it() -> None:
    decision = decide(
        observed(JOB.build(), nodes=[node("a100-0", "a100"), node("rtx-0", "rtx")]), SETTINGS
    )
    first = patches(decision)[0]
    assert first.phase == "Planning" and first.plan is not None and first.start_time
    assert [s.pool for s in first.stages] == [s.pool for s in first.plan.stages]
    assert isinstance(decision.actions[2], CreateLinkSecret)
    assert decision.actions[2].stage_counts == (2,)
    for k, planned in enumerate(first.plan.stages):
        p = created(decision, f"j-stage-{k}")
        assert p["metadata"]["annotations"][INCARNATION_ANNOTATION] == "0"
        assert p["spec"]["nodeSelector"]["relaytrain.io/pool"] == planned.pool
        container = p["spec"]["containers"][0]
        assert container["image"] == "img:1"
        env = {e["name"]: e for e in container["env"]}
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    assert [s.phase for s in decision.status.stages] == ["Pending", "Pending"]  # type: ignore[union-attr]
    assert events(decision)[0].message.startswith("Planned 2 stages: ")


def test_every_stage_pod_runs_in_the_jobs_runtime_class() -> None:
    job = JOB.set("spec.placement.runtimeClassName", "nvidia").build()
    nodes = [node("a100-0", "a100"), node("rtx-0", "rtx")]
    decision = decide(observed(job, nodes=nodes), SETTINGS)
    pods = [created(decision, f"j-stage-{k}") for k in (0, 1)]
    assert [p["spec"]["runtimeClassName"] for p in pods] == ["nvidia", "nvidia"]


def test_a_plan_counts_gpus_other_pods_hold() -> None:
    nodes = [node("a100-0", "a100"), node("rtx-0", "rtx"), node("rtx-1", "rtx")]
    busy = pod(0, job="other", node_name="a100-0")
    decision = decide(observed(JOB.build(), nodes=nodes, cluster_pods=[busy]), SETTINGS)
    assert decision.status is not None and decision.status.plan is not None
    assert {s.pool for s in decision.status.plan.stages} == {"rtx"}


def test_unschedulable_clears_a_stale_plan_and_says_why() -> None:
    job = (
        JOB.status({"phase": "Pending", "plan": PLAN})
        .placement(node_selector={"zone": "z"})
        .build()
    )
    decision = decide(observed(job), SETTINGS)
    assert decision.status is not None and decision.status.plan is None
    message = condition(decision.status, READY).message  # type: ignore[union-attr]
    assert "No free GPU" in message and "zone=z" in message
    assert [e.reason for e in events(decision)] == ["Unschedulable"]
    # A later pass that still cannot plan writes nothing and posts no second Event.
    again = decide(
        observed(
            JOB.status(to_manifest(decision.status)).placement(node_selector={"zone": "z"}).build()
        ),
        SETTINGS,
    )
    assert summary(again) == []


def test_words_that_change_while_the_reason_holds_post_no_second_event() -> None:
    # The store's answer changes between passes (other jobs come and go, so do an
    # Unschedulable job's free GPUs): the condition follows, the Events do not repeat.
    first = decide(observed(JOB.build(), model=ModelConfig(error="timed out")), SETTINGS)
    assert first.status is not None and [e.reason for e in events(first)] == ["ModelUnavailable"]
    later = JOB.status(to_manifest(first.status)).build()
    moved = decide(observed(later, model=ModelConfig(error="connection refused")), SETTINGS)
    assert moved.status is not None and ready_reason(moved) == "ModelUnavailable"
    assert condition(moved.status, READY).message == "connection refused"  # type: ignore[union-attr]
    assert events(moved) == [] and summary(moved) == ["patch"]


def test_a_model_no_fleet_can_train_is_an_invalid_spec_not_a_wait() -> None:
    # A config.json without the sizes (an unsupported family: test_planner_families.py).
    config: dict[str, Any] = {"model_type": "llama"}
    message = "The model's config.json cannot be planned: "
    decision = decide(observed(JOB.build(), model=ModelConfig(config)), SETTINGS)
    assert decision.status is not None and decision.status.plan is None
    assert (decision.status.phase, ready_reason(decision)) == ("Failed", "InvalidSpec")
    assert condition(decision.status, READY).message.startswith(message)  # type: ignore[union-attr]
    assert [e.reason for e in events(decision)] == ["InvalidSpec"]


@pytest.mark.parametrize(
    ("model", "settings", "message"),
    [
        (
            ModelConfig(SMOLLM2_135M_CONFIG),
            replace(SETTINGS, default_link=None),
            "The GPU nodes cannot be grouped into pools",
        ),
    ],
)
def test_a_plan_that_cannot_be_made_is_unschedulable_with_the_reason(
    model: ModelConfig, settings: Settings, message: str
) -> None:
    decision = decide(observed(JOB.build(), model=model), settings)
    assert ready_reason(decision) == "Unschedulable"
    assert message in condition(decision.status, READY).message  # type: ignore[arg-type,union-attr]


def test_make_plan_refuses_training_settings_it_cannot_price() -> None:
    from relaytrain_operator.domain.planning import PlanError, make_plan
    from relaytrain_operator.spec import parse_job

    job = parse_job(JOB.method(target_modules=["lm_head"]).build())
    with pytest.raises(PlanError, match="training settings cannot be planned"):
        make_plan(job, SMOLLM2_135M_CONFIG, NODES, [], default_link=(1000.0, 10.0))


def test_a_lora_target_the_model_has_not_is_an_invalid_spec_not_a_full_fleet() -> None:
    # Expert weights on a dense model: only the model's config says so, at the first plan.
    job = JOB.method(target_modules=["experts.down_proj"]).build()
    decision = decide(observed(job), SETTINGS)
    assert decision.status is not None and decision.status.plan is None
    assert (decision.status.phase, ready_reason(decision)) == ("Failed", "InvalidSpec")
    assert "spec.method.targetModules" in condition(decision.status, READY).message  # type: ignore[union-attr]
    assert [e.reason for e in events(decision)] == ["InvalidSpec"]
    assert not [a for a in decision.actions if isinstance(a, Create | CreateLinkSecret)]


# --- Kueue (relaytrain_operator/domain/queueing.py) -----------------------------------


def test_a_queued_job_plans_for_the_whole_fleet_submits_a_workload_and_waits() -> None:
    job = QUEUED.build()
    busy = [pod(0, job="other"), pod(1, job="other", node_name="a100-1")]
    decision = decide(kobserved(job, [], cluster_pods=busy), SETTINGS)
    # The GPUs other pods hold do not matter: Kueue's quota decides when.
    assert decision.status is not None and decision.status.plan is not None
    assert decision.status.phase == "Suspended" and ready_reason(decision) == "Queued"
    (workload,) = [a.obj for a in decision.actions if isinstance(a, Create)]
    assert workload["kind"] == "Workload" and workload["spec"]["queueName"] == "team"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    stages = decision.status.plan.stages
    assert sum(p["count"] for p in workload["spec"]["podSets"]) == len(stages)
    for pod_set in workload["spec"]["podSets"]:
        pool = pod_set["template"]["metadata"]["labels"]["relaytrain.io/pool"]
        assert pod_set["template"]["spec"]["nodeSelector"]["relaytrain.io/pool"] == pool
    assert "priorityClassRef" not in workload["spec"]
    assert [e.reason for e in events(decision)] == ["Planned", "Queued"]


def test_a_queued_job_takes_its_priority_from_the_class_its_label_names() -> None:
    job = QUEUED.status(running_status()).label("kueue.x-k8s.io/priority-class", "high").build()
    missing = decide(kobserved(job, []), SETTINGS)
    assert missing.status is not None and missing.status.phase == "Failed"
    assert ready_reason(missing) == "InvalidSpec"
    assert "metadata.labels[kueue.x-k8s.io/priority-class]" in str(condition(missing.status, READY))
    decision = decide(kobserved(job, [], priority=1000), SETTINGS)
    (workload,) = [a.obj for a in decision.actions if isinstance(a, Create)]
    assert workload["spec"]["priority"] == 1000
    assert workload["spec"]["priorityClassRef"]["name"] == "high"


def test_a_plan_over_more_pools_than_a_workload_holds_is_refused() -> None:
    stages = [
        {
            "index": k,
            "pool": f"pool{k}",
            "layerStart": k,
            "layerEnd": k + 1,
            "predictedMemoryBytes": GIB,
        }
        for k in range(9)
    ]
    entries = [{"index": k, "pool": f"pool{k}", "restarts": 0} for k in range(9)]
    job = (
        QUEUED.status(running_status(*entries, plan={"stages": stages})).pipeline(stages=9).build()
    )
    decision = decide(kobserved(job, []), SETTINGS)
    assert ready_reason(decision) == "InvalidSpec"
    assert "at most 8 pod sets" in str(condition(decision.status, READY))  # type: ignore[arg-type]


def test_a_queued_job_waits_for_quota_with_kueues_words_and_no_pod() -> None:
    job = QUEUED.status(running_status()).build()
    decision = decide(kobserved(job, [], workload_of(job, *PENDING)), SETTINGS)
    assert decision.status is not None and decision.status.phase == "Suspended"
    assert ready_reason(decision) == "WaitingForQuota"
    assert "insufficient unused quota" in str(condition(decision.status, READY))
    assert not [a for a in decision.actions if isinstance(a, (Create, CreateLinkSecret))]
    quiet = workload_of(job, ("QuotaReserved", "False", "Pending", ""))
    assert ready_reason(decide(kobserved(job, [], quiet), SETTINGS)) == "Queued"
    lost = workload_of(
        job, ("QuotaReserved", "False", "Inadmissible", "LocalQueue team doesn't exist")
    )
    refused = decide(kobserved(job, [], lost), SETTINGS)
    assert ready_reason(refused) == "Inadmissible"
    assert "LocalQueue team doesn't exist" in str(condition(refused.status, READY))  # type: ignore[arg-type]
    assert [e.type for e in events(refused) if e.reason == "Inadmissible"] == ["Warning"]


def test_a_queued_job_on_a_cluster_without_kueue_waits_naming_the_label_and_the_fix() -> None:
    job = QUEUED.build()
    decision = decide(replace(kobserved(job, []), kueue_missing=True), SETTINGS)
    assert decision.status is not None and decision.status.phase == "Suspended"
    assert ready_reason(decision) == "KueueNotInstalled"
    words = str(condition(decision.status, READY))
    assert "metadata.labels[kueue.x-k8s.io/queue-name]" in words and "install Kueue" in words
    assert [e.type for e in events(decision) if e.reason == "KueueNotInstalled"] == ["Warning"]
    assert not [a for a in decision.actions if isinstance(a, (Create, CreateLinkSecret))]
    assert decision.retry_after is not None  # it looks again: Kueue may be installed later
    # Once Kueue is there, the job is submitted as any queued job.
    later = QUEUED.status(to_manifest(decision.status)).build()
    submitted = decide(kobserved(later, []), SETTINGS)
    assert ready_reason(submitted) == "Queued"
    assert [a.obj["kind"] for a in submitted.actions if isinstance(a, Create)] == ["Workload"]


def test_an_admitted_job_starts_with_its_flavors_labels_and_tolerations() -> None:
    from relaytrain_operator.domain.status import Verdict, with_verdict

    waiting = with_verdict(
        load_status(running_status()), Verdict("Suspended", False, False, "Queued", "q"), NOW, 4
    )
    job = QUEUED.status(to_manifest(waiting)).build()
    decision = decide(kobserved(job, [], workload_of(job, *ADMITTED)), SETTINGS)
    first = created(decision, "j-stage-0")["spec"]
    assert first["nodeSelector"]["tier"] == "gold"
    assert first["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "tolerations" not in created(decision, "j-stage-1")["spec"]
    (admitted,) = [e for e in events(decision) if e.reason == "Admitted"]
    assert "a100 → fa" in admitted.message and "rtx → fr" in admitted.message
    # Running already: admitted again is no news.
    again = decide(
        kobserved(QUEUED.status(running_status()).build(), RUNNING, workload_of(job, *ADMITTED)),
        SETTINGS,
    )
    assert [e for e in events(again) if e.reason == "Admitted"] == []


def test_a_queued_replacement_stays_on_the_pool_it_was_admitted_on() -> None:
    job = QUEUED.status(
        running_status(
            stage(0), stage(1, restarts=1, phase=REPLACING, pod=None, node=None, ready=False)
        )
    ).build()
    nodes = [node("a100-0", "a100"), node("a100-1", "a100"), node("rtx-0", "rtx")]
    # The rtx GPU is held by another pod: without Kueue the replacement would move pools.
    decision = decide(
        kobserved(
            job,
            [pod(0)],
            workload_of(job, *ADMITTED),
            nodes=nodes,
            cluster_pods=[pod(0), pod(1, job="other")],
        ),
        SETTINGS,
    )
    assert created(decision, "j-stage-1")["spec"]["nodeSelector"]["relaytrain.io/pool"] == "rtx"


def test_an_evicted_job_stops_and_hands_its_quota_back_once_its_pods_are_gone() -> None:
    from relaytrain_operator.domain.queueing import ADMISSION_MANAGER

    job = QUEUED.status(running_status()).build()
    workload = workload_of(job, *EVICTED)
    stopping = decide(kobserved(job, RUNNING, workload), SETTINGS)
    assert sorted(s for s in summary(stopping) if s.startswith("delete")) == [
        "delete:j-stage-0",
        "delete:j-stage-1",
    ]
    assert applied(stopping) == []  # the pods still hold their GPUs
    assert ready_reason(stopping) == "Evicted"
    assert "Preempted" in str(condition(stopping.status, READY))  # type: ignore[arg-type]
    gone = decide(
        kobserved(QUEUED.status(to_manifest(stopping.status)).build(), [], workload), SETTINGS
    )  # type: ignore[arg-type]
    (release,) = applied(gone)
    assert release.manager == ADMISSION_MANAGER
    assert "admission" not in release.body["status"]
    conditions = {c["type"]: c for c in release.body["status"]["conditions"]}
    assert (
        conditions["QuotaReserved"]["status"] == "False"
        and conditions["Admitted"]["status"] == "False"
    )
    assert conditions["Evicted"]["reason"] == "Preempted"
    released = workload_of(job, ("QuotaReserved", "False", "Pending", "x"), EVICTED[-1])
    waiting = decide(
        kobserved(QUEUED.status(to_manifest(gone.status)).build(), [], released), SETTINGS
    )  # type: ignore[arg-type]
    assert applied(waiting) == [] and ready_reason(waiting) == "Evicted"


def test_suspend_deactivates_the_workload_and_resume_activates_it() -> None:
    from relaytrain_operator.loop.actions import PatchWorkload

    job = QUEUED.status(running_status()).suspend().build()
    decision = decide(kobserved(job, RUNNING, workload_of(job, *ADMITTED)), SETTINGS)
    assert [a.patch for a in decision.actions if isinstance(a, PatchWorkload)] == [
        {"spec": {"active": False}}
    ]
    inactive = workload_of(
        job, *EVICTED[:2], ("Evicted", "True", "InactiveWorkload", "deactivated"), active=False
    )
    released = decide(kobserved(job, [], inactive), SETTINGS)
    assert [a for a in released.actions if isinstance(a, PatchWorkload)] == []
    assert len(applied(released)) == 1
    assert applied(decide(kobserved(job, [pod(0, deleting=True)], inactive), SETTINGS)) == []
    assert applied(decide(kobserved(job, [], None), SETTINGS)) == []  # no Workload yet: nothing
    resumed = QUEUED.status(running_status()).build()
    back = decide(kobserved(resumed, [], workload_of(resumed, *PENDING, active=False)), SETTINGS)
    assert [a.patch for a in back.actions if isinstance(a, PatchWorkload)] == [
        {"spec": {"active": True}}
    ]


def test_a_finished_job_marks_its_workload_finished_before_its_own_status() -> None:
    from relaytrain_operator.domain.queueing import FINISHED_MANAGER

    job = QUEUED.status(running_status()).build()
    workload = workload_of(job, *ADMITTED)
    done = decide(
        kobserved(job, RUNNING, workload, progress=progress(100, 100, done=True)), SETTINGS
    )
    (finished,) = applied(done)
    assert finished.manager == FINISHED_MANAGER
    assert finished.body["status"]["conditions"][0]["reason"] == "Succeeded"
    kinds = [type(a).__name__ for a in done.actions]
    assert kinds.index("ApplyWorkloadStatus") < max(
        i for i, k in enumerate(kinds) if k == "PatchStatus"
    )
    workload["status"]["conditions"].append({"type": "Finished", "status": "True"})
    assert (
        applied(
            decide(
                kobserved(job, RUNNING, workload, progress=progress(100, 100, done=True)), SETTINGS
            )
        )
        == []
    )
    exhausted = QUEUED.status(running_status(stage(0), stage(1, restarts=2))).build()
    failed = decide(
        kobserved(
            exhausted, [pod(0), pod(1, "Failed", incarnation=2)], workload_of(job, *ADMITTED)
        ),
        SETTINGS,
    )
    assert [a.body["status"]["conditions"][0]["reason"] for a in applied(failed)] == ["Failed"]


# --- one Workload per pipeline --------------------------------------------------------

QFLEET = FLEET.queue("team")
"""Two pipelines of two stages, queued: one Workload each."""


def kueue_fleet() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """QFLEET planned and training (as once both pipelines were admitted)."""
    job, pods = fleet()
    return QFLEET.status(job["status"]).build(), pods


def both(job: dict[str, Any], p0: Any, p1: Any) -> dict[int, dict[str, Any]]:
    """The fleet's two Workloads with conditions `p0` and `p1`."""
    return {p: workload_of(job, *c, pipeline=p) for p, c in enumerate((p0, p1))}


def kinds(decision: Decision) -> list[str]:
    """The decision's actions, Workload ones by kind, the rest as `summary` words them."""
    from relaytrain_operator.loop.actions import ApplyWorkloadStatus, PatchWorkload

    plain = Decision(
        tuple(a for a in decision.actions if not isinstance(a, ApplyWorkloadStatus | PatchWorkload))
    )
    words = iter(summary(plain))
    return [
        type(a).__name__ if isinstance(a, ApplyWorkloadStatus | PatchWorkload) else next(words)
        for a in decision.actions
    ]


def test_a_queued_job_of_several_pipelines_submits_one_workload_per_pipeline() -> None:
    from relaytrain_operator.domain.queueing import workload_name

    decision = decide(kobserved(QFLEET.build(), []), SETTINGS)
    assert decision.status is not None and decision.status.plan is not None
    assert ready_reason(decision) == "Queued"
    workloads = [a.obj for a in decision.actions if isinstance(a, Create)]
    assert [w["metadata"]["name"] for w in workloads] == [
        workload_name("j", 0),
        workload_name("j", 1),
    ]
    assert len({workload_name("j"), workload_name("j", 0), workload_name("j", 1)}) == 3
    for p, (w, planned) in enumerate(zip(workloads, decision.status.plan.pipelines, strict=True)):
        assert w["metadata"]["labels"]["relaytrain.io/pipeline"] == str(p)
        assert sum(s["count"] for s in w["spec"]["podSets"]) == len(planned.stages)
    # A pass that stopped after the first: the second is created, the first stands.
    job = QFLEET.status(to_manifest(decision.status)).build()
    rest = decide(
        kobserved(job, [], workloads={0: workload_of(job, *PENDING, pipeline=0)}), SETTINGS
    )
    assert [a.obj["metadata"]["name"] for a in rest.actions if isinstance(a, Create)] == [
        workload_name("j", 1)
    ]
    assert ready_reason(rest) == "WaitingForQuota"
    assert "LocalQueue team (pipeline 0): couldn't assign" in str(condition(rest.status, READY))  # type: ignore[arg-type]


def test_a_job_queued_with_one_workload_keeps_it_however_many_pipelines_it_has() -> None:
    from relaytrain_operator.domain.queueing import by_pipeline, workload_name

    # Queued by an operator from before Workloads per pipeline: the job's one Workload holds
    # it. No Workload per pipeline is created beside it (its quota would stay held, taken
    # twice), and once Kueue admits it both pipelines start on it.
    submitted = decide(kobserved(QFLEET.build(), []), SETTINGS)
    job = QFLEET.status(to_manifest(submitted.status)).build()  # type: ignore[arg-type]
    waiting = decide(kobserved(job, [], workload=workload_of(job, *PENDING)), SETTINGS)
    assert not [a for a in waiting.actions if isinstance(a, Create)]
    assert ready_reason(waiting) == "WaitingForQuota"
    assert "LocalQueue team: couldn't assign" in str(condition(waiting.status, READY))  # type: ignore[arg-type]
    old = workload_of(job, *ADMITTED)
    assert old["metadata"]["name"] == workload_name("j")
    started = decide(kobserved(job, [], workload=old), SETTINGS)
    assert [w for w in kinds(started) if w.startswith("create:j-p")] == [
        "create:j-p0-s0", "create:j-p0-s1", "create:j-p1-s0", "create:j-p1-s1"
    ]  # fmt: skip
    # The layout read from the labels: the job's one Workload wins over any per pipeline.
    mine = [workload_of(job, *ADMITTED, pipeline=p) for p in (1, 0)]
    assert by_pipeline([]) == (None, {})
    assert by_pipeline(mine) == (True, {0: mine[1], 1: mine[0]})
    assert by_pipeline([*mine, old]) == (False, {0: old})


def test_kueue_admits_a_job_pipeline_by_pipeline_and_one_not_admitted_is_out() -> None:
    submitted = decide(kobserved(QFLEET.build(), []), SETTINGS)
    waiting = QFLEET.status(to_manifest(submitted.status)).build()  # type: ignore[arg-type]
    # Pipeline 0 admitted, pipeline 1 not: pipeline 0 trains alone, on its flavours.
    started = decide(kobserved(waiting, [], workloads=both(waiting, ADMITTED, PENDING)), SETTINGS)
    assert started.status is not None and started.status.phase == "Pending"
    words = kinds(started)
    assert words.index("given-up:1") < words.index("create:j-p0-s0")
    assert not [w for w in words if w.startswith("create:j-p1")]
    (admitted,) = [e for e in events(started) if e.reason == "Admitted"]
    assert "Pipelines 1 wait for Kueue" in admitted.message and "pipeline 0: rtx → fr" in (
        admitted.message
    )
    out = started.status.pipelines[1]  # type: ignore[index]
    assert (out.phase, out.left_at_step) == ("Left", 0)
    assert out.left_reason == f"its Workload waits for Kueue ({PENDING[0][3]})"
    (leaving,) = [e for e in events(started) if e.reason == "PipelineLeaving"]
    assert leaving.message.endswith("It comes back once Kueue admits its Workload.")
    assert created(started, "j-p0-s0")["spec"]["nodeSelector"]["tier"] == "silver"  # rtx → fr
    # Kueue admits pipeline 1 too: it comes back; the store stops naming it first.
    on = QFLEET.status(to_manifest(started.status)).build()
    alive = run_pods(started)
    back = decide(
        kobserved(on, alive, workloads=both(on, ADMITTED, ADMITTED), progress=progress(3)),
        SETTINGS,
    )
    assert [w for w in kinds(back) if w.startswith(("create:j-", "given-up"))] == [
        "given-up:",
        "create:j-p1-s0",
        "create:j-p1-s1",
    ]
    assert back.status is not None and back.status.pipelines[1].returns == 1  # type: ignore[index]


def test_a_pipeline_kueue_preempts_leaves_and_hands_its_quota_back_the_others_train_on() -> None:
    from relaytrain_operator.loop.actions import ApplyWorkloadStatus

    job, pods = kueue_fleet()
    workloads = both(job, ADMITTED, EVICTED)
    leaving = decide(kobserved(job, pods, workloads=workloads, progress=progress(7)), SETTINGS)
    assert kinds(leaving) == [
        "delete:j-p1-s0",
        "delete:j-p1-s1",
        "event:PipelineLeaving",
        "given-up:1",
        "patch",
    ]
    assert leaving.status is not None and leaving.status.phase == "Running"
    gone = leaving.status.pipelines[1]  # type: ignore[index]
    assert (gone.phase, gone.left_at_step) == ("Left", 7)
    assert gone.left_reason is not None and gone.left_reason.startswith(
        "Kueue evicted its Workload (Preempted: Preempted to accommodate"
    )
    # Its pods gone: its quota (not pipeline 0's) is handed back.
    on = QFLEET.status(to_manifest(leaving.status)).build()
    alive = [p for p in pods if p["metadata"]["name"].startswith("j-p0")]
    released = decide(kobserved(on, alive, workloads=both(on, ADMITTED, EVICTED)), SETTINGS)
    (release,) = [a for a in released.actions if isinstance(a, ApplyWorkloadStatus)]
    assert release.body["metadata"]["name"] == workloads[1]["metadata"]["name"]
    # Every pipeline evicted: the job waits, Suspended, with Kueue's words.
    stopped = decide(kobserved(on, alive, workloads=both(on, EVICTED, EVICTED)), SETTINGS)
    assert ready_reason(stopped) == "Evicted"
    assert "Kueue evicted the workload (pipeline 0) (Preempted" in str(
        condition(stopped.status, READY)  # type: ignore[arg-type]
    )
    assert [w for w in kinds(stopped) if w.startswith("delete")] == [
        "delete:j-p0-s0",
        "delete:j-p0-s1",
    ]


def test_suspend_and_finish_reach_every_pipelines_workload() -> None:
    from relaytrain_operator.loop.actions import ApplyWorkloadStatus, PatchWorkload

    job, pods = kueue_fleet()
    suspended = QFLEET.suspend().status(job["status"]).build()
    held = decide(kobserved(suspended, pods, workloads=both(job, ADMITTED, ADMITTED)), SETTINGS)
    assert [a.name for a in held.actions if isinstance(a, PatchWorkload)] == [
        workload_of(job, pipeline=p)["metadata"]["name"] for p in (0, 1)
    ]
    done = decide(
        kobserved(
            job,
            pods,
            workloads=both(job, ADMITTED, ADMITTED),
            progress=progress(100, 100, done=True),
        ),
        SETTINGS,
    )
    assert len([a for a in done.actions if isinstance(a, ApplyWorkloadStatus)]) == 2


def test_a_queued_job_of_several_pipelines_on_a_store_it_cannot_tell_them_through_has_one() -> None:
    from relaytrain_operator.domain.queueing import workload_name

    local = QFLEET.checkpoint("/ckpt").build()
    del local["spec"]["checkpoint"]["endpoint"], local["spec"]["checkpoint"]["credentialsSecret"]
    decision = decide(kobserved(local, []), SETTINGS)
    assert [a.obj["metadata"]["name"] for a in decision.actions if isinstance(a, Create)] == [
        workload_name("j")
    ]


def test_a_pipeline_given_up_gives_its_quota_back_until_it_may_return() -> None:
    from relaytrain_operator.loop.actions import ApplyWorkloadStatus, PatchWorkload

    job, pods = kueue_fleet()
    job["status"]["pipelines"][1] |= {"phase": "Failed", "leftTime": "2026-11-22T09:59:50Z"}
    alive = [p for p in pods if p["metadata"]["name"].startswith("j-p0")]
    workloads = both(job, ADMITTED, ADMITTED)
    resting = decide(kobserved(job, alive, workloads=workloads), SETTINGS)
    # Its Workload made inactive (Kueue evicts it), woken when its return delay is over.
    assert [(a.name, a.patch) for a in resting.actions if isinstance(a, PatchWorkload)] == [
        (workloads[1]["metadata"]["name"], {"spec": {"active": False}})
    ]
    assert resting.retry_after == pytest.approx(290.0)
    # Evicted, and none of its pods left: its quota is handed back.
    inactive = both(job, ADMITTED, EVICTED)
    inactive[1]["spec"]["active"] = False
    released = decide(kobserved(job, alive, workloads=inactive), SETTINGS)
    (release,) = [a for a in released.actions if isinstance(a, ApplyWorkloadStatus)]
    assert release.body["metadata"]["name"] == workloads[1]["metadata"]["name"]
    # The delay over: active again, so Kueue may admit it and it comes back.
    later = decide(
        kobserved(job, alive, workloads=inactive, now=NOW + timedelta(seconds=400)), SETTINGS
    )
    assert [(a.name, a.patch) for a in later.actions if isinstance(a, PatchWorkload)] == [
        (workloads[1]["metadata"]["name"], {"spec": {"active": True}})
    ]
    # Given up for good (returnAfterSeconds 0): inactive for the rest of the job.
    never = copy.deepcopy(job)
    never["spec"]["failurePolicy"]["returnAfterSeconds"] = 0
    forever = decide(
        kobserved(never, alive, workloads=inactive, now=NOW + timedelta(days=9)), SETTINGS
    )
    assert [a for a in forever.actions if isinstance(a, PatchWorkload)] == []
