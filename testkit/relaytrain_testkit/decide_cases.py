"""The world of the operator's reconcile decision, as its tests build it: a FineTuneJob and
its stored status, the nodes of three GPU pools, stage pods, the plan, the settings, and what
the observer would hand `decide` (tests/unit/test_operator_decide.py and the tests that reuse
its job and pods: the runner's, the planner families', the executor's against a cluster)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from relaytrain_operator.domain.progress import Progress
from relaytrain_operator.domain.recovery import INCARNATION_ANNOTATION
from relaytrain_operator.domain.status import load_status, to_manifest
from relaytrain_operator.loop.actions import PostEvent
from relaytrain_operator.loop.decide import (
    Decision,
    InputProblem,
    ModelConfig,
    Needs,
    Observed,
    Settings,
    needs,
    stage_pods,
)

from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

NOW = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
"""The time of every decision here, unless a test says otherwise."""
T_RUNNING = "2026-11-22T09:00:00Z"
"""When the running status's conditions last changed."""
GIB = 1024**3
SETTINGS = Settings(node_lost_seconds=30, worker_image="img:1", default_link=(1000.0, 10.0))
"""The operator's settings."""
PRODUCTS: dict[str, tuple[str, int]] = {
    "a100": ("NVIDIA-A100-SXM4-40GB", 40960),
    "rtx": ("NVIDIA-GeForce-RTX-4090", 24564),
    "h100": ("NVIDIA-H100-80GB-HBM3", 81559),
}
"""Pool → (the GPU product label, its memory in MiB)."""
PLAN: dict[str, Any] = {
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
"""The stored plan: stage 0 on an a100, stage 1 on an rtx."""


JOB = (
    Job("j", "ns")
    .uid("job-uid")
    .generation(4)
    .model("s3://models/smol/")
    .dataset("s3://data/train.jsonl", sequence_length=256)
    .training(steps=100, micro_batch_size=1, micro_batches=8)
    .pipeline(stages=2)
    .checkpoint("s3://ckpt/runs", endpoint="http://minio:9000")
    .credentials("s3")
    .failure_policy(max_stage_restarts=2, backoff_seconds=0)
)
"""The job decided on: `j` in `ns`, generation 4, two stages, checkpoints in MinIO, two
restarts a stage without back-off; `.status(...)` gives it the status a pass left."""


def node(
    name: str,
    pool: str,
    *,
    ready: bool = True,
    zone: str = "a",
    gpus: int = 1,
    since: str = "2026-11-22T09:59:00Z",
) -> dict[str, Any]:
    """A GPU node of `pool`, labelled as GPU feature discovery labels one."""
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
"""The cluster's nodes: two a100s and an rtx in zone a, an h100 in zone b."""


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
    exit_code: int | None = None,
    message: str | None = None,
    waiting: tuple[str, str] | None = None,
    image: str | None = None,
) -> dict[str, Any]:
    """Stage `k`'s pod of job `job`, on its plan's node unless `node_name` says otherwise;
    with `exit_code`, its container ended so (and left `message` as its termination
    message); with `waiting` (the kubelet's reason and message), its container waits so;
    with `image`, its worker container runs that image."""
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
    if exit_code is not None:
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Error"}
        if message is not None:
            terminated["message"] = message
        status["containerStatuses"] = [{"name": "worker", "state": {"terminated": terminated}}]
    if waiting is not None:
        state = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
        status["containerStatuses"] = [{"name": "worker", "image": "w:1", "state": state}]
    default_node = {0: "a100-0", 1: "rtx-0"}.get(k)
    return {
        "metadata": meta,
        "spec": {
            "nodeName": node_name if node_name is not None else default_node,
            "containers": [
                {
                    "name": "worker",
                    "resources": {"requests": {"nvidia.com/gpu": "1"}},
                    **({"image": image} if image else {}),
                }
            ],
        },
        "status": status,
    }


def unbound(p: dict[str, Any]) -> dict[str, Any]:
    """A copy of the pod `p` not bound to a node."""
    p = copy.deepcopy(p)
    p["spec"]["nodeName"] = None
    return p


def stage(k: int, **fields: Any) -> dict[str, Any]:
    """Stage `k`'s entry of a running status (`fields` replace its fields; None drops one)."""
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
    inputs: InputProblem | None = None,
    link_secret: dict[str, Any] | None = None,
) -> Observed:
    """What the observer would hand over: it reads what `needs` asks for."""
    by_stage = stage_pods(pods)
    nodes = NODES if nodes is None else nodes
    wanted = needs(job, by_stage, now) if job is not None else Needs()
    return Observed(
        job=job,
        now=now,
        pods=by_stage,
        nodes={n["metadata"]["name"]: n for n in nodes},
        cluster_pods=(list(pods) if cluster_pods is None else cluster_pods)
        if wanted.room
        else None,
        model=(model or ModelConfig(SMOLLM2_135M_CONFIG)) if wanted.model else None,
        inputs=inputs if wanted.inputs else None,
        progress=progress if wanted.progress else None,
        link_secret=link_secret if wanted.link_secret else None,
    )


def events(decision: Decision) -> list[PostEvent]:
    """The events `decision` posts, in order."""
    return [a for a in decision.actions if isinstance(a, PostEvent)]
