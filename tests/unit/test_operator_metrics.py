"""The operator's per-job pass counter: what tests (and users) wait on to know that the
operator looked at a job again."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from relaytrain_operator.loop import metrics

pytestmark = pytest.mark.unit


def passes(namespace: str, name: str) -> float | None:
    labels = {"namespace": namespace, "finetunejob": name}
    return REGISTRY.get_sample_value("relaytrain_reconcile_passes_total", labels)


def test_each_pass_of_a_job_is_counted_once_it_is_over_failed_ones_too() -> None:
    with metrics.timed_reconcile("metrics-ns", "a"):
        assert passes("metrics-ns", "a") is None  # not before the pass is over
    with pytest.raises(RuntimeError), metrics.timed_reconcile("metrics-ns", "a"):
        raise RuntimeError("the API server went away")
    with metrics.timed_reconcile("metrics-ns", "b"):
        pass
    assert (passes("metrics-ns", "a"), passes("metrics-ns", "b")) == (2, 1)


def test_a_deleted_job_takes_its_series_with_it() -> None:
    with metrics.timed_reconcile("metrics-ns", "gone"):
        pass
    metrics.record_phase("metrics-ns", "gone", "Running")
    metrics.record_phase("metrics-ns", "gone", None)
    assert passes("metrics-ns", "gone") is None
    metrics.record_phase("metrics-ns", "never-passed", None)  # no series: no error
