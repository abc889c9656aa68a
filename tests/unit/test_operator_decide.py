"""Reconcile as a pure decision: observed state in, ordered actions and the new status out.

A table covers the branches a job goes through (first creation, suspend and resume, a stage
failure and its replacement, a lost node, the back-off and the restart limit, completion,
deletion); the tests after it check what the table cannot say in one line (pod contents,
where a replacement goes, what is counted, what is patched).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from relaytrain_operator.domain.progress import Progress
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION, REPLACING
from relaytrain_operator.domain.status import READY, condition, load_status, to_manifest
from relaytrain_operator.loop.actions import (
    Create,
    CreateLinkSecret,
    DeletePod,
    PatchStatus,
    PostEvent,
    PutGivenUp,
)
from relaytrain_operator.loop.decide import (
    WAITING_ANNOTATION,
    Decision,
    ModelConfig,
    Needs,
    Observed,
    Settings,
    decide,
    needs,
    parse_spec,
    stage_pods,
)
from relaytrain_operator.spec import FineTuneJobStatus, StageStatus

from tests.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
T_RUNNING = "2026-11-22T09:00:00Z"
GIB = 1024**3
SETTINGS = Settings(node_lost_seconds=30, worker_image="img:1", default_link=(1000.0, 10.0))
PRODUCTS = {
    "a100": ("NVIDIA-A100-SXM4-40GB", 40960),
    "rtx": ("NVIDIA-GeForce-RTX-4090", 24564),
    "h100": ("NVIDIA-H100-80GB-HBM3", 81559),
}
PLAN = {
    "stages": [
        {
            "index": 0,
            "pool": "a100",
            "layerStart": 0,
            "layerEnd": 15,
            "predictedMemoryBytes": 20 * GIB,
        },
        {
            "index": 1,
            "pool": "rtx",
            "layerStart": 15,
            "layerEnd": 30,
            "predictedMemoryBytes": 10 * GIB,
        },
    ]
}


def manifest(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"uri": "s3://models/smol/"},
        "dataset": {"uri": "s3://data/train.jsonl", "sequenceLength": 256},
        "training": {"steps": 100, "microBatchSize": 1, "microBatches": 8},
        "pipeline": {"stages": 2},
        "checkpoint": {
            "uri": "s3://ckpt/runs",
            "endpoint": "http://minio:9000",
            "credentialsSecret": {"name": "s3"},
        },
        "failurePolicy": {"maxStageRestarts": 2, "backoffSeconds": 0},
    }
    for key, value in spec.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    job: dict[str, Any] = {
        "apiVersion": "relaytrain.io/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "job-uid", "generation": 4},
        "spec": base,
    }
    if status is not None:
        job["status"] = status
    return job


def node(
    name: str,
    pool: str,
    *,
    ready: bool = True,
    zone: str = "a",
    gpus: int = 1,
    since: str = "2026-11-22T09:59:00Z",
) -> dict[str, Any]:
    product, memory = PRODUCTS[pool]
    return {
        "metadata": {
            "name": name,
            "labels": {
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.memory": str(memory),
                "relaytrain.io/pool": pool,
                "zone": zone,
            },
            "annotations": {},
        },
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": since,
                }
            ],
        },
    }


NODES = [
    node("a100-0", "a100"),
    node("a100-1", "a100"),
    node("rtx-0", "rtx"),
    node("h100-0", "h100", zone="b"),
]


def pod(
    k: int,
    phase: str = "Running",
    *,
    node_name: str | None = None,
    incarnation: int = 0,
    deleting: bool = False,
    reason: str | None = None,
    pool: str | None = None,
    job: str = "j",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    pool = pool or PLAN["stages"][k]["pool"] if k < 2 else "a100"
    meta: dict[str, Any] = {
        "name": f"{job}-stage-{k}",
        "namespace": "ns",
        "uid": f"uid-{job}-{k}-{incarnation}",
        "labels": {"relaytrain.io/job": job, "relaytrain.io/stage": str(k)},
        "annotations": {
            "relaytrain.io/pool": pool,
            INCARNATION_ANNOTATION: str(incarnation),
            **(annotations or {}),
        },
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T09:59:30Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False"}],
    }
    if reason:
        status["reason"] = reason
    default_node = {0: "a100-0", 1: "rtx-0"}.get(k)
    return {
        "metadata": meta,
        "spec": {
            "nodeName": node_name if node_name is not None else default_node,
            "containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
        },
        "status": status,
    }


def unbound(p: dict[str, Any]) -> dict[str, Any]:
    p = copy.deepcopy(p)
    p["spec"]["nodeName"] = None
    return p


def stage(k: int, **fields: Any) -> dict[str, Any]:
    entry = {
        "index": k,
        "pool": PLAN["stages"][k]["pool"],
        "pod": f"j-stage-{k}",
        "node": {0: "a100-0", 1: "rtx-0"}[k],
        "phase": "Running",
        "ready": True,
        "restarts": 0,
    }
    entry.update(fields)
    return {key: value for key, value in entry.items() if value is not None}


def running_status(*stages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A started job's stored status (as the previous pass wrote it)."""
    entries = list(stages) or [stage(0), stage(1)]
    ready = all(s.get("ready") for s in entries)
    reason, message = (
        ("StagesRunning", "All 2 stages are running.") if ready else ("StagesStarting", "x")
    )
    status: dict[str, Any] = {
        "phase": "Running" if ready else "Pending",
        "observedGeneration": 4,
        "conditions": [
            {
                "type": kind,
                "status": "True" if value else "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": T_RUNNING,
                "observedGeneration": 4,
            }
            for kind, value in (
                ("Progressing", True),
                ("Ready", ready),
                ("Reconciling", not ready),
                ("Stalled", False),
            )
        ],
        "startTime": "2026-11-22T08:00:00Z",
        "plan": PLAN,
        "stages": entries,
        "readyStages": f"{sum(1 for s in entries if s.get('ready'))}/{len(entries)}",
        "restarts": sum(s.get("restarts", 0) for s in entries),
    }
    status.update(fields)
    return to_manifest(load_status(status))


def observed(
    job: dict[str, Any] | None,
    pods: list[dict[str, Any]] = (),  # type: ignore[assignment]
    *,
    nodes: list[dict[str, Any]] | None = None,
    cluster_pods: list[dict[str, Any]] | None = None,
    model: ModelConfig | None = None,
    progress: Progress | None = None,
    now: datetime = NOW,
) -> Observed:
    """What the observer would hand over: it reads what `needs` asks for."""
    by_stage = stage_pods(pods)
    nodes = NODES if nodes is None else nodes
    wanted = needs(job, by_stage) if job is not None else Needs()
    return Observed(
        job=job,
        now=now,
        pods=by_stage,
        nodes={n["metadata"]["name"]: n for n in nodes},
        cluster_pods=(list(pods) if cluster_pods is None else cluster_pods)
        if wanted.room
        else None,
        model=(model or ModelConfig(SMOLLM2_135M_CONFIG)) if wanted.model else None,
        progress=progress if wanted.progress else None,
    )


def summary(decision: Decision) -> list[str]:
    """The actions in order, one short word each."""
    out = []
    for a in decision.actions:
        if isinstance(a, PatchStatus):
            out.append("patch")
        elif isinstance(a, CreateLinkSecret):
            out.append("secret")
        elif isinstance(a, Create):
            out.append(f"create:{a.obj['metadata']['name']}")
        elif isinstance(a, DeletePod):
            out.append(f"delete:{a.name}" + ("!" if a.force else ""))
        elif isinstance(a, PutGivenUp):
            out.append(f"given-up:{','.join(map(str, a.pipelines))}")
        else:
            assert isinstance(a, PostEvent)
            out.append(f"event:{a.reason}")
    return out


def ready_reason(decision: Decision) -> str | None:
    assert decision.status is not None
    ready = condition(decision.status, READY)
    return ready.reason if ready else None


def events(decision: Decision) -> list[PostEvent]:
    return [a for a in decision.actions if isinstance(a, PostEvent)]


def created(decision: Decision, name: str) -> dict[str, Any]:
    return next(
        a.obj
        for a in decision.actions
        if isinstance(a, Create) and a.obj["metadata"]["name"] == name
    )


def stage_document(decision: Decision, name: str) -> dict[str, Any]:
    """The stage-contract document of the pod `decision` created as `name`."""
    env = created(decision, name)["spec"]["containers"][0]["env"]
    return json.loads(next(e["value"] for e in env if e["name"] == "RELAYTRAIN_STAGE_CONFIG"))  # type: ignore[no-any-return]


def patches(decision: Decision) -> list[FineTuneJobStatus]:
    return [a.status for a in decision.actions if isinstance(a, PatchStatus)]


def progress(step: int, committed: int | None = None, **extra: Any) -> Progress:
    status: dict[str, Any] = {"step": step, "totalSteps": 100, "stepOfTotal": f"{step}/100"}
    if committed is not None:
        status["lastCommittedStep"] = committed
    return Progress(status=status, done=extra.get("done", False), output=extra.get("output"))


RUNNING = [pod(0), pod(1)]
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
        observed(manifest(), nodes=[node("a100-0", "a100"), node("rtx-0", "rtx")]),
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
        observed(manifest(), model=ModelConfig(error="no config.json")),
        ["patch", "event:ModelUnavailable"],
        "Pending",
        "ModelUnavailable",
    ),
    Case(
        "no free GPU anywhere: Unschedulable",
        observed(manifest(), nodes=[node("a100-0", "a100", ready=False)]),
        ["patch", "event:Unschedulable"],
        "Pending",
        "Unschedulable",
    ),
    Case(
        "an invalid spec",
        observed(manifest(method={"targetModules": ["lm_head"]})),
        ["patch", "event:InvalidSpec"],
        "Failed",
        "InvalidSpec",
    ),
    Case(
        "pods starting",
        observed(manifest(running_status()), [pod(0), pod(1, "Pending")]),
        ["patch"],
        "Pending",
        "StagesStarting",
        [0, 0],
    ),
    Case(
        "all running and nothing changed: no action at all",
        observed(manifest(running_status()), RUNNING),
        [],
        "Running",
        "StagesRunning",
        [0, 0],
    ),
    # --- suspend / resume ---
    Case(
        "suspend removes the pods",
        observed(manifest(running_status(), suspend=True), RUNNING),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:Suspended"],
        "Suspended",
        "Suspended",
        [0, 0],
    ),
    Case(
        "resume creates the pods again from the same plan",
        observed(
            manifest(
                running_status(
                    stage(0, pod=None, node=None, phase=None, ready=None),
                    stage(1, pod=None, node=None, phase=None, ready=None),
                )
            ),
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
        observed(manifest(running_status()), [pod(0, "Failed", reason="OOMKilled"), pod(1)]),
        ["patch", "event:StageRestarting", "delete:j-stage-0", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    Case(
        "a pod deleted by someone else is counted and replaced at once",
        observed(manifest(running_status()), [pod(1)]),
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
        observed(manifest(running_status()), [pod(0, deleting=True), pod(1)]),
        ["patch", "event:StageRestarting", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    Case(
        "the successor of a counted failure is created",
        observed(
            manifest(
                running_status(
                    stage(0, phase=REPLACING, restarts=1, ready=False, lastFailure="Error"),
                    stage(1),
                )
            ),
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
        observed(manifest(running_status()), RUNNING, nodes=[node("rtx-0", "rtx")]),
        ["patch", "event:StageRestarting", "delete:j-stage-0!", "patch"],
        "Recovering",
        "StageRestarting",
        [1, 0],
    ),
    # --- back-off limit ---
    Case(
        "a failure past maxStageRestarts fails the job and removes its pods",
        observed(
            manifest(running_status(stage(0, restarts=2), stage(1))),
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
    # --- completion ---
    Case(
        "progress.json says done: Succeeded, pods removed",
        observed(
            manifest(running_status()),
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
            manifest(running_status(stage(0, restarts=2), stage(1))),
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
        observed(manifest(running_status()), [pod(0, "Succeeded"), pod(1, "Succeeded")]),
        ["delete:j-stage-0", "delete:j-stage-1", "patch", "event:Succeeded"],
        "Succeeded",
        "Succeeded",
        [0, 0],
    ),
    Case(
        "a finished job only has its pods removed",
        observed(manifest(SUCCEEDED), [pod(0, "Succeeded"), pod(1, deleting=True)]),
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
    job = manifest(running_status())
    job["metadata"]["deletionTimestamp"] = "2026-11-22T09:59:00Z"
    assert decide(observed(job, RUNNING), SETTINGS) == Decision()


def test_needs_reads_only_what_the_decision_uses() -> None:
    started = manifest(running_status())
    assert needs(started, stage_pods(RUNNING)) == Needs(progress=True)
    assert needs(started, stage_pods([pod(1)])) == Needs(pods=True, room=True, progress=True)
    assert needs(manifest(), {}) == Needs(room=True, model=True)
    local = manifest(running_status(), checkpoint={"uri": "/ckpt", "endpoint": None})
    local["spec"]["checkpoint"] = {"uri": "/ckpt"}
    assert needs(local, stage_pods(RUNNING)) == Needs()
    # Nothing costly for jobs that do not run: invalid, suspended, finished.
    assert needs(manifest(method={"targetModules": ["lm_head"]}), {}) == Needs()
    assert needs(manifest(running_status(), suspend=True), {}) == Needs()
    assert needs(manifest(SUCCEEDED), {}) == Needs()


def test_parse_spec_says_why_a_job_cannot_run() -> None:
    assert "spec.training" in str(parse_spec(manifest(training={"steps": 0})))
    assert "lm_head" in str(parse_spec(manifest(method={"targetModules": ["lm_head"]})))
    assert not isinstance(parse_spec(manifest()), str)


def test_stage_pods_are_keyed_by_their_stage_label() -> None:
    stray = pod(0)
    stray["metadata"]["labels"]["relaytrain.io/stage"] = "x"
    # A pod without a pipeline label (an older operator's) is of pipeline 0.
    other = pod(1)
    other["metadata"]["labels"]["relaytrain.io/pipeline"] = "2"
    assert stage_pods([pod(1), stray, other]) == {(0, 1): pod(1), (2, 1): other}


# --- the first plan and the pods it creates --------------------------------------------


def test_first_pass_records_the_plan_before_any_pod_and_builds_pods_from_it() -> None:
    decision = decide(
        observed(manifest(), nodes=[node("a100-0", "a100"), node("rtx-0", "rtx")]), SETTINGS
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


def test_a_plan_counts_gpus_other_pods_hold() -> None:
    nodes = [node("a100-0", "a100"), node("rtx-0", "rtx"), node("rtx-1", "rtx")]
    busy = pod(0, job="other", node_name="a100-0")
    decision = decide(observed(manifest(), nodes=nodes, cluster_pods=[busy]), SETTINGS)
    assert decision.status is not None and decision.status.plan is not None
    assert {s.pool for s in decision.status.plan.stages} == {"rtx"}


def test_unschedulable_clears_a_stale_plan_and_says_why() -> None:
    job = manifest({"phase": "Pending", "plan": PLAN}, placement={"nodeSelector": {"zone": "z"}})
    decision = decide(observed(job), SETTINGS)
    assert decision.status is not None and decision.status.plan is None
    message = condition(decision.status, READY).message  # type: ignore[union-attr]
    assert "No free GPU" in message and "zone=z" in message
    assert [e.reason for e in events(decision)] == ["Unschedulable"]
    # A later pass that still cannot plan writes nothing and posts no second Event.
    again = decide(
        observed(manifest(to_manifest(decision.status), placement={"nodeSelector": {"zone": "z"}})),
        SETTINGS,
    )
    assert summary(again) == []


def test_a_job_image_and_no_credentials() -> None:
    job = manifest(
        running_status(stage(0, pod=None, node=None, phase=None, ready=None), stage(1)),
        image="custom:2",
        checkpoint={"uri": "/ckpt", "endpoint": None, "credentialsSecret": None},
    )
    job["spec"]["checkpoint"] = {"uri": "/ckpt"}
    p = created(decide(observed(job, [pod(1)]), SETTINGS), "j-stage-0")
    container = p["spec"]["containers"][0]
    assert container["image"] == "custom:2"
    assert "AWS_ACCESS_KEY_ID" not in {e["name"] for e in container["env"]}


# --- replacements ----------------------------------------------------------------------


def replacing_job(**spec: Any) -> dict[str, Any]:
    """Stage 0 failed (counted: restarts 1, Replacing); its pod is gone."""
    status = running_status(
        stage(0, phase=REPLACING, restarts=1, ready=False, lastFailure="NodeLost"), stage(1)
    )
    return manifest(status, **spec)


def test_a_replacement_never_lands_on_a_node_the_node_selector_excludes() -> None:
    # Stage 0's pool (a100) is full: its node is gone and the other holds another job's pod.
    # The only free GPU big enough is an H100 in zone b; the job asks for zone a.
    job = replacing_job(placement={"nodeSelector": {"zone": "a"}})
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
            manifest(to_manifest(decision.status), placement={"nodeSelector": {"zone": "a"}}),
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
            manifest(to_manifest(later.status), placement={"nodeSelector": {"zone": "a"}}),  # type: ignore[arg-type]
            [bound, pod(1)],
            nodes=nodes,
        ),
        SETTINGS,
    )
    assert ready_reason(after) == "StagesRunning"


def test_a_replacement_moves_to_an_eligible_pool_whose_memory_fits() -> None:
    job = replacing_job(placement={"nodeSelector": {"zone": "a"}})
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


def test_a_replacement_stays_on_its_pool_when_it_has_room() -> None:
    decision = decide(observed(replacing_job(), [pod(1)]), SETTINGS)
    successor = created(decision, "j-stage-0")
    assert successor["spec"]["nodeSelector"]["relaytrain.io/pool"] == "a100"
    assert successor["metadata"]["annotations"][INCARNATION_ANNOTATION] == "1"


def test_a_replacement_records_the_newest_committed_step() -> None:
    job = replacing_job()
    job["status"]["progress"] = {"step": 12, "lastCommittedStep": 10}
    fresh = decide(observed(job, [pod(1)], progress=progress(14, 12)), SETTINGS)
    assert fresh.status is not None and fresh.status.stages[0].restored_from_step == 12
    # The store had no newer commit to say: the one status last folded in.
    stale = decide(observed(job, [pod(1)], progress=progress(14)), SETTINGS)
    assert stale.status is not None and stale.status.stages[0].restored_from_step == 10
    # No commit known at all: nothing to say.
    nothing = decide(observed(replacing_job(), [pod(1)]), SETTINGS)
    assert nothing.status is not None and nothing.status.stages[0].restored_from_step is None


def test_the_backoff_delays_a_replacement_and_asks_to_be_woken() -> None:
    job = replacing_job(failurePolicy={"backoffSeconds": 30})
    job["status"]["stages"][0]["lastFailureTime"] = "2026-11-22T09:59:50Z"
    early = decide(observed(job, [pod(1)]), SETTINGS)
    assert not any(isinstance(a, Create) for a in early.actions)
    assert early.retry_after == 20.0
    due = decide(observed(job, [pod(1)], now=NOW + timedelta(seconds=20)), SETTINGS)
    assert "create:j-stage-0" in summary(due)
    # A failure counted in this very pass waits the whole back-off, from the time recorded.
    counted = decide(
        observed(manifest(running_status(), failurePolicy={"backoffSeconds": 30}), [pod(1)]),
        SETTINGS,
    )
    assert counted.retry_after == 30.0 and not any(isinstance(a, Create) for a in counted.actions)
    assert counted.status is not None
    assert counted.status.stages[0].last_failure_time == "2026-11-22T10:00:00Z"
    later = decide(
        observed(
            manifest(to_manifest(counted.status), failurePolicy={"backoffSeconds": 30}),
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
    decision = decide(observed(manifest(status), [], nodes=nodes), SETTINGS)
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
    decision = decide(observed(manifest(status), [pod(0, "Failed"), pod(1)]), SETTINGS)
    assert summary(decision)[0] == "delete:j-stage-0" and events(decision) == []
    assert decision.restarts == 0
    assert decision.status is not None and decision.status.stages[0].restarts == 1


def test_counting_is_patched_before_the_delete_and_events_follow_the_count() -> None:
    decision = decide(observed(manifest(running_status()), [pod(0, "Failed"), pod(1)]), SETTINGS)
    assert decision.restarts == 1
    counted = patches(decision)[0]
    assert counted.stages[0].restarts == 1 and counted.stages[0].phase == REPLACING
    assert counted.restarts == 1
    assert events(decision)[0].message == (
        "Stage 0 pod j-stage-0 ended (Failed); replacing it (restart 1 of 2)."
    )


def test_a_pod_of_a_lost_node_in_grace_is_kept() -> None:
    nodes = [
        node("a100-0", "a100", ready=False, since="2026-11-22T09:59:50Z"),
        node("rtx-0", "rtx"),
    ]
    decision = decide(observed(manifest(running_status()), RUNNING, nodes=nodes), SETTINGS)
    assert summary(decision) == []


def test_a_kept_pod_reports_its_node_phase_and_pool() -> None:
    moved = pod(1, pool="h100", node_name="h100-0")
    decision = decide(observed(manifest(running_status()), [pod(0), moved]), SETTINGS)
    assert decision.status is not None
    assert decision.status.stages[1] == StageStatus(
        index=1, pod="j-stage-1", node="h100-0", pool="h100", phase="Running", ready=True
    )


def test_progress_is_folded_into_status() -> None:
    decision = decide(
        observed(manifest(running_status()), RUNNING, progress=progress(7, 5)), SETTINGS
    )
    assert decision.status is not None and decision.status.progress is not None
    assert (decision.status.progress.step, decision.status.progress.last_committed_step) == (7, 5)
    assert summary(decision) == ["patch"]


def test_completion_without_an_output_in_progress_uses_the_default_output() -> None:
    decision = decide(
        observed(manifest(running_status()), [pod(0, "Succeeded"), pod(1, "Succeeded")]), SETTINGS
    )
    assert decision.status is not None and decision.status.output is not None
    assert decision.status.output.uri == "s3://ckpt/runs/ns/j/output/"
    assert decision.status.completion_time == "2026-11-22T10:00:00Z"
    assert [s.pod for s in decision.status.stages] == [None, None]


def test_resuming_a_suspended_job_posts_no_second_suspended_event() -> None:
    suspended = decide(observed(manifest(running_status(), suspend=True), RUNNING), SETTINGS)
    assert suspended.status is not None
    again = decide(
        observed(manifest(to_manifest(suspended.status), suspend=True), [pod(0, deleting=True)]),
        SETTINGS,
    )
    assert summary(again) == []


def test_the_generation_and_transition_times_are_kept_in_status() -> None:
    decision = decide(observed(manifest(running_status()), [pod(0), pod(1, "Pending")]), SETTINGS)
    assert decision.status is not None
    assert decision.status.observed_generation == 4
    ready = condition(decision.status, READY)
    # Ready flipped True → False now; Progressing stayed True, its time stays.
    assert ready is not None and ready.last_transition_time == "2026-11-22T10:00:00Z"
    progressing = condition(decision.status, "Progressing")
    assert progressing is not None and progressing.last_transition_time == T_RUNNING


def test_a_decision_is_deterministic() -> None:
    obs = observed(manifest(running_status()), [pod(0, "Failed"), pod(1)])
    assert decide(obs, SETTINGS) == decide(replace(obs), SETTINGS)


@pytest.mark.parametrize(
    ("model", "settings", "message"),
    [
        (
            ModelConfig({"model_type": "llama"}),
            SETTINGS,
            "The model's config.json cannot be planned",
        ),
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
    decision = decide(observed(manifest(), model=model), settings)
    assert ready_reason(decision) == "Unschedulable"
    assert message in condition(decision.status, READY).message  # type: ignore[arg-type,union-attr]


def test_make_plan_refuses_training_settings_it_cannot_price() -> None:
    from relaytrain_operator.domain.planning import PlanError, make_plan
    from relaytrain_operator.spec import parse_job

    job = parse_job(manifest(method={"targetModules": ["lm_head"]}))
    with pytest.raises(PlanError, match="training settings cannot be planned"):
        make_plan(job, SMOLLM2_135M_CONFIG, NODES, [], default_link=(1000.0, 10.0))


# --- several pipelines -----------------------------------------------------------------

FLEET_SPEC: dict[str, Any] = {"pipeline": {"stages": 2, "replicas": 2}}


def run_pods(decision: Decision) -> list[dict[str, Any]]:
    """The stage pods `decision` created, bound to a node of their pool and Running."""
    free = {
        pool: [n["metadata"]["name"] for n in NODES if pool in n["metadata"]["name"]]
        for pool in PRODUCTS
    }
    out = []
    for action in decision.actions:
        if isinstance(action, Create) and action.obj["kind"] == "Pod":
            p = copy.deepcopy(action.obj)
            p["metadata"]["uid"] = f"uid-{p['metadata']['name']}"
            p["spec"]["nodeName"] = free[p["spec"]["nodeSelector"]["relaytrain.io/pool"]].pop()
            p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
            out.append(p)
    return out


def fleet() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job of two 2-stage pipelines on NODES' four GPUs, planned and running."""
    first = decide(observed(manifest(**FLEET_SPEC)), SETTINGS)
    assert first.status is not None
    pods = run_pods(first)
    running = decide(observed(manifest(to_manifest(first.status), **FLEET_SPEC), pods), SETTINGS)
    assert running.status is not None
    return manifest(to_manifest(running.status), **FLEET_SPEC), pods


def named(pods: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(p for p in pods if p["metadata"]["name"] == name)


def without(pods: list[dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    return [p for p in pods if p["metadata"]["name"] not in names]


def failed(p: dict[str, Any]) -> dict[str, Any]:
    p = copy.deepcopy(p)
    p["status"] = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]}
    return p


def test_several_pipelines_are_planned_named_and_wired_per_pipeline() -> None:
    decision = decide(observed(manifest(**FLEET_SPEC)), SETTINGS)
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
    assert env["RELAYTRAIN_LINK_CERT"]["valueFrom"]["secretKeyRef"]["key"] == "p1-s0.crt"
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
    job = manifest(to_manifest(status), **FLEET_SPEC)
    job["status"]["progress"] = {"step": 9, "lastCommittedStep": 5}
    successor = decide(observed(job, gone), SETTINGS)
    assert "create:j-p1-s0" in summary(successor)
    assert successor.status is not None
    assert successor.status.stages[2].restored_from_step is None
    # Once it runs, the fleet is whole again.
    back = run_pods(successor)
    whole = decide(
        observed(manifest(to_manifest(successor.status), **FLEET_SPEC), [*gone, *back]), SETTINGS
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
    # Later passes leave pipeline 1 alone and read nothing costly for it; they read what
    # the store tells the stages, and write it again only when it is not that.
    job = manifest(to_manifest(status), **FLEET_SPEC)
    alive = without(pods, "j-p1-s0", "j-p1-s1")
    assert needs(job, stage_pods(alive)) == Needs(progress=True, given_up=True)
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
    job = manifest(to_manifest(status), **FLEET_SPEC)
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


def test_a_lora_target_the_model_has_not_is_an_invalid_spec_not_a_full_fleet() -> None:
    # Expert weights on a dense model: only the model's config says so, at the first plan.
    job = manifest(method={"targetModules": ["experts.down_proj"]})
    decision = decide(observed(job), SETTINGS)
    assert decision.status is not None and decision.status.plan is None
    assert (decision.status.phase, ready_reason(decision)) == ("Failed", "InvalidSpec")
    assert "spec.method.targetModules" in condition(decision.status, READY).message  # type: ignore[union-attr]
    assert [e.reason for e in events(decision)] == ["InvalidSpec"]
    assert not [a for a in decision.actions if isinstance(a, Create | CreateLinkSecret)]


def test_periodic_sync_reaches_every_stage_of_every_pipeline() -> None:
    sync = {"mode": "periodic", "everySteps": 4}
    decision = decide(
        observed(manifest(pipeline={**FLEET_SPEC["pipeline"], "sync": sync})), SETTINGS
    )
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
    synchronous = decide(observed(manifest(**FLEET_SPEC)), SETTINGS)
    assert "sync" not in stage_document(synchronous, "j-p1-s0")["replicas"]


# --- Kueue (relaytrain_operator/domain/queueing.py) --------------------------------------------


QUEUE = {"kueue.x-k8s.io/queue-name": "team"}


def queued(
    status: dict[str, Any] | None = None, labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    job = manifest(status, **spec)
    job["metadata"]["labels"] = {**QUEUE, **(labels or {})}
    return job


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
    job = queued()
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
    job = queued(running_status(), labels={"kueue.x-k8s.io/priority-class": "high"})
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
    job = queued(running_status(*entries, plan={"stages": stages}), pipeline={"stages": 9})
    decision = decide(kobserved(job, []), SETTINGS)
    assert ready_reason(decision) == "InvalidSpec"
    assert "at most 8 pod sets" in str(condition(decision.status, READY))  # type: ignore[arg-type]


def test_a_queued_job_waits_for_quota_with_kueues_words_and_no_pod() -> None:
    job = queued(running_status())
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
    job = queued(to_manifest(waiting))
    decision = decide(kobserved(job, [], workload_of(job, *ADMITTED)), SETTINGS)
    first = created(decision, "j-stage-0")["spec"]
    assert first["nodeSelector"]["tier"] == "gold"
    assert first["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "tolerations" not in created(decision, "j-stage-1")["spec"]
    (admitted,) = [e for e in events(decision) if e.reason == "Admitted"]
    assert "a100 → fa" in admitted.message and "rtx → fr" in admitted.message
    # Running already: admitted again is no news.
    again = decide(
        kobserved(queued(running_status()), RUNNING, workload_of(job, *ADMITTED)), SETTINGS
    )
    assert [e for e in events(again) if e.reason == "Admitted"] == []


def test_a_queued_replacement_stays_on_the_pool_it_was_admitted_on() -> None:
    job = queued(
        running_status(
            stage(0), stage(1, restarts=1, phase=REPLACING, pod=None, node=None, ready=False)
        )
    )
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

    job = queued(running_status())
    workload = workload_of(job, *EVICTED)
    stopping = decide(kobserved(job, RUNNING, workload), SETTINGS)
    assert sorted(s for s in summary(stopping) if s.startswith("delete")) == [
        "delete:j-stage-0",
        "delete:j-stage-1",
    ]
    assert applied(stopping) == []  # the pods still hold their GPUs
    assert ready_reason(stopping) == "Evicted"
    assert "Preempted" in str(condition(stopping.status, READY))  # type: ignore[arg-type]
    gone = decide(kobserved(queued(to_manifest(stopping.status)), [], workload), SETTINGS)  # type: ignore[arg-type]
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
    waiting = decide(kobserved(queued(to_manifest(gone.status)), [], released), SETTINGS)  # type: ignore[arg-type]
    assert applied(waiting) == [] and ready_reason(waiting) == "Evicted"


def test_suspend_deactivates_the_workload_and_resume_activates_it() -> None:
    from relaytrain_operator.loop.actions import PatchWorkload

    job = queued(running_status(), suspend=True)
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
    resumed = queued(running_status())
    back = decide(kobserved(resumed, [], workload_of(resumed, *PENDING, active=False)), SETTINGS)
    assert [a.patch for a in back.actions if isinstance(a, PatchWorkload)] == [
        {"spec": {"active": True}}
    ]


def test_a_finished_job_marks_its_workload_finished_before_its_own_status() -> None:
    from relaytrain_operator.domain.queueing import FINISHED_MANAGER

    job = queued(running_status())
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
    exhausted = queued(running_status(stage(0), stage(1, restarts=2)))
    failed = decide(
        kobserved(
            exhausted, [pod(0), pod(1, "Failed", incarnation=2)], workload_of(job, *ADMITTED)
        ),
        SETTINGS,
    )
    assert [a.body["status"]["conditions"][0]["reason"] for a in applied(failed)] == ["Failed"]
