"""When a (re)joining stage may conclude that the others finished the job and exit 0
(`stage.job_finished`, read by its watchdog while it waits for peers that may be gone)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from relaytrain_contract import Progress
from relaytrain_worker.replicas.membership import job_finished

pytestmark = pytest.mark.unit

STARTED = datetime(2026, 11, 23, 22, 51, 12, tzinfo=UTC)


def record(step: int, total: int, *, done: bool, at: datetime | None) -> Progress:
    return Progress(step=step, totalSteps=total, tokensPerSecond=1.0, done=done, updatedAt=at)


def test_a_job_done_after_the_stage_started_is_finished() -> None:
    later = STARTED + timedelta(seconds=3)
    assert job_finished(record(80, 80, done=True, at=later), STARTED, 80)
    assert job_finished(record(80, 80, done=True, at=STARTED), STARTED, 80)


def test_a_replacement_started_just_after_the_job_ended_finds_it_finished() -> None:
    # The others wrote the job's last step 3 s before this replacement began: without this
    # rule it waited forever for peers that had exited.
    earlier = STARTED - timedelta(seconds=3)
    assert job_finished(record(80, 80, done=True, at=earlier), STARTED, 80)


def test_an_older_record_of_another_length_or_one_not_done_is_not_finished() -> None:
    earlier = STARTED - timedelta(seconds=3)
    # A run of 40 steps that was done before this job's steps were raised to 80.
    assert not job_finished(record(40, 40, done=True, at=earlier), STARTED, 80)
    assert not job_finished(record(80, 80, done=False, at=STARTED), STARTED, 80)
    assert not job_finished(None, STARTED, 80)
