"""The links' certificates of a running job: renewed before they expire.

The job's link Secret (`<job>-link`) is the record: its certificates say when they were
minted and expire, its annotations where a renewal stands (domain/linkcerts.py). A pass
reads it only when status.linkCertificates says a change is due (or does not say yet),
takes the step `linkcerts.renewal_step` names, mirrors the result into status, and asks
for another pass when the next step is due. A step replaces the Secret at the version it
was read at, so two operators (or a pass redone after a crash) never apply one twice.
A planned stage the Secret has no certificate for (a pipeline added to the running job)
gets one, under a CA of its own that every stage then trusts too (`_extend`).
"""

from __future__ import annotations

from datetime import timedelta

from relaytrain_operator.domain.builders.secret import secret_files
from relaytrain_operator.domain.linkcerts import (
    LinkState,
    advanced,
    link_state,
    missing_stages,
    renewal_due,
    renewal_step,
)
from relaytrain_operator.domain.status import parse_time, rfc3339
from relaytrain_operator.loop.actions import ExtendLinkSecret, RenewLinkSecret
from relaytrain_operator.loop.decide.context import JsonDict, Pass, planned_keys
from relaytrain_operator.spec import FineTuneJob, LinkCertificatesStatus


def keep_links_valid(ctx: Pass, spec: FineTuneJob) -> None:
    """Take the renewal step that is due on the job's link Secret, if one is, and keep
    status.linkCertificates and the next pass's time in step with it."""
    policy = spec.spec.link_certificates
    renew_at = policy.renew_at_percent / 100
    propagation = timedelta(seconds=ctx.settings.secret_propagation_seconds)
    secret = ctx.observed.link_secret
    if secret is not None:
        files = secret_files(secret)
        state = link_state(files, (secret.get("metadata") or {}).get("annotations") or {})
        step = renewal_step(state, ctx.now, renew_at, propagation)
        if step is not None:
            plan = ctx.status.plan
            assert plan is not None
            lifetime = timedelta(seconds=policy.lifetime_seconds)
            after = advanced(state, step, ctx.now, lifetime, files)
            mint = None
            if step in ("trust", "reissue"):
                mint = state.generation + 1
            ctx.actions.append(
                RenewLinkSecret(
                    step,
                    files,
                    secret["metadata"]["resourceVersion"],
                    after,
                    mint,
                    tuple(len(split) for split in plan.splits()),
                    lifetime,
                )
            )
            if after.phase == "Current":
                ctx.event(
                    "Normal",
                    "LinkCertificatesRenewed",
                    f"The links' certificates were renewed (generation {after.generation}, a "
                    f"new CA); they are valid until {rfc3339(after.not_after)}.",
                )
            state = after
        else:
            _extend(ctx, secret, files, state)
        ctx.update(link_certificates=_status(state, renew_at, propagation))
    links = ctx.status.link_certificates
    due = parse_time(links.next_step_at) if links is not None else None
    # A time already past (the Secret is gone: nothing was read to move it on) wakes no
    # one early; the periodic check reads again.
    if due is not None and due > ctx.now:
        ctx.wake_within((due - ctx.now).total_seconds())


def _extend(ctx: Pass, secret: JsonDict, files: dict[str, str], state: LinkState) -> None:
    """Certificates for the planned stages the Secret lacks (a pipeline added to the job),
    minted under a CA of their own (linkcerts.mint_link_extension). Not in a renewal: its
    next generation was minted for the stages planned then, and its `retire` would drop the
    added CA; the renewal's end comes within two propagation delays, and this then."""
    plan = ctx.status.plan
    assert plan is not None
    missing = missing_stages(files, planned_keys(plan))
    if not missing or state.phase != "Current":
        return
    meta = secret["metadata"]
    extend = ExtendLinkSecret(
        files, meta["resourceVersion"], dict(meta.get("annotations") or {}),
        tuple(missing), state.generation, state.not_after,
    )  # fmt: skip
    ctx.actions.append(extend)


def _status(state: LinkState, renew_at: float, propagation: timedelta) -> LinkCertificatesStatus:
    due = min(renewal_due(state, renew_at, propagation), state.not_after)
    if due.microsecond:  # status keeps whole seconds: the next read must not come early
        due = due.replace(microsecond=0) + timedelta(seconds=1)
    return LinkCertificatesStatus(
        generation=state.generation,
        phase=state.phase,
        not_after=rfc3339(state.not_after),
        next_step_at=rfc3339(due),
    )
