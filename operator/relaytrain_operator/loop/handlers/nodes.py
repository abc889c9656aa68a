"""Node watch: a node that announces its end rings the jobs with a stage pod on it, and a
node that joins the cluster rings every job, so that a pipeline leaves or comes back at
once instead of at the next periodic check (domain/membership.py). A node made schedulable
again, or GPUs freed by other jobs, are found by that periodic check."""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator.domain.membership import departure
from relaytrain_operator.loop.runner import Runner


@kopf.on.event("nodes")
async def node_event(*, type: str, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    runner: Runner = memo.runner
    pod_index: kopf.Index[Any, Any] = kwargs["pod_index"]
    if type == "ADDED":
        runner.ring_all()
        return
    if departure(body) is None:
        return
    name = body.metadata.name
    for (namespace, job), pods in list(pod_index.items()):
        if any((pod.get("spec") or {}).get("nodeName") == name for pod in pods):
            runner.ring(namespace, job)
