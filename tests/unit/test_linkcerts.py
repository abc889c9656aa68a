"""The per-job link PKI the operator (and `relaytrain run --local`) mints."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from itertools import count
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from relaytrain_operator.cli.local_run import LocalRun
from relaytrain_operator.domain.linkcerts import (
    CA_FILE,
    cert_file,
    key_file,
    mint_link_credentials,
)
from relaytrain_operator.domain.stage_config import LINK_CREDENTIALS_DIR
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def _mint_reproducibly() -> dict[str, str]:
    """Minting with injected randomness: keys and serial numbers from counters."""
    keys, serials = count(1), count(100)
    return mint_link_credentials(
        "team-a", "smol", [2], now=NOW,
        make_key=lambda: ec.derive_private_key(next(keys) * 7919, ec.SECP256R1()),
        make_serial=lambda: next(serials),
    )  # fmt: skip


def _cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def test_each_stage_gets_a_certificate_for_its_identity_signed_by_the_job_ca() -> None:
    files = mint_link_credentials("team-a", "smol", [3], now=NOW)
    assert sorted(files) == sorted(
        [CA_FILE, *(f(0, k) for k in range(3) for f in (cert_file, key_file))]
    )
    ca = _cert(files[CA_FILE])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    for k in range(3):
        cert = _cert(files[cert_file(0, k)])
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"relaytrain://team-a/smol/p0/s{k}"
        ]
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {u._name for u in usages} == {"serverAuth", "clientAuth"}  # listens and connects
        key = serialization.load_pem_private_key(files[key_file(0, k)].encode(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        assert key.public_key() == cert.public_key()


def test_the_ca_key_is_handed_to_nobody() -> None:
    files = mint_link_credentials("team-a", "smol", [2], now=NOW)
    ca_public = _cert(files[CA_FILE]).public_key()
    keys = [v for v in files.values() if "PRIVATE KEY" in v]
    assert len(keys) == 2  # one per stage, none for the CA
    for pem in keys:
        key = serialization.load_pem_private_key(pem.encode(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.public_key() != ca_public
    assert "PRIVATE KEY" not in files[CA_FILE]


def test_certificates_last_thirty_days_from_a_little_before_minting() -> None:
    files = mint_link_credentials("team-a", "smol", [1], now=NOW)
    for name in (CA_FILE, cert_file(0, 0)):
        cert = _cert(files[name])
        assert cert.not_valid_before_utc == NOW - timedelta(minutes=5)
        assert cert.not_valid_after_utc == NOW + timedelta(days=30)
    longer = mint_link_credentials("team-a", "smol", [1], now=NOW, lifetime=timedelta(days=90))
    assert _cert(longer[CA_FILE]).not_valid_after_utc == NOW + timedelta(days=90)


def test_several_pipelines_each_get_their_stages() -> None:
    files = mint_link_credentials("team-a", "smol", [2, 3], now=NOW)
    uris = sorted(
        _cert(pem)
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value.get_values_for_type(x509.UniformResourceIdentifier)[0]
        for name, pem in files.items()
        if name.endswith(".crt") and name != CA_FILE
    )
    assert uris == [
        "relaytrain://team-a/smol/p0/s0",
        "relaytrain://team-a/smol/p0/s1",
        "relaytrain://team-a/smol/p1/s0",
        "relaytrain://team-a/smol/p1/s1",
        "relaytrain://team-a/smol/p1/s2",
    ]


def test_minting_is_a_function_of_its_inputs() -> None:
    first, again = _mint_reproducibly(), _mint_reproducibly()
    # Same keys, serials, names and dates (ECDSA signatures themselves are randomised).
    assert first.keys() == again.keys()
    for name in first:
        if name.endswith(".key"):
            assert first[name] == again[name]
        else:
            a, b = _cert(first[name]), _cert(again[name])
            assert (a.serial_number, a.subject, list(a.extensions), a.not_valid_after_utc) == (
                b.serial_number,
                b.subject,
                list(b.extensions),
                b.not_valid_after_utc,
            )
    # Without injected randomness every minting makes a new CA.
    fresh = [mint_link_credentials("team-a", "smol", [2], now=NOW) for _ in range(2)]
    assert fresh[0][CA_FILE] != fresh[1][CA_FILE]


@pytest.mark.parametrize(
    ("stages", "now", "message"),
    [
        ([], NOW, "at least one stage"),
        ([2, 0], NOW, "at least one stage"),
        ([2], NOW.replace(tzinfo=None), "timezone-aware"),
    ],
)
def test_bad_inputs_are_refused(stages: list[int], now: datetime, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mint_link_credentials("team-a", "smol", stages, now=now)


def test_a_local_run_hands_each_stage_its_own_private_credentials_folder_and_removes_it(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {**SMOLLM2_135M_CONFIG, "num_hidden_layers": 4}
    (model / "config.json").write_text(json.dumps(config))
    job = Job("local-tls").model(str(model)).pipeline(stages=3).checkpoint(str(tmp_path / "ckpt"))
    run = LocalRun.prepare(parse_job(job.build()), tmp_path / "wd", None)
    assert not (tmp_path / "wd").exists()  # preparing writes nothing
    assert all(d["links"]["credentialsDir"] == LINK_CREDENTIALS_DIR for d in run.documents)
    run.write_stage_files()
    try:
        folders = [s.link_dir for s in run.stages]
        cas = set()
        for stage, folder in zip(run.stages, folders, strict=True):
            assert folder is not None and (folder.stat().st_mode & 0o777) == 0o700
            assert not folder.is_relative_to(tmp_path / "wd")  # never in the run's directory
            # As a kubelet shows a mounted Secret: the names through `..data`, one set.
            files = {p.name: p for p in folder.iterdir() if not p.name.startswith("..")}
            assert sorted(files) == ["ca.crt", "tls.crt", "tls.key"]
            assert (folder / "..data").is_symlink()
            assert all((p.stat().st_mode & 0o777) == 0o600 for p in files.values())
            doc = json.loads(stage.config_path.read_text())
            assert doc["links"]["credentialsDir"] == str(folder)  # what the stage reads
            cert = _cert(files["tls.crt"].read_text())
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            identity = doc["links"]["identity"]
            assert san.get_values_for_type(x509.UniformResourceIdentifier) == [identity]
            key = serialization.load_pem_private_key(files["tls.key"].read_bytes(), None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            assert key.public_key() == cert.public_key()
            cas.add(files["ca.crt"].read_text())
        assert len(cas) == 1  # one CA for the run
        assert len({(f / "tls.key").read_text() for f in folders if f is not None}) == 3
        written = [p.read_text() for p in (tmp_path / "wd").rglob("*") if p.is_file()]
        assert written and not any("PRIVATE KEY" in text for text in written)
    finally:
        run.remove_credentials()
    # The keys are gone with the run (`supervise` removes them when its stages are gone).
    assert not any(f is not None and f.exists() for f in folders)
    assert all(s.link_dir is None for s in run.stages)


def test_a_local_run_renews_its_certificates_in_every_stage_folder_as_the_operator_does(
    tmp_path: Path,
) -> None:
    """`relaytrain run --local` for longer than its certificates last: the supervisor takes
    the operator's three phases on every stage's folder at once, and a stage that reads
    its folder again links with the new certificates."""
    from relaytrain_operator.cli.local_run.supervisor import LOCAL_PROPAGATION
    from relaytrain_worker.pipeline.credentials import LinkCredentials

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**SMOLLM2_135M_CONFIG, "num_hidden_layers": 4}))
    job = (
        Job("local-renew").model(str(model)).pipeline(stages=2)
        .checkpoint(str(tmp_path / "ckpt")).link_certificates(lifetime_seconds=3600)
    )  # fmt: skip
    run = LocalRun.prepare(parse_job(job.build()), tmp_path / "wd", None)
    run.write_stage_files()
    try:
        folder = run.stages[1].link_dir
        assert folder is not None
        stage1 = LinkCredentials.from_folder(folder)
        first = stage1.not_after
        start = first - timedelta(hours=1)  # when the run minted them
        assert run.renew_links(start + timedelta(minutes=30)) is None  # not yet (67%)
        due = start + timedelta(hours=1) * 0.67
        messages = [run.renew_links(due + k * LOCAL_PROPAGATION) for k in range(3)]
        assert messages[:2] == [None, None] and "generation 1" in str(messages[2])
        stage1.contexts()  # what a stage does before its next link
        assert stage1.not_after > first
        ca = (folder / "ca.crt").read_text()
        assert [
            c.subject.rfc4514_string() for c in x509.load_pem_x509_certificates(ca.encode())
        ] == ["CN=relaytrain link CA g1"]
        # One set shows at a time: the earlier ones are gone from the folder.
        sets = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
        assert len(sets) == 1 and (folder / "..data").resolve() == sets[0]
    finally:
        run.remove_credentials()
