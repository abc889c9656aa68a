"""Status computation: phase, conditions, printer fields, progress, and minimal patches."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from relaytrain_contract import Progress as Record
from relaytrain_operator.domain.progress import fold
from relaytrain_operator.domain.recovery import REPLACING
from relaytrain_operator.domain.status import (
    Verdict,
    changes,
    condition,
    finalize,
    fleet_verdict,
    is_finished,
    is_terminal,
    load_status,
    running_verdict,
    to_manifest,
    with_verdict,
)
from relaytrain_operator.spec import FineTuneJobStatus, PipelineStatus, StageStatus, parse_job
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)


def stages(*phases: str, restarts: tuple[int, ...] = ()) -> list[StageStatus]:
    restarts = restarts or (0,) * len(phases)
    return [
        StageStatus(index=k, phase=p, restarts=r, ready=p == "Running")
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


def test_a_retired_pipeline_is_no_longer_the_jobs() -> None:
    """Pipeline 1 left for good (`retired`) and pipeline 2 trains in its place: the job is
    not degraded by it and counts it nowhere; once every pipeline is retired, the job waits
    as with every pipeline out."""

    def pipeline(p: int, phase: str, retired: bool = False) -> PipelineStatus:
        return PipelineStatus(
            index=p, phase=phase, ready_stages="1/1", micro_batches=2, retired=retired,
            left_reason="its replacement waited 120 s for a GPU" if retired else None,
        )  # fmt: skip

    stage_list = [
        StageStatus(index=0, pipeline=p, phase=phase, ready=phase == "Running")
        for p, phase in ((0, "Running"), (1, None), (2, "Running"))
    ]
    lives = [pipeline(0, "Running"), pipeline(1, "Left", retired=True), pipeline(2, "Running")]
    verdict = fleet_verdict(stage_list, lives)
    assert (verdict.reason, verdict.degraded) == ("StagesRunning", False)
    assert verdict.message == "All 2 pipelines (2 stages) are training."
    status = finalize(FineTuneJobStatus(stages=stage_list, pipelines=lives))
    assert (status.ready_pipelines, status.ready_stages) == ("2/2", "2/2")
    # A retired pipeline does not hide a current one that is out.
    lives[2] = pipeline(2, "Left")
    assert fleet_verdict(stage_list, lives).reason == "PipelinesDegraded"
    gone = [pipeline(0, "Left", retired=True), pipeline(1, "Left", retired=True)]
    verdict = fleet_verdict(stage_list[:2], gone)
    assert (verdict.phase, verdict.reason) == ("Suspended", "FleetGone")


def test_starting_stages_are_pending() -> None:
    verdict = running_verdict(stages("Running", "Pending"))
    assert (verdict.phase, verdict.reason, verdict.message) == (
        "Pending",
        "StagesStarting",
        "1/2 stages are running.",
    )


def test_transition_time_moves_only_when_a_condition_flips() -> None:
    running = Verdict("Running", True, True, "StagesRunning", "ok")
    first = with_verdict(FineTuneJobStatus(), running, T0, generation=3)
    later = with_verdict(first, running, T0 + timedelta(minutes=5), generation=3)
    assert later == first
    ready = condition(first, "Ready")
    assert ready is not None and ready.last_transition_time == "2026-11-22T10:00:00Z"
    assert ready.observed_generation == 3 and first.observed_generation == 3
    failed = with_verdict(
        first,
        Verdict("Failed", False, False, "BackoffLimitExceeded", "x"),
        T0 + timedelta(minutes=9),
        generation=3,
    )
    ready = condition(failed, "Ready")
    assert ready is not None and ready.last_transition_time == "2026-11-22T10:09:00Z"
    assert failed.completion_time == "2026-11-22T10:09:00Z"
    assert is_terminal(finalize(failed))
    # The stored form says the same to kopf's filter, which sees a plain mapping.
    assert is_finished(to_manifest(failed)) and not is_finished(to_manifest(first))
    assert not is_finished(None)


def test_an_invalid_spec_is_not_terminal() -> None:
    invalid = with_verdict(
        FineTuneJobStatus(), Verdict("Failed", False, False, "InvalidSpec", "bad"), T0, 1
    )
    assert not is_terminal(invalid) and not is_finished(to_manifest(invalid))
    assert invalid.completion_time is None
    assert not is_terminal(FineTuneJobStatus(phase="Failed"))  # no Ready condition at all


def test_finalize_fills_printer_fields_and_rejects_undeclared_fields() -> None:
    status = finalize(
        FineTuneJobStatus(phase="Running", stages=stages("Running", "Pending", restarts=(2, 1)))
    )
    assert status.ready_stages == "1/2"
    assert status.restarts == 3
    with pytest.raises(ValueError, match="notAField"):
        load_status({"phase": "Running", "notAField": 1})


def test_stored_status_round_trips_and_kopf_bookkeeping_is_left_out() -> None:
    stored = to_manifest(finalize(FineTuneJobStatus(phase="Running", stages=stages("Running"))))
    assert to_manifest(load_status({**stored, "kopf": {"progress": {}}})) == stored
    assert load_status(None) == FineTuneJobStatus()


def test_changes_is_empty_when_nothing_changed_and_removes_dropped_fields() -> None:
    old = to_manifest(finalize(load_status({"phase": "Running", "plan": {"stages": []}})))
    assert changes(old, old) == {}
    new = to_manifest(finalize(load_status({"phase": "Pending"})))
    assert changes(old, new) == {"phase": "Pending", "plan": None}
    # kopf's own bookkeeping in status (if an older operator left it) is not ours to drop.
    assert changes({**old, "kopf": {}}, old) == {}
    # A field dropped inside an object is named (a merge patch keeps what it leaves out);
    # a list is replaced whole.
    was = {"plan": {"stages": [1, 2], "resplitFrom": {"stages": 3}, "compression": "int8"}}
    now = {"plan": {"stages": [1, 2, 3], "compression": "int8"}}
    assert changes(was, now) == {"plan": {"stages": [1, 2, 3], "resplitFrom": None}}


PROGRESS_JOB = (
    Job("j", "n")
    .model("s3://models/m/")
    .dataset("s3://data/d.jsonl", sequence_length=100)
    .training(steps=100, micro_batch_size=2, micro_batches=5)
    .checkpoint("s3://ckpt/x")
)
"""100 steps of 2 x 5 rows of 100 tokens: 1,000 tokens per full step."""


def test_progress_record_becomes_status_progress_with_an_eta() -> None:
    job = parse_job(PROGRESS_JOB.build())
    record = {
        "step": 40,
        "totalSteps": 100,
        "loss": 2.5,
        "tokensPerSecond": 100.0,
        "lastCommittedStep": 40,
        "updatedAt": "2026-11-22T10:00:00Z",
        "done": False,
    }
    progress = fold(Record.from_json(record), job, T0)
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
    done = fold(
        Record.from_json({**record, "step": 100, "done": True, "output": "s3://out/a/"}), job, T0
    )
    assert done.done and done.output == "s3://out/a/"
    assert "eta" not in done.status
    load_status({"phase": "Running", "progress": progress.status})  # declared in the CRD


def test_eta_follows_the_reported_step_time_when_there_is_one() -> None:
    job = parse_job(PROGRESS_JOB.build())
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
    assert fold(Record.from_json(record), job, T0).status["eta"] == "2026-11-22T10:02:00Z"


def test_times_parse_back_and_garbage_is_none() -> None:
    from relaytrain_operator.domain.status import parse_time, rfc3339

    assert parse_time(rfc3339(T0)) == T0
    assert parse_time(None) is None and parse_time("soon") is None


def test_completion_time_is_set_once() -> None:
    done = Verdict("Succeeded", True, False, "Succeeded", "ok")
    first = with_verdict(FineTuneJobStatus(), done, T0, None)
    later = with_verdict(first, done, T0 + timedelta(hours=1), None)
    assert later.completion_time == first.completion_time == "2026-11-22T10:00:00Z"
    assert later.observed_generation is None


def test_what_the_data_loader_kept_is_reported_in_status() -> None:
    """examples, examplesTruncated and examplesDropped travel from progress.json to
    status.progress (declared in the CRD), and are left out while the workers have not said."""
    job = parse_job(PROGRESS_JOB.build())
    record = {"step": 3, "totalSteps": 100, "tokensPerSecond": 1.0, "done": False}
    assert not {"examples", "examplesTruncated", "examplesDropped"} & set(
        fold(Record.from_json(record), job, T0).status
    )
    counted = {**record, "examples": 120, "examplesTruncated": 7, "examplesDropped": 0}
    status = fold(Record.from_json(counted), job, T0).status
    assert (status["examples"], status["examplesTruncated"], status["examplesDropped"]) == (
        120,
        7,
        0,
    )
    stored = load_status({"phase": "Running", "progress": status})
    assert stored.progress is not None and stored.progress.examples_truncated == 7
    # Where training stands in the data, for `kubectl get ftj` (Epoch) and -o yaml.
    seen = {"epoch": 1.23456, "examplesSeen": 150, "tokensSeen": 4800, "tokensTrained": 900}
    status = fold(Record.from_json({**counted, **seen}), job, T0).status
    assert {k: status[k] for k in seen} == {**seen, "epoch": 1.2346}
    stored = load_status({"phase": "Running", "progress": status})
    assert stored.progress is not None and stored.progress.tokens_trained == 900


@pytest.mark.parametrize(
    ("phase", "reason", "degraded", "kstatus"),
    [
        ("Planning", "Planned", None, ("True", "False")),
        ("Pending", "StagesStarting", None, ("True", "False")),
        ("Pending", "Unschedulable", None, ("True", "False")),  # GPUs may free up
        ("Running", "StagesRunning", False, ("False", "False")),
        ("Running", "PipelinesDegraded", True, ("True", "False")),  # a pipeline is out
        ("Recovering", "StageRestarting", None, ("True", "False")),
        ("Suspended", "Suspended", None, ("False", "False")),
        ("Succeeded", "Succeeded", None, ("False", "False")),
        ("Failed", "BackoffLimitExceeded", None, ("False", "True")),
        ("Failed", "InvalidSpec", None, ("False", "True")),
        ("Pending", "ModelUnavailable", None, ("False", "True")),
    ],
)
def test_kstatus_conditions_follow_the_phase(
    phase: str, reason: str, degraded: bool | None, kstatus: tuple[str, str]
) -> None:
    """Reconciling=True reads as InProgress in kstatus, Stalled=True as Failed, neither as
    Current; both carry the generation they were computed for."""
    from relaytrain_operator.domain.status import Verdict, condition, with_verdict

    verdict = Verdict(phase, phase == "Running", True, reason, "m", degraded=degraded)
    status = with_verdict(FineTuneJobStatus(), verdict, T0, 7)
    reconciling, stalled = condition(status, "Reconciling"), condition(status, "Stalled")
    assert reconciling is not None and stalled is not None
    assert (reconciling.status, stalled.status) == kstatus
    assert reconciling.observed_generation == stalled.observed_generation == 7
    assert status.observed_generation == 7
