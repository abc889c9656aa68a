"""Which pipelines of a running job leave and which come back, decided from the nodes and
the job's record (docs/operator.md, "The job follows the fleet").

- **Leaving.** A node that announces its own end — cordoned (a drain, maintenance), or
  tainted by the cluster autoscaler's scale-down, Karpenter's disruption, a cloud's spot
  or preemption notice, or the out-of-service taint — is a planned departure, not a crash:
  every pipeline with a stage on it leaves (`departure`). Its pods go without counting a
  failure, and the other pipelines train on.
- **Coming back.** A pipeline out of the job — left, or given up once a stage used up
  `maxStageRestarts` — comes back when every one of its stages fits on a free GPU of an
  eligible node (the placement of replacements decides, so a pool that is gone is
  replaced by another whose memory fits), when its wait is over (`return_wait`), and when
  the job has enough left to pay for the join (`worth_returning`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from relaytrain_operator.domain.planner.growth import JOIN_SECONDS
from relaytrain_operator.domain.status import parse_time
from relaytrain_operator.spec import FailurePolicy, PipelineStatus

DEPARTURE_TAINTS: dict[str, str] = {
    "ToBeDeletedByClusterAutoscaler": "the cluster autoscaler is removing it",
    "karpenter.sh/disrupted": "Karpenter is disrupting it",
    "karpenter.sh/disruption": "Karpenter is disrupting it",
    "cloud.google.com/impending-node-termination": "its spot or preemptible VM ends soon",
    "aws-node-termination-handler/spot-itn": "its spot instance is being reclaimed",
    "aws-node-termination-handler/scheduled-maintenance": "it has scheduled maintenance",
    "aws-node-termination-handler/asg-lifecycle-termination": "its auto-scaling group ends it",
    "node.kubernetes.io/out-of-service": "it is out of service",
    "node.cloudprovider.kubernetes.io/shutdown": "its cloud provider shut it down",
}
"""Taints that announce a node's end, by key, with why in words. Any effect counts: a
scale-down taint is NoSchedule, the out-of-service one NoExecute."""

MAX_DOUBLINGS = 6
"""A pipeline given up again and again waits at most 2**6 times returnAfterSeconds."""


def departure(node: Mapping[str, Any] | None) -> str | None:
    """Why `node` is going away, in words ("node n1 is cordoned..."), or None when it has
    announced no end (a node already gone is a crash: recovery's, not this)."""
    if node is None:
        return None
    name = (node.get("metadata") or {}).get("name", "?")
    spec = node.get("spec") or {}
    for taint in spec.get("taints") or []:
        why = DEPARTURE_TAINTS.get(str(taint.get("key")))
        if why is not None:
            return f"node {name} has the taint {taint.get('key')}: {why}"
    if spec.get("unschedulable"):
        return f"node {name} is cordoned (a drain or maintenance)"
    return None


def return_wait(pipeline: PipelineStatus, policy: FailurePolicy, now: datetime) -> timedelta | None:
    """How long pipeline `pipeline`, out of the job, still waits before it may come back:
    zero when it may now, None when never (given up, with returnAfterSeconds 0).

    A pipeline that left with its node may come back at once on other GPUs (the node that
    announced its end is not eligible any more). One given up waits returnAfterSeconds,
    doubled for each return it has had (up to 2**MAX_DOUBLINGS), counted from when it was
    given up: a pipeline whose stages fail wherever they run costs the others little."""
    if pipeline.phase == "Left":
        return timedelta(0)
    if policy.return_after_seconds == 0:
        return None
    wait = timedelta(
        seconds=policy.return_after_seconds * 2 ** min(pipeline.returns, MAX_DOUBLINGS)
    )
    since = parse_time(pipeline.left_time)
    if since is None:
        return wait  # given up before the time was recorded: counts from this pass
    return max(timedelta(0), since + wait - now)


def worth_returning(
    eta: datetime | None, now: datetime, join_seconds: float = JOIN_SECONDS
) -> bool:
    """Whether a pipeline joining now pays: its stages load the model and take a peer's
    state before they add anything (`join_seconds`: the operator's --join-seconds, by
    default planner.growth.JOIN_SECONDS, 120 s), so a job whose estimated end is nearer
    than that finishes without it. Unknown: it pays."""
    return eta is None or eta - now > timedelta(seconds=join_seconds)
