"""FineTuneJob handlers: one daemon per unfinished job, and its doorbell.

The daemon runs the job's reconcile loop (`Runner.run`); kopf starts it when the job
appears (or the operator starts), and stops it when the job is deleted or finishes — a
Succeeded or BackoffLimitExceeded job matches no filter and costs nothing. The event
handler rings the loop when the spec changes and keeps the phase gauge.
"""

from __future__ import annotations

from typing import Any

import kopf

from relaytrain_operator.domain.status import is_finished
from relaytrain_operator.loop import metrics
from relaytrain_operator.loop.handlers.filters import served
from relaytrain_operator.loop.runner import Runner

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"


def _unfinished(status: kopf.Status, **kwargs: Any) -> bool:
    return served(**kwargs) and not is_finished(status)


# kopf hands its indexes over as keyword arguments named after them, which its DaemonFn
# protocol cannot list.
@kopf.daemon(GROUP, VERSION, PLURAL, when=_unfinished, cancellation_timeout=60)  # type: ignore[arg-type]
async def job_daemon(
    *,
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    memo: Any,
    node_index: kopf.Index[str, Any],
    pod_index: kopf.Index[tuple[str, str], Any],
    **_: Any,
) -> None:
    runner: Runner = memo.runner
    namespace = namespace or ""  # FineTuneJobs are namespaced
    try:
        await runner.run(namespace, name, stopped, node_index, pod_index)
    except Exception as err:
        # Any failure of a pass: kopf runs the daemon again after the delay, and the next
        # pass starts from what the cluster holds.
        raise kopf.TemporaryError(
            f"Reconciling FineTuneJob {namespace}/{name} failed: {err}",
            delay=runner.options.resync_seconds,
        ) from err


@kopf.on.event(GROUP, VERSION, PLURAL, when=served)
async def job_event(
    *,
    type: str,
    namespace: str | None,
    name: str,
    meta: kopf.Meta,
    status: kopf.Status,
    memo: Any,
    **_: Any,
) -> None:
    namespace = namespace or ""
    if type == "DELETED":
        metrics.record_phase(namespace, name, None)
        return
    metrics.record_phase(namespace, name, status.get("phase"))
    runner: Runner = memo.runner
    runner.ring(namespace, name, generation=meta.get("generation"))
