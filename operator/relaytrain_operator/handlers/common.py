"""What every handler does with a reconciliation: run it and post its Events."""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf

from relaytrain_operator.reconcile import Reconciler

logger = logging.getLogger(__name__)


def reconcile(memo: Any, namespace: str | None, name: str) -> str | None:
    """Reconcile one job and post the Events it produced; the job's phase after it."""
    reconciler: Reconciler = memo.reconciler
    if namespace is None:  # FineTuneJobs and pods are namespaced; never happens
        return None
    outcome = reconciler.reconcile(namespace, name)
    if outcome.job is not None:
        for event in outcome.events:
            kopf.event(
                kopf.Body(cast(kopf.RawBody, outcome.job)),
                type=event.type,
                reason=event.reason,
                message=event.message,
            )
            if event.type == "Warning":
                logger.warning(
                    "FineTuneJob %s/%s: %s: %s", namespace, name, event.reason, event.message
                )
    return outcome.phase
