"""`relaytrain run --local`'s supervisor without processes: the failure policy it shares
with the operator, its per-job state directory and the lock that refuses a second run."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from relaytrain_operator.local_run import AlreadyRunning, default_workdir, lock_workdir
from relaytrain_operator.recovery import after_failure, backoff_left
from relaytrain_operator.spec import FineTuneJob, parse_job

from tests.unit.test_spec_invalid import base_manifest

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 23, 15, 0, tzinfo=UTC)


def _job(name: str, namespace: str | None = None) -> FineTuneJob:
    manifest = base_manifest(name)
    if namespace is not None:
        manifest["metadata"]["namespace"] = namespace
    return parse_job(manifest)


def test_the_failure_policy_counts_each_failure_until_it_allows_no_more() -> None:
    assert after_failure(0, 2) == 1
    assert after_failure(1, 2) == 2
    assert after_failure(2, 2) is None  # maxStageRestarts used up: the job fails
    assert after_failure(0, 0) is None


def test_the_back_off_runs_from_the_counted_failure() -> None:
    backoff = timedelta(seconds=30)
    assert backoff_left(0, None, NOW, backoff) == timedelta(0)  # a first start never waits
    assert backoff_left(1, NOW, NOW, timedelta(0)) == timedelta(0)
    assert backoff_left(1, NOW - timedelta(seconds=10), NOW, backoff) == timedelta(seconds=20)
    assert backoff_left(1, NOW - timedelta(seconds=31), NOW, backoff) == timedelta(0)
    assert backoff_left(1, None, NOW, backoff) == backoff  # failure time unknown: all of it


def test_each_job_gets_its_own_state_directory() -> None:
    dirs = {default_workdir(_job(n, ns)) for n, ns in [("a", None), ("b", None), ("a", "team")]}
    assert dirs == {
        Path("relaytrain-local/default/a"),
        Path("relaytrain-local/default/b"),
        Path("relaytrain-local/team/a"),
    }


def test_a_held_state_directory_refuses_a_second_run_naming_the_holder(tmp_path: Path) -> None:
    job = _job("busy")
    held = lock_workdir(tmp_path / "wd", job)
    try:
        assert (tmp_path / "wd" / "run.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(AlreadyRunning) as refused:
            lock_workdir(tmp_path / "wd", job)
        assert str(refused.value) == (
            f"job default/busy is already running in {tmp_path / 'wd'} (PID {os.getpid()}); "
            "stop that run first or give another --workdir"
        )
        os.close(lock_workdir(tmp_path / "other", job))  # another directory, another run
    finally:
        os.close(held)
    os.close(lock_workdir(tmp_path / "wd", job))  # released with its holder
