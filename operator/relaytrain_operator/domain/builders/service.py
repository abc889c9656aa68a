"""The job's headless Service: it gives every stage pod a stable DNS name."""

from __future__ import annotations

from typing import Any

from relaytrain_contract import LINK_PORT, METRICS_PORT

from relaytrain_operator.domain.builders.labels import (
    JOB_LABEL,
    child_metadata,
)


def build_service(job: dict[str, Any]) -> dict[str, Any]:
    """A headless Service named like the job, selecting the job's stage pods.

    With pod `hostname: <job>-stage-<k>` and `subdomain: <job>`, stage k resolves at
    `<job>-stage-<k>.<job>.<namespace>.svc`. Not-ready addresses are published because a
    stage must reach its neighbour while both are still starting (neither is "ready"
    until the pipeline links up).
    """
    name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, name),
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: name},
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "link", "port": LINK_PORT, "targetPort": LINK_PORT, "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": METRICS_PORT,
                    "targetPort": METRICS_PORT,
                    "protocol": "TCP",
                },
            ],
        },
    }
