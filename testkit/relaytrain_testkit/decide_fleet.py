"""A job of several pipelines for the decision's tests: planned on `decide_cases.NODES`,
its pods bound and Running, and the small edits the tests make to its pods."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

from relaytrain_operator.domain.status import to_manifest
from relaytrain_operator.loop.actions import Create
from relaytrain_operator.loop.decide import WAITING_ANNOTATION, Decision, ModelConfig, decide

from relaytrain_testkit import REPO
from relaytrain_testkit.decide_cases import JOB, NODES, NOW, PRODUCTS, SETTINGS, node, observed
from relaytrain_testkit.jobs import Job

FLEET = JOB.pipeline(stages=2, replicas=2)
"""The job as two pipelines of two stages."""
LLAMA_8B = ModelConfig(
    json.loads((REPO / "operator/relaytrain_operator/known_models/llama-3.1-8b.json").read_text())
)
"""Llama-3.1-8B's config: a model whose pipelines' adapters cost a slow link something."""

AUTO_STEPS = 1000
AUTO_8B = (
    JOB.dataset("s3://data/train.jsonl", sequence_length=2048)
    .training(steps=AUTO_STEPS, micro_batch_size=1, micro_batches=64)
    .pipeline(stages=1, replicas="auto")
)
"""Llama-3.1-8B (`LLAMA_8B`), 64 micro-batches a step, `AUTO_STEPS` steps: `auto` plans a
pipeline of one stage on each of NODES' H100 and A100s (the growth tests' job)."""


def far_a100(mbps: int) -> dict[str, Any]:
    """An A100 of its own pool, `far`, behind a link of `mbps` megabits per second."""
    far = node("far-0", "a100")
    far["metadata"]["labels"]["relaytrain.io/pool"] = "far"
    far["metadata"]["annotations"] = {
        "relaytrain.io/link-bandwidth-mbps": str(mbps),
        "relaytrain.io/link-latency-ms": "40",
    }
    return far


def run_pods(decision: Decision, nodes: list[dict[str, Any]] = NODES) -> list[dict[str, Any]]:
    """The stage pods `decision` created, bound to a node of their pool (of `nodes`) and
    Running."""
    free = {
        pool: [n["metadata"]["name"] for n in nodes if pool in n["metadata"]["name"]]
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


def fleet(
    job: Job = FLEET, model: ModelConfig | None = None, nodes: list[dict[str, Any]] = NODES
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`job` (by default two 2-stage pipelines) planned on the GPUs of `nodes` and running,
    with `model`'s config (None: SmolLM2-135M's)."""
    first = decide(observed(job.build(), nodes=nodes, model=model), SETTINGS)
    assert first.status is not None
    pods = run_pods(first, nodes)
    running = decide(
        observed(job.status(to_manifest(first.status)).build(), pods, nodes=nodes), SETTINGS
    )
    assert running.status is not None
    return job.status(to_manifest(running.status)).build(), pods


def named(pods: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The pod called `name`."""
    return next(p for p in pods if p["metadata"]["name"] == name)


def without(pods: list[dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    """`pods` less those called `names`."""
    return [p for p in pods if p["metadata"]["name"] not in names]


def failed(p: dict[str, Any]) -> dict[str, Any]:
    """A copy of pod `p`, Failed."""
    p = copy.deepcopy(p)
    p["status"] = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]}
    return p


def replacement_waiting(
    job: dict[str, Any], pods: list[dict[str, Any]], pipeline: int, pool: str
) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """Pipeline `pipeline`'s one-stage pod lost with its node: its replacement (restart 1),
    created on the full pool `pool` and waiting there, unscheduled, as the pass marks it,
    and `job`'s record saying so (changed in place). Returns the waiting pod, the other
    pods, and the lost node's name."""
    name = f"j-p{pipeline}-s0"
    gone = next(p for p in pods if p["metadata"]["name"] == name)
    waiting = copy.deepcopy(gone)
    waiting["metadata"]["annotations"][WAITING_ANNOTATION] = f"waits for a GPU on pool {pool}"
    waiting["metadata"]["annotations"]["relaytrain.io/incarnation"] = "1"
    waiting["metadata"]["uid"] = f"uid-{name}-1"
    waiting["spec"]["nodeName"] = None
    waiting["status"] = {"phase": "Pending"}
    entry = next(s for s in job["status"]["stages"] if s.get("pipeline") == pipeline)
    entry.update(restarts=1, phase="Pending", ready=False, node=None, lastFailure="NodeLost")
    job["status"]["pipelines"][pipeline]["phase"] = "Recovering"
    others = [p for p in pods if p["metadata"]["name"] != name]
    return waiting, others, str(gone["spec"]["nodeName"])


def aged(pods: list[dict[str, Any]], name: str, seconds: float) -> list[dict[str, Any]]:
    """A copy of `pods` where pod `name` was created `seconds` before NOW."""
    stamped = copy.deepcopy(pods)
    for p in stamped:
        if p["metadata"]["name"] == name:
            p["metadata"]["creationTimestamp"] = (
                (NOW - timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")
            )
    return stamped
