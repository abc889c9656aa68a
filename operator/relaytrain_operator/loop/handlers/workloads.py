"""Kueue Workload watch (imported only with `--kueue`): a change of a job's Workload — Kueue
admitted it, evicted it, or its quota is pending — rings the job's loop, so the job starts or
stops at once instead of at the next periodic check."""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.domain.queueing import GROUP, PLURAL, VERSION
from relaytrain_operator.loop.handlers.filters import served
from relaytrain_operator.loop.runner import Runner


@kopf.on.event(GROUP, VERSION, PLURAL, labels={JOB_LABEL: kopf.PRESENT}, when=served)
async def workload_event(
    *, namespace: str | None, labels: kopf.Labels, memo: Any, **_: Any
) -> None:
    runner: Runner = memo.runner
    runner.ring(namespace or "", labels[JOB_LABEL])
