"""A started job's progress and its completion: progress.json folded into status, and the
output a finished job names (decide/progress.py).
"""

from __future__ import annotations

import pytest
from relaytrain_operator.loop.decide import decide
from relaytrain_testkit.decide_cases import JOB, SETTINGS, observed, pod, running_status
from relaytrain_testkit.decide_views import RUNNING, progress, summary

pytestmark = pytest.mark.unit


def test_progress_is_folded_into_status() -> None:
    decision = decide(
        observed(JOB.status(running_status()).build(), RUNNING, progress=progress(7, 5)), SETTINGS
    )
    assert decision.status is not None and decision.status.progress is not None
    assert (decision.status.progress.step, decision.status.progress.last_committed_step) == (7, 5)
    assert summary(decision) == ["patch"]


def test_completion_without_an_output_in_progress_uses_the_default_output() -> None:
    decision = decide(
        observed(JOB.status(running_status()).build(), [pod(0, "Succeeded"), pod(1, "Succeeded")]),
        SETTINGS,
    )
    assert decision.status is not None and decision.status.output is not None
    assert decision.status.output.uri == "s3://ckpt/runs/ns/j/output/"
    assert decision.status.completion_time == "2026-11-22T10:00:00Z"
    assert [s.pod for s in decision.status.stages] == [None, None]
