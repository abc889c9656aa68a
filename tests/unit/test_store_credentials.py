"""How a job's object store is reached when the job names no credential Secret: AWS's
standard chain (the environment's key pair, the shared credentials file, then on AWS the
IAM role), the same for the worker, the operator's progress and config reads, and
`relaytrain run --local`; and the contract's endpoint rule for each of them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from minio import Minio
from minio.credentials.providers import IamAwsProvider
from relaytrain_contract import CheckpointSpec, S3Credentials, aws_credentials, s3_endpoint
from relaytrain_operator.cli import local_run
from relaytrain_operator.loop.observe import Observer
from relaytrain_operator.spec import parse_job
from relaytrain_operator.store import objectstore
from relaytrain_operator.store.objectstore import StoreAccess
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG
from relaytrain_worker.state.store import job_credentials

pytestmark = pytest.mark.unit

ENV_PAIR = {
    "AWS_ACCESS_KEY_ID": "ASIAENV",
    "AWS_SECRET_ACCESS_KEY": "env-secret",
    "AWS_SESSION_TOKEN": "env-token",
}
AWS_VARIABLES = (
    *ENV_PAIR,
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def _credentials_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "[default]\naws_access_key_id = AKIAFILE\naws_secret_access_key = file-secret\n\n"
        "[team]\naws_access_key_id = AKIATEAM\naws_secret_access_key = team-secret\n"
        "aws_session_token = team-token\n\n"
        "[half]\naws_access_key_id = AKIAHALF\n"
    )
    return path


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AWS variable set and a HOME without ~/.aws; the operator's client cache empty."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(objectstore, "_clients", {})
    return home


class _Response:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self) -> bytes:
        return self.data

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


@pytest.fixture
def s3_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Minio, str, str]]:
    """Every get_object of a real minio client (client, bucket, key); each answers with a
    progress record that is also a model config."""
    reads: list[tuple[Minio, str, str]] = []
    record = {
        "step": 3,
        "totalSteps": 10,
        "tokensPerSecond": 1.0,
        "updatedAt": "2026-01-01T00:00:00Z",
        **SMOLLM2_135M_CONFIG,
        "num_hidden_layers": 6,
    }

    def get_object(self: Minio, bucket: str, key: str, *_: Any, **__: Any) -> _Response:
        reads.append((self, bucket, key))
        return _Response(json.dumps(record).encode())

    monkeypatch.setattr(Minio, "get_object", get_object)
    return reads


AWS_JOB = Job("aws-job")
"""s3:// URIs, no endpoint: AWS S3; no Secret."""


def _signed_with(client: Minio) -> S3Credentials | None:
    provider = client._provider
    if provider is None:
        return None
    creds = provider.retrieve()
    return S3Credentials(creds.access_key, creds.secret_key, creds.session_token)


# --- the chain itself (relaytrain_contract) --------------------------------------------------


def test_the_environments_key_pair_comes_first(tmp_path: Path) -> None:
    env = {**ENV_PAIR, "AWS_SHARED_CREDENTIALS_FILE": str(_credentials_file(tmp_path / "c"))}
    assert aws_credentials(env) == S3Credentials("ASIAENV", "env-secret", "env-token")


def test_without_it_the_credentials_files_profile_serves(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _credentials_file(home / ".aws" / "credentials")
    assert aws_credentials({"HOME": str(home)}) == S3Credentials("AKIAFILE", "file-secret")
    named = {"AWS_SHARED_CREDENTIALS_FILE": str(home / ".aws" / "credentials")}
    assert aws_credentials({**named, "AWS_PROFILE": "team"}) == S3Credentials(
        "AKIATEAM", "team-secret", "team-token"
    )


def test_half_a_pair_is_no_pair_and_nothing_else_is_read(tmp_path: Path) -> None:
    path = str(_credentials_file(tmp_path / "c"))
    assert aws_credentials({"AWS_ACCESS_KEY_ID": "only-the-id"}) == S3Credentials()
    assert aws_credentials({"AWS_SHARED_CREDENTIALS_FILE": path, "AWS_PROFILE": "half"}) == (
        S3Credentials()
    )
    assert aws_credentials({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}) == (
        S3Credentials()
    )
    (tmp_path / "bad").write_text("not an ini file")
    assert aws_credentials({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "bad")}) == (
        S3Credentials()
    )
    assert aws_credentials({}) == S3Credentials()  # no HOME: this user's files stay unread


@pytest.mark.parametrize(
    "env",
    [
        ENV_PAIR,
        {"AWS_PROFILE": "team"},
        {"AWS_ACCESS_KEY_ID": "only-the-id"},
        {},
    ],
    ids=["environment", "file-profile", "half-pair", "nothing"],
)
def test_the_worker_and_the_operator_find_the_same_credentials(
    env: dict[str, str], tmp_path: Path
) -> None:
    environ = {**env, "AWS_SHARED_CREDENTIALS_FILE": str(_credentials_file(tmp_path / "c"))}
    checkpoint = CheckpointSpec(
        uri="s3://ckpt/x", endpoint=None, accessKeyEnv=None, secretKeyEnv=None,
        everySteps=10, keep=1,
    )  # fmt: skip
    stage = job_credentials(checkpoint, environ)
    operator = StoreAccess.from_environ(None, environ)
    assert (operator.access_key, operator.secret_key, operator.session_token) == (
        stage.access_key,
        stage.secret_key,
        stage.session_token,
    )


# --- the operator's reads ------------------------------------------------------------------


def test_the_operator_reads_an_aws_jobs_progress_with_the_environments_key_pair(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, s3_reads: list[tuple[Minio, str, str]]
) -> None:
    for name, value in {**ENV_PAIR, "AWS_REGION": "eu-west-3"}.items():
        monkeypatch.setenv(name, value)
    observer = Observer(cast(Any, None))  # no Secret named: the API server is not asked
    progress = observer.progress(parse_job(AWS_JOB.build()), datetime(2026, 1, 1, tzinfo=UTC))
    assert progress is not None and progress.status["step"] == 3
    ((client, bucket, key),) = s3_reads
    assert (bucket, key) == ("relaytrain", "checkpoints/default/aws-job/progress.json")
    assert _signed_with(client) == S3Credentials("ASIAENV", "env-secret", "env-token")
    assert (client._base_url.host, client._base_url.region) == ("s3.amazonaws.com", "eu-west-3")


def test_the_operator_reads_with_the_credentials_file_when_the_environment_has_none(
    clean_env: Path, s3_reads: list[tuple[Minio, str, str]]
) -> None:
    _credentials_file(clean_env / ".aws" / "credentials")
    config = Observer(cast(Any, None)).model_config(parse_job(AWS_JOB.build()))
    assert config.config is not None and config.config["num_hidden_layers"] == 6
    ((client, bucket, key),) = s3_reads
    assert (bucket, key) == ("models", "smollm2-135m/config.json")
    assert _signed_with(client) == S3Credentials("AKIAFILE", "file-secret")


def test_with_no_key_pair_anywhere_the_operator_uses_the_iam_role_on_aws(
    clean_env: Path, s3_reads: list[tuple[Minio, str, str]]
) -> None:
    Observer(cast(Any, None)).progress(parse_job(AWS_JOB.build()), datetime(2026, 1, 1, tzinfo=UTC))
    ((client, _, _),) = s3_reads
    assert isinstance(client._provider, IamAwsProvider)


def test_another_store_without_a_key_pair_is_read_anonymously(
    clean_env: Path, s3_reads: list[tuple[Minio, str, str]]
) -> None:
    job = parse_job(AWS_JOB.checkpoint(endpoint="http://minio.example:9000").build())
    Observer(cast(Any, None)).progress(job, datetime(2026, 1, 1, tzinfo=UTC))
    ((client, _, _),) = s3_reads
    assert client._provider is None
    assert (client._base_url.host, client._base_url.is_https) == ("minio.example:9000", False)


# --- relaytrain run --local ----------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint", [None, "https://s3.example.com:9000", "http://minio.local:9000"]
)
def test_run_local_reaches_a_jobs_store_as_the_contract_says(
    endpoint: str | None,
    clean_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    s3_reads: list[tuple[Minio, str, str]],
) -> None:
    env = {**ENV_PAIR, "AWS_REGION": "eu-west-3"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = parse_job(AWS_JOB.checkpoint(endpoint=endpoint).build())
    assert local_run._model_layers(job) == 6  # the model's config.json, read from S3
    ((client, bucket, key),) = s3_reads
    assert (bucket, key) == ("models", "smollm2-135m/config.json")
    expected = s3_endpoint(endpoint, env)
    assert (client._base_url.host, client._base_url.is_https, client._base_url.region) == (
        expected.host,
        expected.secure,
        expected.region,
    )
    assert _signed_with(client) == S3Credentials("ASIAENV", "env-secret", "env-token")
