"""Status computation: phase, conditions, printer fields, progress, and minimal patches."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from relaytrain_operator.progress import fold
from relaytrain_operator.recovery import REPLACING
from relaytrain_operator.spec import parse_job
from relaytrain_operator.status import (
    Verdict,
    changes,
    finalize,
    is_terminal,
    running_verdict,
    with_verdict,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)


def stages(*phases: str, restarts: tuple[int, ...] = ()) -> list[dict[str, object]]:
    restarts = restarts or (0,) * len(phases)
    return [
        {"index": k, "phase": p, "restarts": r, "ready": p == "Running"}
        for k, (p, r) in enumerate(zip(phases, restarts, strict=True))
    ]


def test_all_stages_running_is_ready() -> None:
    verdict = running_verdict(stages("Running", "Running"))
    assert (verdict.phase, verdict.ready, verdict.progressing) == ("Running", True, True)


def test_a_stage_being_replaced_makes_the_job_recovering() -> None:
    verdict = running_verdict(stages("Running", REPLACING, restarts=(0, 1)))
    assert (verdict.phase, verdict.ready, verdict.reason) == (
        "Recovering",
        False,
        "StageRestarting",
    )
    assert "1" in verdict.message
    # Its successor is up: running again.
    assert running_verdict(stages("Running", "Running", restarts=(0, 1))).phase == "Running"


def test_starting_stages_are_pending() -> None:
    verdict = running_verdict(stages("Running", "Pending"))
    assert (verdict.phase, verdict.reason, verdict.message) == (
        "Pending",
        "StagesStarting",
        "1/2 stages are running.",
    )


def test_transition_time_moves_only_when_a_condition_flips() -> None:
    running = Verdict("Running", True, True, "StagesRunning", "ok")
    first = with_verdict({}, running, T0, generation=3)
    later = with_verdict(first, running, T0 + timedelta(minutes=5), generation=3)
    assert later == first
    ready = {c["type"]: c for c in first["conditions"]}["Ready"]
    assert ready["lastTransitionTime"] == "2026-11-22T10:00:00Z"
    assert ready["observedGeneration"] == 3 and first["observedGeneration"] == 3
    failed = with_verdict(
        first,
        Verdict("Failed", False, False, "BackoffLimitExceeded", "x"),
        T0 + timedelta(minutes=9),
        generation=3,
    )
    ready = {c["type"]: c for c in failed["conditions"]}["Ready"]
    assert ready["lastTransitionTime"] == "2026-11-22T10:09:00Z"
    assert failed["completionTime"] == "2026-11-22T10:09:00Z"
    assert is_terminal(finalize(failed))


def test_an_invalid_spec_is_not_terminal() -> None:
    invalid = with_verdict({}, Verdict("Failed", False, False, "InvalidSpec", "bad"), T0, 1)
    assert not is_terminal(invalid)
    assert "completionTime" not in invalid


def test_finalize_fills_printer_fields_and_rejects_undeclared_fields() -> None:
    status = finalize({"phase": "Running", "stages": stages("Running", "Pending", restarts=(2, 1))})
    assert status["readyStages"] == "1/2"
    assert status["restarts"] == 3
    with pytest.raises(ValueError, match="notAField"):
        finalize({"phase": "Running", "notAField": 1})


def test_changes_is_empty_when_nothing_changed_and_removes_dropped_fields() -> None:
    old = finalize({"phase": "Running", "plan": {"stages": []}})
    assert changes(old, old) == {}
    new = finalize({"phase": "Pending"})
    assert changes(old, new) == {"phase": "Pending", "plan": None}


def progress_job() -> Any:
    """100 steps of 2 x 5 rows of 100 tokens: 1,000 tokens per full step."""
    return parse_job(
        {
            "apiVersion": "relaytrain.io/v1alpha1",
            "kind": "FineTuneJob",
            "metadata": {"name": "j", "namespace": "n"},
            "spec": {
                "model": {"uri": "s3://models/m/"},
                "dataset": {"uri": "s3://data/d.jsonl", "sequenceLength": 100},
                "training": {"steps": 100, "microBatchSize": 2, "microBatches": 5},
                "checkpoint": {"uri": "s3://ckpt/x"},
            },
        }
    )


def test_progress_record_becomes_status_progress_with_an_eta() -> None:
    job = progress_job()
    record = {
        "step": 40,
        "totalSteps": 100,
        "loss": 2.5,
        "tokensPerSecond": 100.0,
        "lastCommittedStep": 40,
        "updatedAt": "2026-11-22T10:00:00Z",
        "done": False,
    }
    progress = fold(record, job, T0)
    # 60 steps left x 1,000 tokens per step at 100 tokens/s = 600 s.
    assert progress.status == {
        "step": 40,
        "totalSteps": 100,
        "stepOfTotal": "40/100",
        "loss": 2.5,
        "tokensPerSecond": 100.0,
        "lastCommittedStep": 40,
        "updatedAt": "2026-11-22T10:00:00Z",
        "eta": "2026-11-22T10:10:00Z",
    }
    assert not progress.done
    done = fold({**record, "step": 100, "done": True, "output": "s3://out/a/"}, job, T0)
    assert done.done and done.output == "s3://out/a/"
    assert "eta" not in done.status
    finalize({"phase": "Running", "progress": progress.status})  # declared in the CRD


def test_eta_follows_the_reported_step_time_when_there_is_one() -> None:
    job = progress_job()
    record = {
        "step": 40,
        "totalSteps": 100,
        # Padded data: few tokens per step, so a token-based ETA would be far too long.
        "tokensPerSecond": 10.0,
        "stepSeconds": 2.0,
        "updatedAt": "2026-11-22T10:00:00Z",
        "done": False,
    }
    # 60 steps left x 2 s = 120 s after the record was written.
    assert fold(record, job, T0).status["eta"] == "2026-11-22T10:02:00Z"
