"""The first plan, and Kueue's admission: what a job's first pass records before any pod,
why a plan cannot be made, and a queued job's Workload, its waiting, admission, eviction,
suspension and end (decide/admission.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION, REPLACING
from relaytrain_operator.domain.status import READY, condition, load_status, to_manifest
from relaytrain_operator.loop.actions import Create, CreateLinkSecret
from relaytrain_operator.loop.decide import Decision, ModelConfig, Observed, Settings, decide, needs
from relaytrain_testkit.decide_cases import (
    GIB,
    JOB,
    NODES,
    NOW,
    PLAN,
    SETTINGS,
    T_RUNNING,
    events,
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

QUEUED = JOB.queue("team")
"""The job, queued for Kueue's LocalQueue `team`."""


def workload_of(
    job: dict[str, Any], *conditions: tuple[str, str, str, str], active: bool = True
) -> dict[str, Any]:
    """The job's Workload as Kueue left it: (type, status, reason, message) conditions; an
    admission (a100 → flavor fa, rtx → fr) while QuotaReserved is True."""
    from relaytrain_operator.domain.queueing import StageDemand, build_workload

    demands = [
        StageDemand(s["pool"], {"relaytrain.io/pool": s["pool"]}, s["predictedMemoryBytes"])
        for s in PLAN["stages"]
    ]
    wl = build_workload(job, demands, active=active)
    wl["metadata"].update(uid="wl-uid", generation=1)
    wl["status"] = {
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": T_RUNNING}
            for t, s, r, m in conditions
        ]
    }
    if any(t == "QuotaReserved" and s == "True" for t, s, _, _ in conditions):
        wl["status"]["admission"] = {
            "clusterQueue": "cq",
            "podSetAssignments": [
                {"name": "a100", "count": 1, "flavors": {"nvidia.com/gpu": "fa", "memory": "fa"}},
                {"name": "rtx", "count": 1, "flavors": {"nvidia.com/gpu": "fr"}},
            ],
        }
    return wl


ADMITTED = (
    ("QuotaReserved", "True", "QuotaReserved", "ok"),
    ("Admitted", "True", "Admitted", "ok"),
)
PENDING = (
    (
        "QuotaReserved",
        "False",
        "Pending",
        "couldn't assign flavors to pod set a100: insufficient unused quota for "
        "nvidia.com/gpu in flavor fa, 1 more needed",
    ),
)
EVICTED = (
    *ADMITTED,
    (
        "Evicted",
        "True",
        "Preempted",
        "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue",
    ),
)
FLAVORS = {
    "fa": {
        "metadata": {"name": "fa"},
        "spec": {
            "nodeLabels": {"relaytrain.io/pool": "a100", "tier": "gold"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "fr": {"metadata": {"name": "fr"}, "spec": {"nodeLabels": {"relaytrain.io/pool": "rtx"}}},
}


def kobserved(
    job: dict[str, Any],
    pods: list[dict[str, Any]] = (),
    workload: dict[str, Any] | None = None,
    *,
    priority: int | None = None,
    **kw: Any,
) -> Observed:  # type: ignore[assignment]
    base = observed(job, pods, **kw)
    assert needs(job, base.pods).workload, "a queued job's pass reads its Workload"
    return replace(
        base,
        workload=workload,
        flavors=FLAVORS if base.cluster_pods is not None else {},
        priority=priority,
    )


def applied(decision: Decision) -> list[Any]:
    from relaytrain_operator.loop.actions import ApplyWorkloadStatus

    return [a for a in decision.actions if isinstance(a, ApplyWorkloadStatus)]


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
