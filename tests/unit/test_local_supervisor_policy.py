"""`relaytrain run --local`'s supervisor without stage processes: the failure policy it
shares with the operator, its per-job state directory, the lock that refuses a second run,
and how a stage process dies with it (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from relaytrain_operator.cli.local_run import (
    AlreadyRunning,
    default_workdir,
    die_with_supervisor,
    lock_workdir,
)
from relaytrain_operator.domain.recovery import after_failure, backoff_left
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 23, 15, 0, tzinfo=UTC)


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
    jobs = [Job("a"), Job("b"), Job("a", "team")]
    dirs = {default_workdir(parse_job(job.build())) for job in jobs}
    assert dirs == {
        Path("relaytrain-local/default/a"),
        Path("relaytrain-local/default/b"),
        Path("relaytrain-local/team/a"),
    }


def test_a_held_state_directory_refuses_a_second_run_naming_the_holder(tmp_path: Path) -> None:
    job = parse_job(Job("busy").build())
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


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="PR_SET_PDEATHSIG is a Linux prctl; elsewhere die_with_supervisor does nothing",
)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has died


@linux_only
def test_a_stage_dies_when_its_supervisor_is_killed() -> None:
    # A stand-in supervisor starts a stand-in stage as local_run starts one (own session,
    # die_with_supervisor), says its PID, and is then killed with SIGKILL.
    with subprocess.Popen(
        [sys.executable, "-c", (
            "import os, subprocess, sys, time\n"
            "from relaytrain_operator.cli.local_run import die_with_supervisor\n"
            "stage = subprocess.Popen(['sleep', '600'], start_new_session=True,\n"
            "                         preexec_fn=die_with_supervisor(os.getpid()))\n"
            "print(stage.pid, flush=True)\n"
            "time.sleep(600)\n"
        )],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE, text=True,
    ) as supervisor:  # fmt: skip
        assert supervisor.stdout is not None
        stage = int(supervisor.stdout.readline())
        assert _running(stage)
        supervisor.kill()
    deadline = time.monotonic() + 10
    while _running(stage) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running(stage)


@linux_only
def test_a_stage_started_as_its_supervisor_dies_never_runs() -> None:
    # The supervisor died between fork and prctl: the child's parent is no longer the one
    # it was started by (here: never was), and it kills itself before exec.
    other = os.getppid()
    stage = subprocess.Popen(
        ["sleep", "600"],
        start_new_session=True,
        preexec_fn=die_with_supervisor(other),  # noqa: PLW1509 - as local_run starts a stage
    )
    assert stage.wait(timeout=10) == -signal.SIGKILL
    with_us = subprocess.Popen(
        ["sleep", "600"],
        start_new_session=True,
        preexec_fn=die_with_supervisor(os.getpid()),  # noqa: PLW1509 - as local_run does
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            with_us.wait(timeout=0.5)  # its parent is the one it names: it runs
    finally:
        with_us.kill()
        with_us.wait()
