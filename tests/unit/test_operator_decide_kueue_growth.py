"""A running job of `replicas: auto` queued with Kueue grows through Kueue: a pipeline the
grow rule adds gets its own Workload and waits, out of the job and with no pod, until Kueue
admits it; a job queued with one Workload for the whole job does not grow (decide/grow.py,
decide/admission.py; docs/operator.md, "Queueing with Kueue")."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
from relaytrain_operator.domain import queueing
from relaytrain_operator.domain.builders.secret import build_link_secret
from relaytrain_operator.domain.linkcerts import link_state, mint_link_credentials
from relaytrain_operator.domain.linkcerts import state_annotations as link_annotations
from relaytrain_operator.domain.queueing import workload_name
from relaytrain_operator.domain.status import DEGRADED, condition, to_manifest
from relaytrain_operator.loop.actions import (
    Create,
    DeletePod,
    ExtendLinkSecret,
    PatchWorkload,
    PutFleet,
    PutGivenUp,
)
from relaytrain_operator.loop.decide import (
    Decision,
    decide,
    needs,
    stage_pods,
)
from relaytrain_testkit.decide_cases import JOB, NODES, NOW, SETTINGS, events, node
from relaytrain_testkit.decide_fleet import (
    AUTO_8B,
    AUTO_STEPS,
    LLAMA_8B,
    aged,
    fleet,
    replacement_waiting,
    run_pods,
)
from relaytrain_testkit.decide_kueue import ADMITTED, PENDING, kobserved, workload_of
from relaytrain_testkit.decide_views import Progress, ready_reason

pytestmark = pytest.mark.unit

STEPS, BIG = AUTO_STEPS, AUTO_8B
QBIG = BIG.queue("team").label(queueing.PRIORITY_LABEL, "research")
"""BIG queued for LocalQueue `team` at priority class `research`."""
PRIORITY = 100
"""The value of `research`, as the job's Workloads carry it."""


def progress(step: int) -> Progress:
    return Progress(status={"step": step, "totalSteps": STEPS}, done=False, output=None)


def h100(i: int) -> dict[str, Any]:
    """An H100 that joins pool h100."""
    return node(f"h100-{i}", "h100", zone="b")


def queued_training(
    job_t: Any = BIG, nodes: list[dict[str, Any]] = NODES
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """`job_t` planned on `nodes`, training as once Kueue admitted each pipeline, queued
    (QBIG's labels), with its link certificates read once: the job, its pods, its Secret."""
    job, pods = fleet(job_t, LLAMA_8B, nodes)
    plan = job["status"]["plan"]
    counts = [len(p["stages"]) for p in plan.get("pipelines") or [{"stages": plan["stages"]}]]
    files = mint_link_credentials(
        "ns", "j", counts, now=NOW - timedelta(days=1), lifetime=timedelta(days=30)
    )
    secret = build_link_secret(JOB.build(), files, link_annotations(link_state(files, {})), "7")
    queued = copy.deepcopy(job)
    queued["metadata"]["labels"] = QBIG.build()["metadata"]["labels"]
    several = "pipelines" in plan
    seen = decide(
        kobserved(queued, pods, None if several else workload_of(queued, *ADMITTED),
                  workloads=admitted(queued) if several else None, nodes=nodes,
                  model=LLAMA_8B, progress=progress(40), link_secret=secret),
        SETTINGS,
    )  # fmt: skip
    assert seen.status is not None and seen.status.phase == "Running"
    queued["status"] = to_manifest(seen.status)
    return queued, pods, secret


def admitted(job: dict[str, Any], *pending: int, **conditions: Any) -> dict[int, dict[str, Any]]:
    """A Workload per planned pipeline of `job`, admitted (those `pending` not; others as
    `conditions` say, by `p<i>`), carrying the job's priority."""
    out = {}
    for p in range(len(job["status"]["plan"]["pipelines"])):
        said = conditions.get(f"p{p}", PENDING if p in pending else ADMITTED)
        w = workload_of(job, *said, pipeline=p)
        w["spec"]["priority"] = PRIORITY
        out[p] = w
    return out


def grow_pass(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    secret: dict[str, Any],
    workloads: dict[int, dict[str, Any]],
    *joined: dict[str, Any],
    step: int = 40,
) -> Decision:
    return decide(
        kobserved(job, pods, workloads=workloads, nodes=[*NODES, *joined], model=LLAMA_8B,
                  progress=progress(step), link_secret=secret),
        SETTINGS,
    )  # fmt: skip


def stored(job: dict[str, Any], decision: Decision) -> dict[str, Any]:
    assert decision.status is not None
    after = copy.deepcopy(job)
    after["status"] = to_manifest(decision.status)
    return after


def pods_created(decision: Decision) -> list[str]:
    return [
        a.obj["metadata"]["name"]
        for a in decision.actions
        if isinstance(a, Create) and a.obj["kind"] == "Pod"
    ]


def test_a_queued_job_grows_by_a_pipeline_whose_pods_wait_for_kueue_to_admit_its_workload() -> None:
    job, pods, secret = queued_training()
    assert needs(job, stage_pods(pods), NOW).room  # it looks for GPUs that joined
    grown = grow_pass(job, pods, secret, admitted(job), h100(1))
    # The grown plan recorded first, then pipeline 3's own Workload; no pod, no store.
    kinds = [type(a).__name__ for a in grown.actions]
    made = [a.obj for a in grown.actions if isinstance(a, Create)]
    assert [w["kind"] for w in made] == ["Workload"] and not pods_created(grown)
    assert kinds.index("PatchStatus") < kinds.index("Create")
    assert not [a for a in grown.actions if isinstance(a, PutFleet)]
    # Its stage's certificate is minted already (the Secret is read until it starts).
    (extend,) = [a for a in grown.actions if isinstance(a, ExtendLinkSecret)]
    assert extend.stages == ((3, 0),)
    (workload,) = made
    assert workload["metadata"]["name"] == workload_name("j", 3)
    assert workload["metadata"]["labels"]["relaytrain.io/pipeline"] == "3"
    assert workload["spec"]["queueName"] == "team" and workload["spec"]["active"] is True
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [("h100", 1)]
    selector = workload["spec"]["podSets"][0]["template"]["spec"]["nodeSelector"]
    assert selector["relaytrain.io/pool"] == "h100"
    # The job's priority, as its other Workloads carry it (not read again this pass).
    assert workload["spec"]["priority"] == PRIORITY
    assert workload["spec"]["priorityClassRef"]["name"] == "research"
    # The record: four pipelines, the added one out of the job, waiting for Kueue.
    assert grown.status is not None and grown.status.plan is not None
    assert grown.status.plan.pipelines is not None and len(grown.status.plan.pipelines) == 4
    added = grown.status.pipelines[3]  # type: ignore[index]
    assert (added.phase, added.added_at_step, added.left_at_step) == ("Left", 40, 40)
    assert added.left_reason == "its Workload waits for Kueue to admit it"
    assert [p.phase for p in grown.status.pipelines[:3]] == ["Running"] * 3  # type: ignore[index]
    (said,) = [e for e in events(grown) if e.reason == "PipelineAdded"]
    assert said.change == "added" and said.message.startswith("Pipeline 3 is added after step 40")
    assert "It waits for Kueue: its own Workload is submitted to LocalQueue team" in said.message
    degraded = condition(grown.status, DEGRADED)
    assert degraded is not None and "pipeline 3 left: its Workload waits for Kueue" in (
        degraded.message
    )
    assert grown.status.phase == "Running"

    # Kueue has not admitted it: still no pod of pipeline 3, no second Workload or Event,
    # the stages told it is out, and no more growth while Kueue is asked (another H100).
    waiting = stored(job, grown)
    four = {**admitted(job), 3: pending_workload(waiting)}
    still = grow_pass(waiting, pods, secret, four, h100(1), h100(2))
    assert not [a for a in still.actions if isinstance(a, Create)]
    assert [a.pipelines for a in still.actions if isinstance(a, PutGivenUp)] == [(3,)]
    assert not [e for e in events(still) if e.reason in ("PipelineAdded", "PipelineLeaving")]
    assert still.status is not None and still.status.pipelines[3].phase == "Left"  # type: ignore[index]
    assert not [a for a in still.actions if isinstance(a, PatchWorkload)]  # kept active

    # Kueue admits it: the store stops naming it and learns of its stage, then its pod
    # (its certificate made again first: the Secret here lost the one minted above).
    told = stored(waiting, still)
    assert needs(told, stage_pods(pods), NOW).link_secret
    four[3] = workload_of(told, *ADMITTED, pipeline=3)
    joined = grow_pass(told, pods, secret, four, h100(1))
    assert pods_created(joined) == ["j-p3-s0"]
    kinds = [type(a).__name__ for a in joined.actions]
    assert kinds.index("PutGivenUp") < kinds.index("PutFleet") < kinds.index("Create")
    assert kinds.index("ExtendLinkSecret") < kinds.index("Create")
    assert [a.pipelines for a in joined.actions if isinstance(a, PutGivenUp)] == [()]
    (start,) = [a.obj for a in joined.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert start["spec"]["nodeSelector"]["relaytrain.io/pool"] == "h100"
    assert joined.status is not None
    assert joined.status.pipelines[3].phase == "Pending"  # type: ignore[index]


def pending_workload(job: dict[str, Any]) -> dict[str, Any]:
    w = workload_of(job, *PENDING, pipeline=3)
    w["spec"]["priority"] = PRIORITY
    return w


def test_a_job_grows_with_a_workload_per_pipeline_not_with_one_or_of_one_pipeline() -> None:
    job, pods, secret = queued_training()
    per_pipeline = grow_pass(job, pods, secret, admitted(job), h100(1))
    assert [a.obj["kind"] for a in per_pipeline.actions if isinstance(a, Create)] == ["Workload"]
    # Queued by an operator from before Workloads per pipeline: its one Workload holds the
    # job's quota; a pipeline added beside it would run outside its admission.
    whole = workload_of(job, *ADMITTED)
    once = decide(
        kobserved(job, pods, whole, nodes=[*NODES, h100(1)], model=LLAMA_8B,
                  progress=progress(40), link_secret=secret),
        SETTINGS,
    )  # fmt: skip
    assert not [a for a in once.actions if isinstance(a, Create | ExtendLinkSecret | PutFleet)]
    assert once.status is not None and once.status.plan is not None
    assert len(once.status.plan.pipelines or ()) == 3
    assert not [e for e in events(once) if e.reason == "PipelineAdded"]
    # A job of one pipeline has one Workload for the whole job: no growth by a restart
    # either (unqueued, the same job looks for GPUs to grow on).
    alone = [node("h100-0", "h100", zone="b")]
    one, one_pods, _ = queued_training(nodes=alone)
    assert one["status"]["plan"].get("pipelines") is None
    plain = copy.deepcopy(one)
    del plain["metadata"]["labels"]
    assert needs(plain, stage_pods(one_pods), NOW).room
    assert not needs(one, stage_pods(one_pods), NOW).room


def test_a_pipeline_given_up_holds_growth_off_under_kueue_until_given_up_for_good() -> None:
    job, pods, secret = queued_training()
    alive = [p for p in pods if p["metadata"]["labels"]["relaytrain.io/pipeline"] != "1"]
    # Pipeline 1 given up long ago: its return delay is over, its Workload active again and
    # Kueue asked for it (pending). Kueue decides first: nothing is added meanwhile.
    job["status"]["pipelines"][1] |= {"phase": "Failed", "leftTime": "2026-11-22T08:00:00Z"}
    waits = grow_pass(job, alive, secret, admitted(job, 1), h100(1))
    assert not [a for a in waits.actions if isinstance(a, Create)]
    # Given up for good (returnAfterSeconds 0): its Workload stays inactive, and the GPUs
    # free are priced for a pipeline of their own, which Kueue is asked for.
    never = copy.deepcopy(job)
    never["spec"]["failurePolicy"]["returnAfterSeconds"] = 0
    inactive = admitted(never, 1)
    inactive[1]["spec"]["active"] = False
    grows = grow_pass(never, alive, secret, inactive, h100(1))
    made = [a.obj for a in grows.actions if isinstance(a, Create)]
    assert [w["metadata"]["name"] for w in made] == [workload_name("j", 3)]


def test_an_added_pipeline_kueue_could_not_hold_as_one_workload_is_not_added(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job, pods, secret = queued_training()
    workloads = admitted(job)
    monkeypatch.setattr(queueing, "MAX_POD_SETS", 0)
    refused = grow_pass(job, pods, secret, workloads, h100(1))
    assert not [a for a in refused.actions if isinstance(a, Create)]
    assert refused.status is not None and refused.status.plan is not None
    assert len(refused.status.plan.pipelines or ()) == 3
    growth = refused.status.growth
    assert growth is not None and "a Kueue Workload holds at most 0 pod sets" in growth.reason
    assert growth.free_gpus == "h100 x1, rtx x1"


def test_an_added_pipeline_kueue_has_not_admitted_is_withdrawn_near_the_jobs_end() -> None:
    job, pods, secret = queued_training()
    grown = grow_pass(job, pods, secret, admitted(job), h100(1))
    waiting = stored(job, grown)
    four = {**admitted(job), 3: pending_workload(waiting)}
    # The job's estimated end is nearer than a join costs: admitted now, pipeline 3 would
    # not pay back its start. Its Workload goes inactive (out of the queue), once said.
    near = copy.deepcopy(waiting)
    near["status"]["progress"]["eta"] = "2026-11-22T10:01:00Z"
    withdrawn = grow_pass(near, pods, secret, four, h100(1))
    assert [(a.name, a.patch) for a in withdrawn.actions if isinstance(a, PatchWorkload)] == [
        (workload_name("j", 3), {"spec": {"active": False}})
    ]
    (said,) = [e for e in events(withdrawn) if e.reason == "PipelineWithdrawn"]
    assert said.message.startswith("Pipeline 3, added at step 40, does not start: its Workload")
    assert "(--join-seconds 120)" in said.message
    assert withdrawn.status is not None
    out = withdrawn.status.pipelines[3]  # type: ignore[index]
    assert out.phase == "Left" and out.left_reason is not None
    assert out.left_reason.startswith("its Workload is withdrawn from LocalQueue team")
    assert not pods_created(withdrawn)
    # Inactive already: nothing more to do or say.
    four[3]["spec"]["active"] = False
    later = stored(near, withdrawn)
    later["status"]["progress"]["eta"] = "2026-11-22T10:01:00Z"
    again = grow_pass(later, pods, secret, four, h100(1))
    assert not [a for a in again.actions if isinstance(a, PatchWorkload)]
    assert not [e for e in events(again) if e.reason == "PipelineWithdrawn"]
    # The estimate moves out again (the job slowed): asked for again.
    later["status"]["progress"]["eta"] = "2026-11-22T12:00:00Z"
    asked = grow_pass(later, pods, secret, four, h100(1))
    assert [(a.name, a.patch) for a in asked.actions if isinstance(a, PatchWorkload)] == [
        (workload_name("j", 3), {"spec": {"active": True}})
    ]
    # A pipeline that trained (it came back once) is not withdrawn; nor one of the plan.
    came = copy.deepcopy(near)
    came["status"]["pipelines"][3]["returns"] = 1
    kept = grow_pass(came, pods, secret, {**admitted(job), 3: pending_workload(waiting)})
    assert not [a for a in kept.actions if isinstance(a, PatchWorkload)]
    assert not [e for e in events(kept) if e.reason == "PipelineWithdrawn"]


def test_a_pipeline_whose_replacement_finds_no_gpu_gives_its_workload_back_for_one_that_fits() -> (
    None
):
    """Under Kueue (one Workload per pipeline), pipeline 2's A100 node is gone and its
    stage's replacement waits on the full A100 pool, the pool its Workload was admitted on.
    Once it waited as long as a re-split costs it leaves for good (`retired`): its Workload
    is made inactive, so Kueue takes its quota back once its pods are gone, and the GPUs free
    (an H100 that joined) are priced for a pipeline shaped for them, asked of Kueue with a
    Workload of its own; pipeline 2 never comes back, even once its Workload would fit."""
    job, pods, secret = queued_training()
    waiting, others, gone = replacement_waiting(job, pods, 2, "a100")
    seen = [n for n in NODES if n["metadata"]["name"] != gone] + [h100(1)]
    cost = SETTINGS.join_seconds
    workloads = admitted(job)

    def after(
        waited: float, now_pods: list[dict[str, Any]], of: dict[str, Any] | None = None
    ) -> Decision:
        return decide(
            kobserved(of or job, aged(now_pods, "j-p2-s0", waited), workloads=workloads,
                      nodes=seen, model=LLAMA_8B, progress=progress(40), link_secret=secret),
            SETTINGS,
        )  # fmt: skip

    # Before it waited as long as a re-split costs: it waits on its pool.
    early = after(cost - 30, [*others, waiting])
    assert not [a for a in early.actions if isinstance(a, DeletePod)]
    assert early.retry_after is not None and early.retry_after <= 30
    # Then it leaves for good: its pod goes, no failure counted, the Event says why.
    late = after(cost + 5, [*others, waiting])
    assert [a.name for a in late.actions if isinstance(a, DeletePod)] == ["j-p2-s0"]
    assert late.status is not None and late.status.pipelines is not None
    left = late.status.pipelines[2]
    assert left.phase == "Left" and left.retired, left
    assert f"the replacement of its stage 0 waited {int(cost) + 5} s" in str(left.left_reason)
    (said,) = [e for e in events(late) if e.reason == "PipelineLeaving"]
    assert "its Workload is given back to LocalQueue team" in said.message
    # Its pod gone: its Workload is made inactive (Kueue evicts it and the quota is handed
    # back), and a pipeline on the H100 is asked of Kueue in its place, with no pod yet.
    job = stored(job, late)
    grown = after(0, others)
    inactive = [a for a in grown.actions if isinstance(a, PatchWorkload)]
    assert [(a.name, a.patch["spec"]["active"]) for a in inactive] == [
        (workload_name("j", 2), False)
    ]
    made = [a.obj for a in grown.actions if isinstance(a, Create)]
    assert [w["kind"] for w in made] == ["Workload"] and not pods_created(grown)
    (workload,) = made
    assert workload["metadata"]["name"] == workload_name("j", 3)
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [("h100", 1)]
    assert grown.status is not None and grown.status.pipelines is not None
    assert [(p.phase, p.retired) for p in grown.status.pipelines[2:]] == [
        ("Left", True),
        ("Left", False),
    ]
    # Kueue admits pipeline 3 (it evicted pipeline 2's Workload): pipeline 3 starts on the
    # H100; pipeline 2 stays out though an A100 is back and its Workload would be admitted.
    job = stored(job, grown)
    workloads = {**admitted(job), 2: workload_of(job, *PENDING, pipeline=2)}
    seen = [*NODES, h100(1)]
    started = after(0, others)
    assert pods_created(started) == ["j-p3-s0"]
    job = stored(job, started)
    workloads = admitted(job)
    running = after(0, [*others, *run_pods(started, seen)])
    assert "j-p2-s0" not in pods_created(running)
    # Pipeline 2 is no longer the job's: with pipeline 3 training, every pipeline is.
    assert running.status is not None and running.status.ready_pipelines == "3/3"
    assert ready_reason(running) == "StagesRunning", running.status.conditions
