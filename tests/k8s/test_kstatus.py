"""The status as the real kstatus library reads it (kstatus-check, built from
sigs.k8s.io/cli-utils at its pin), one status per phase as the operator's status code writes
it; tests/k8s/test_operator.py runs it on every status each of its tests' real jobs went through.
A status changed to the wrong phase changes the verdict."""

from __future__ import annotations

from typing import Any

import pytest
from relaytrain_testkit.harness.kstatus import expected_kstatus, kstatus
from relaytrain_testkit.health_cases import CASES, job

pytestmark = pytest.mark.k8s

KSTATUS = {
    "just created": "Current",  # no status yet: kstatus cannot tell (docs/operator.md)
    "planning": "InProgress",
    "starting": "InProgress",
    "waiting for GPUs": "InProgress",
    "training": "Current",
    "recovering a stage": "InProgress",
    "a pipeline being replaced": "InProgress",
    "a pipeline given up": "Current",  # it trains on without it; Argo CD says Degraded
    "every pipeline training": "Current",
    "suspended": "InProgress",  # not Ready: not done, waiting to go on
    "queued for Kueue's quota": "InProgress",
    "evicted by Kueue": "InProgress",
    "a Kueue queue that cannot admit it": "InProgress",  # Argo CD says Degraded
    "labelled for a queue, no Kueue": "InProgress",  # Argo CD says Degraded
    "succeeded": "Current",
    "restarts used up": "Failed",
    "invalid spec": "Failed",
    "model unreadable": "Failed",
    "a spec change not yet seen": "InProgress",
}


def test_every_phase_as_kstatus_reads_it() -> None:
    assert sorted(KSTATUS) == sorted(case for case, _, _ in CASES)
    verdicts = kstatus([obj for _, obj, _ in CASES])
    got = {case: status for (case, _, _), (status, _) in zip(CASES, verdicts, strict=True)}
    assert got == KSTATUS
    # The documented rule (expected_kstatus, also applied to real jobs) says the same.
    assert {case: expected_kstatus(obj) for case, obj, _ in CASES} == KSTATUS
    messages = dict(zip([c for c, _, _ in CASES], [m for _, m in verdicts], strict=True))
    assert messages["invalid spec"] == "InvalidSpec says why"  # the operator's own words


@pytest.mark.parametrize(
    ("phase", "reason", "wrong", "wrong_reason"),
    [
        ("Running", "StagesRunning", "Failed", "BackoffLimitExceeded"),
        ("Succeeded", "Succeeded", "Recovering", "StageRestarting"),
        ("Pending", "StagesStarting", "Running", "StagesRunning"),
    ],
)
def test_a_status_written_for_the_wrong_phase_changes_the_verdict(
    phase: str, reason: str, wrong: str, wrong_reason: str
) -> None:
    right: dict[str, Any] = job(phase, reason, ready=phase != "Pending")
    mistaken: dict[str, Any] = job(wrong, wrong_reason, ready=wrong == "Running")
    (first, _), (second, _) = kstatus([right, mistaken])
    assert first != second, (phase, wrong, first)
