"""Stage pod watch: a stage pod that failed, ended or is going away rings its job's loop,
so the job is reconciled at once instead of at the next periodic check."""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.loop.handlers.filters import served
from relaytrain_operator.loop.runner import Runner


def _ending(type: str, body: kopf.Body, **kwargs: Any) -> bool:
    return served(**kwargs) and (
        type == "DELETED"
        or body.status.get("phase") in ("Failed", "Succeeded")
        or body.metadata.get("deletionTimestamp") is not None
    )


@kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT}, when=_ending)
async def stage_pod_event(
    *, namespace: str | None, labels: kopf.Labels, memo: Any, **_: Any
) -> None:
    runner: Runner = memo.runner
    runner.ring(namespace or "", labels[JOB_LABEL])
