"""Decisions on a running job's link certificates: the Secret is read only when a change
is due, each renewal step is taken once, mirrored in status, and comes before any pod."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from relaytrain_contract import CONFIG_ENV
from relaytrain_operator.domain.builders.secret import build_link_secret
from relaytrain_operator.domain.linkcerts import (
    LinkState,
    link_state,
    mint_link_credentials,
    state_annotations,
)
from relaytrain_operator.domain.status import rfc3339
from relaytrain_operator.loop.actions import Create, PostEvent, RenewLinkSecret
from relaytrain_operator.loop.decide import decide, needs, stage_pods
from relaytrain_testkit.decide_cases import (
    JOB,
    NOW,
    SETTINGS,
    observed,
    pod,
    running_status,
    stage,
)

pytestmark = pytest.mark.unit

LIFE = timedelta(days=30)
P = timedelta(seconds=SETTINGS.secret_propagation_seconds)


def _secret(minted_at: Any, state: LinkState | None = None, version: str = "7") -> dict[str, Any]:
    """The job's link Secret as the API server returns it: minted at `minted_at`."""
    files = mint_link_credentials("ns", "j", [2], now=minted_at, lifetime=LIFE)
    state = state or link_state(files, {})
    return build_link_secret(JOB.build(), files, state_annotations(state), version)


def _links(decision: Any) -> dict[str, Any]:
    return decision.status.model_dump(mode="json", by_alias=True)["linkCertificates"]


def test_the_secret_is_read_when_status_does_not_say_when_or_a_change_is_due() -> None:
    pods = stage_pods([pod(0), pod(1)])
    job = JOB.status(running_status()).build()
    assert needs(job, pods, NOW).link_secret  # no linkCertificates yet
    assert not needs(job, pods).link_secret  # a caller without a clock reads nothing for it
    due = {"generation": 0, "phase": "Current", "notAfter": "2026-12-20T00:00:00Z"}
    later = JOB.status(running_status(linkCertificates={**due, "nextStepAt": rfc3339(NOW + P)}))
    assert not needs(later.build(), pods, NOW).link_secret
    assert needs(later.build(), pods, NOW + P).link_secret


def test_a_secret_not_due_is_mirrored_and_the_next_pass_comes_when_it_is() -> None:
    minted = NOW - timedelta(days=10)
    job = JOB.status(running_status()).build()
    decision = decide(observed(job, [pod(0), pod(1)], link_secret=_secret(minted)), SETTINGS)
    assert not [a for a in decision.actions if isinstance(a, RenewLinkSecret)]
    due = minted + LIFE * 0.67
    whole = due + timedelta(microseconds=-due.microsecond % 1_000_000)  # not a second early
    assert _links(decision) == {
        "generation": 0,
        "phase": "Current",
        "notAfter": rfc3339(minted + LIFE),
        "nextStepAt": rfc3339(whole),
    }
    assert decision.retry_after == pytest.approx((due - NOW).total_seconds(), abs=1)


def test_each_phase_is_one_replace_at_the_version_read_and_the_last_tells_the_user() -> None:
    minted = NOW - LIFE * 0.7  # past its 67%
    job = JOB.status(running_status()).build()
    at = NOW + timedelta(milliseconds=250)  # a pass's clock has fractions of a second
    first = decide(observed(job, [pod(0), pod(1)], now=at, link_secret=_secret(minted)), SETTINGS)
    (renew,) = [a for a in first.actions if isinstance(a, RenewLinkSecret)]
    assert (renew.step, renew.mint, renew.resource_version, renew.stage_counts) == (
        "trust", 1, "7", (2,),
    )  # fmt: skip
    assert renew.lifetime == LIFE and renew.after.phase == "Trusting"
    # The next phase is due P later; status, in whole seconds, does not say it early.
    assert _links(first)["phase"] == "Trusting"
    assert _links(first)["nextStepAt"] == rfc3339(NOW + P + timedelta(seconds=1))
    assert first.retry_after == pytest.approx(P.total_seconds() + 0.75)
    assert not [a for a in first.actions if isinstance(a, PostEvent) and "Link" in a.reason]

    # The last phase, at the time status gave: the new CA alone, and one Event.
    current = link_state(renew.files, {})
    switching = LinkState(1, "Switching", NOW, current.issued, current.not_after)
    secret = _secret(minted, switching, version="9")
    job = JOB.status(running_status(**first.status.model_dump(by_alias=True))).build()
    later = NOW + P + timedelta(seconds=1)  # when status said
    last = decide(observed(job, [pod(0), pod(1)], now=later, link_secret=secret), SETTINGS)
    (renew,) = [a for a in last.actions if isinstance(a, RenewLinkSecret)]
    assert (renew.step, renew.mint, renew.resource_version) == ("retire", None, "9")
    (event,) = [a for a in last.actions if isinstance(a, PostEvent) and "Link" in a.reason]
    assert (event.type, event.reason) == ("Normal", "LinkCertificatesRenewed")
    assert "generation 1" in event.message and rfc3339(current.not_after) in event.message


def test_expired_certificates_are_reissued_before_a_replacement_is_created() -> None:
    """A job resumed after its certificates ran out (or an operator away for that long):
    a fresh set first, then the pods that will link with it."""
    minted = NOW - LIFE - timedelta(days=1)
    job = JOB.status(running_status(stage(0), stage(1, ready=False))).build()
    decision = decide(observed(job, [pod(0)], link_secret=_secret(minted)), SETTINGS)
    kinds = [type(a).__name__ for a in decision.actions]
    renew = next(a for a in decision.actions if isinstance(a, RenewLinkSecret))
    assert renew.step == "reissue" and renew.mint == 1
    created = [(i, a.obj) for i, a in enumerate(decision.actions) if isinstance(a, Create)]
    ((first_pod, replacement),) = [(i, obj) for i, obj in created if obj["kind"] == "Pod"]
    assert kinds.index("RenewLinkSecret") < first_pod
    # The replacement tries a link refused on the chain again for as long as two phases
    # may take to reach the two ends.
    env = {e["name"]: e.get("value") for e in replacement["spec"]["containers"][0]["env"]}
    document = json.loads(env[CONFIG_ENV])
    assert document["links"]["renewalGraceSeconds"] == 2 * P.total_seconds()
    assert _links(decision)["generation"] == 1


def test_a_link_secret_gone_is_not_polled_faster_than_the_periodic_check() -> None:
    """Due, read, and not there (someone deleted it): no renewal to take, and no early
    wake-up either (the next periodic pass reads again)."""
    links = {"generation": 0, "phase": "Current", "notAfter": "2026-12-20T00:00:00Z"}
    status = running_status(linkCertificates={**links, "nextStepAt": rfc3339(NOW - P)})
    decision = decide(observed(JOB.status(status).build(), [pod(0), pod(1)]), SETTINGS)
    assert not [a for a in decision.actions if isinstance(a, RenewLinkSecret)]
    assert decision.retry_after is None
