"""The operator's Prometheus metrics: jobs by phase, stage restarts, passes by job, reconcile
errors/latency.

Served by prometheus-client's own HTTP server (started in the startup handler) on the
port given by `--metrics-port`; 0 turns it off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prometheus_client import Counter, Gauge, Histogram, start_http_server

PHASES = ("Pending", "Planning", "Running", "Recovering", "Succeeded", "Failed", "Suspended")

JOBS = Gauge("relaytrain_jobs", "FineTuneJobs this operator sees, by phase.", ["phase"])
STAGE_RESTARTS = Counter(
    "relaytrain_stage_restarts_total", "Stage pods replaced after a failure.", ["namespace"]
)
PIPELINE_CHANGES = Counter(
    "relaytrain_pipeline_changes_total",
    "Pipelines that left a running job (their node announced its end), were given up, came "
    "back, were added on GPUs that joined, or were re-split for the GPUs free.",
    ["namespace", "change"],
)
CHANGES = {
    "PipelineLeaving": "left",
    "PipelineFailed": "given_up",
    "PipelineAdded": "returned",
    "Replanned": "replanned",
}
"""The Events that say a job's pipelines changed, by the `change` label they count under (a
PipelineAdded Event of a pipeline the plan did not have says `added` itself: PostEvent.change)."""
RECONCILE_ERRORS = Counter(
    "relaytrain_reconcile_errors_total", "Reconciliations that raised an unexpected error."
)
RECONCILE_PASSES = Counter(
    "relaytrain_reconcile_passes_total",
    "Reconciliations of one job (periodic, rung or retried); the series goes with the job.",
    ["namespace", "finetunejob"],
)
RECONCILE_SECONDS = Histogram(
    "relaytrain_reconcile_duration_seconds",
    "Wall time of one reconciliation of one job.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

# The phase of every job last reconciled, so the gauge counts jobs, not transitions.
# It is a view of the cluster for reporting only; nothing decides from it.
_phases: dict[tuple[str, str], str] = {}
_lock = threading.Lock()


def _publish() -> None:
    counts = dict.fromkeys(PHASES, 0)
    for phase in _phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase, count in counts.items():
        JOBS.labels(phase=phase).set(count)


def record_phase(namespace: str, name: str, phase: str | None) -> None:
    """Remember a job's phase (None: the job is gone) and update the gauge."""
    with _lock:
        if phase is None:
            _phases.pop((namespace, name), None)
            with suppress(KeyError):  # no pass of it was counted
                RECONCILE_PASSES.remove(namespace, name)
        else:
            _phases[(namespace, name)] = phase
        _publish()


@contextmanager
def timed_reconcile(namespace: str, name: str) -> Iterator[None]:
    """Time one reconciliation of the job `namespace/name` and count it once it is over;
    count it as an error too if it raises."""
    start = time.perf_counter()
    try:
        yield
    except Exception:
        RECONCILE_ERRORS.inc()
        raise
    finally:
        RECONCILE_SECONDS.observe(time.perf_counter() - start)
        RECONCILE_PASSES.labels(namespace=namespace, finetunejob=name).inc()


def serve(port: int) -> None:
    """Start the /metrics endpoint in a daemon thread (port 0: do nothing)."""
    if port:
        start_http_server(port)
