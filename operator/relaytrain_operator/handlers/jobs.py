"""FineTuneJob handlers: edges (create, resume, update) and the periodic level check."""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator import options
from relaytrain_operator.handlers.common import reconcile
from relaytrain_operator.reconcile import Reconciler

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def job_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    reconcile(memo, namespace, name)


@kopf.timer(GROUP, VERSION, PLURAL, interval=options.current().resync_seconds, sharp=False)
def job_check(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    reconcile(memo, namespace, name)


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_event(type: str, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    if type == "DELETED":
        reconciler: Reconciler = memo.reconciler
        reconciler.forget(namespace or "", name)
