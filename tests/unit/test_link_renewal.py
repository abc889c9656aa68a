"""Link certificate renewal (domain/linkcerts.py): when each step is due, what each step
leaves in the Secret, and that stages one phase apart link to each other over real TLS."""

from __future__ import annotations

import itertools
import socket
import threading
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from relaytrain_operator.domain.linkcerts import (
    CA_FILE,
    NEXT,
    LinkState,
    Step,
    advanced,
    cert_file,
    link_state,
    mint_link_credentials,
    renewal_due,
    renewal_step,
    renewed_files,
    stage_pem,
    state_annotations,
)
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.linkauth import AuthError, client_handshake, server_handshake

pytestmark = pytest.mark.unit

NS, JOB = "team-a", "long"
T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
LIFE = timedelta(days=30)
P = timedelta(seconds=90)


def _cas(bundle: str) -> list[str]:
    """The common names of the CA certificates in a bundle, in order."""
    certs = x509.load_pem_x509_certificates(bundle.encode())
    return [str(c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value) for c in certs]


def _walk(files: dict[str, str], start: datetime) -> list[tuple[Step, datetime, dict[str, str]]]:
    """Every step of one renewal, each at the moment it falls due, as the operator takes
    them: (step, when, the Secret's files after it)."""
    state = link_state(files, {})
    out = []
    now = start
    for _ in range(3):
        now = renewal_due(state, 0.67, P)
        step = renewal_step(state, now, 0.67, P)
        assert step is not None and renewal_step(state, now - timedelta(seconds=1), 0.67, P) is None
        minted = None
        if step == "trust":
            minted = mint_link_credentials(NS, JOB, [2], now=now, lifetime=LIFE, generation=1)
        after = advanced(state, step, now, LIFE, files)
        files = renewed_files(step, files, minted)
        # What the Secret records reads back as the state the step says.
        assert link_state(files, state_annotations(after)) == after
        state = after
        out.append((step, now, files))
    return out


def test_a_renewal_starts_at_its_share_of_the_lifetime_and_its_phases_follow_apart() -> None:
    files = mint_link_credentials(NS, JOB, [2], now=T0, lifetime=LIFE)
    walk = _walk(files, T0)
    assert [(step, when - T0) for step, when, _ in walk] == [
        ("trust", LIFE * 0.67),
        ("switch", LIFE * 0.67 + P),
        ("retire", LIFE * 0.67 + 2 * P),
    ]
    (_, _, trusting), (_, _, switching), (_, _, current) = walk
    # Trusting: both CAs trusted, the stages' certificates still the first ones, the next
    # waiting under names no pod mounts.
    assert _cas(trusting[CA_FILE]) == ["relaytrain link CA g0", "relaytrain link CA g1"]
    assert trusting[cert_file(0, 1)] == files[cert_file(0, 1)]
    assert {NEXT + cert_file(0, 1), NEXT + CA_FILE} <= set(trusting)
    # Switching: the next certificates in use, both CAs still trusted.
    assert switching[cert_file(0, 1)] == trusting[NEXT + cert_file(0, 1)]
    assert _cas(switching[CA_FILE]) == ["relaytrain link CA g0", "relaytrain link CA g1"]
    # Current: the new CA alone, nothing staged.
    assert _cas(current[CA_FILE]) == ["relaytrain link CA g1"]
    assert not [name for name in current if name.startswith(NEXT)]
    assert sorted(current) == sorted(files)
    state = link_state(current, {})
    assert state.not_after == walk[0][1] + LIFE and state.generation == 0  # no annotations


def test_a_short_lifetime_renews_early_enough_for_three_phases() -> None:
    life = timedelta(minutes=6)
    files = mint_link_credentials(NS, JOB, [1], now=T0, lifetime=life)
    state = link_state(files, {})
    # 67% of 6 minutes leaves 119 s, less than three propagation delays: it starts sooner.
    assert renewal_due(state, 0.67, P) == T0 + life - 3 * P
    # A lifetime shorter than three delays renews at once.
    tiny = link_state(mint_link_credentials(NS, JOB, [1], now=T0, lifetime=2 * P), {})
    assert renewal_due(tiny, 0.67, P) == T0


def test_expired_certificates_are_reissued_at_once_in_any_phase() -> None:
    files = mint_link_credentials(NS, JOB, [2], now=T0, lifetime=LIFE)
    later = T0 + LIFE + timedelta(days=3)  # a job suspended past the end of its certificates
    for phase in ("Current", "Trusting", "Switching"):
        state = LinkState(4, phase, T0, T0, T0 + LIFE)  # type: ignore[arg-type]
        assert renewal_step(state, later, 0.67, P) == "reissue"
    minted = mint_link_credentials(NS, JOB, [2], now=later, lifetime=LIFE, generation=5)
    after = advanced(link_state(files, {}), "reissue", later, LIFE, files)
    assert (after.generation, after.phase, after.not_after) == (1, "Current", later + LIFE)
    assert renewed_files("reissue", files, minted) == minted


def _creds(files: dict[str, str], stage: int) -> LinkCredentials:
    return LinkCredentials(*stage_pem(files, 0, stage))


def _links(listener: LinkCredentials, dialer: LinkCredentials) -> str:
    """Stage 1 (`listener`) accepts stage 0 (`dialer`) over a socket pair: '' when both
    accept, else the refusal."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    errors: list[str] = []

    def serve() -> None:
        try:
            server_handshake(b, listener, f"relaytrain://{NS}/{JOB}/p0/s0", "stage 0")
        except (AuthError, OSError) as e:
            errors.append(f"listener: {e}")
            b.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        client_handshake(a, dialer, f"relaytrain://{NS}/{JOB}/p0/s1", "stage 1")
    except (AuthError, OSError) as e:
        errors.append(f"dialer: {e}")
        a.close()
    t.join(10)
    a.close()
    b.close()
    return "; ".join(errors)


def test_stages_one_phase_apart_link_and_two_phases_apart_do_not() -> None:
    """Each phase reaches the pods within one propagation delay, so at any moment two
    stages hold the same phase's files or adjacent ones (and a replacement starts with
    the newest): every such pair links. Skipping a phase would leave a window where
    neighbours refuse each other — what the phases are for."""
    # Minted so long ago that the renewal's last phase falls due now (each certificate is
    # valid from its minting on).
    start = datetime.now(UTC) - LIFE * 0.67 - 2 * P
    files = mint_link_credentials(NS, JOB, [2], now=start, lifetime=LIFE)
    phases = [files] + [after for _, _, after in _walk(files, start)]
    for i, j in itertools.product(range(4), repeat=2):
        refusal = _links(_creds(phases[i], 1), _creds(phases[j], 0))
        if abs(i - j) <= 1:
            assert refusal == "", (i, j, refusal)
        else:
            assert "does not verify" in refusal or "refused" in refusal, (i, j, refusal)
