"""Stage pod watch: a stage pod that failed or is going away triggers its job's pass at
once, instead of at the next periodic check."""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator.builders.labels import JOB_LABEL
from relaytrain_operator.handlers.common import reconcile


def _ending(type: str, body: kopf.Body) -> bool:
    return (
        type == "DELETED"
        or body.status.get("phase") in ("Failed", "Succeeded")
        or body.metadata.get("deletionTimestamp") is not None
    )


@kopf.on.event("pods", labels={JOB_LABEL: kopf.PRESENT})
def stage_pod_event(
    type: str,
    body: kopf.Body,
    namespace: str | None,
    labels: kopf.Labels,
    memo: Any,
    **_: Any,
) -> None:
    if _ending(type, body):
        reconcile(memo, namespace, labels[JOB_LABEL])
