"""`relaytrain plan` reads the model's config.json from a real MinIO server (s3:// model URI),
and falls back to the shipped config, saying why, when the object is missing or the keys are
refused."""

from __future__ import annotations

import io
import json
import secrets
from pathlib import Path

import pytest
from relaytrain_operator import cli
from relaytrain_operator.store.model_config import resolve
from relaytrain_testkit.harness.minio_server import MinioServer
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
POOLS = ROOT / "hack" / "pools.yaml"


def _upload_config(minio: MinioServer, layers: int) -> str:
    """A config.json under a fresh prefix whose name is no shipped model's; its s3:// URI."""
    prefix = f"models/tiny-{secrets.token_hex(4)}"
    body = json.dumps({**SMOLLM2_135M_CONFIG, "num_hidden_layers": layers}).encode()
    minio.client().put_object(minio.bucket, f"{prefix}/config.json", io.BytesIO(body), len(body))
    return f"s3://{minio.bucket}/{prefix}/"


def _shipped_name_uri(minio: MinioServer, name: str) -> str:
    """An s3:// model URI under a fresh prefix (empty) whose last component is `name`."""
    return f"s3://{minio.bucket}/models-{secrets.token_hex(4)}/{name}/"


def _put_config(minio: MinioServer, uri: str, layers: int) -> None:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    body = json.dumps({**SMOLLM2_135M_CONFIG, "num_hidden_layers": layers}).encode()
    minio.client().put_object(bucket, f"{prefix}config.json", io.BytesIO(body), len(body))


def _keys(minio: MinioServer, secret_key: str | None = None) -> dict[str, str]:
    """The environment's S3 keys: the server's, or its access key with `secret_key`."""
    return {
        "AWS_ACCESS_KEY_ID": minio.access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key or minio.secret_key,
    }


def _job(tmp_path: Path, model_uri: str, endpoint: str | None) -> Path:
    """The lora example on `model_uri`, its store at `endpoint` (None: AWS S3), written."""
    job = Job.example("finetunejob-lora").model(model_uri)
    job = job.checkpoint(endpoint=endpoint) if endpoint else job.unset("spec.checkpoint.endpoint")
    return job.write(tmp_path / "job.yaml")


@pytest.fixture
def s3_env(minio_server: MinioServer, monkeypatch: pytest.MonkeyPatch) -> MinioServer:
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", minio_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", minio_server.secret_key)
    return minio_server


def test_plan_reads_config_json_from_the_jobs_s3_endpoint(s3_env, tmp_path, capsys):
    uri = _upload_config(s3_env, layers=7)
    job = _job(tmp_path, uri, s3_env.url)
    assert cli.main(["plan", str(job), "--nodes", str(POOLS), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["source"] == "uri"
    assert doc["model"]["location"] == f"{uri}config.json"
    assert doc["model"]["skipped"] == [] and doc["model"]["layers"] == 7
    assert doc["stages"][-1]["layerEnd"] == 7


def test_plan_takes_the_endpoint_from_the_environment_when_the_job_names_none(
    s3_env, tmp_path, capsys, monkeypatch
):
    uri = _upload_config(s3_env, layers=5)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.url)
    job = _job(tmp_path, uri, None)
    assert cli.main(["plan", str(job), "--nodes", str(POOLS)]) == 0
    out = capsys.readouterr().out
    assert f"Model: {uri}config.json (spec.model.uri): 5 layers" in out


def test_wrong_keys_are_named_in_the_error(s3_env, tmp_path, capsys, monkeypatch):
    uri = _upload_config(s3_env, layers=5)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    job = _job(tmp_path, uri, s3_env.url)
    assert cli.main(["plan", str(job), "--nodes", str(POOLS)]) == 2
    err = capsys.readouterr().err
    assert f"{uri}config.json at {s3_env.url}: " in err
    assert "SignatureDoesNotMatch" in err
    assert "shipped configs: none is named" in err


def test_an_s3_model_uri_is_read_with_the_environments_keys(minio_server: MinioServer) -> None:
    # The URI names a shipped model too: the object read wins over the shipped config.
    uri = _shipped_name_uri(minio_server, "llama-3.1-8b")
    _put_config(minio_server, uri, layers=9)
    found = resolve(uri, endpoint=minio_server.url, environ=_keys(minio_server))
    assert found.source == "uri" and found.config["num_hidden_layers"] == 9
    assert found.location == f"{uri}config.json" and found.skipped == ()
    assert found.describe() == f"{uri}config.json (spec.model.uri)"


def test_a_missing_s3_object_falls_back_to_the_shipped_config_with_the_reason(
    minio_server: MinioServer,
) -> None:
    uri = _shipped_name_uri(minio_server, "qwen2-0.5b")
    found = resolve(uri, endpoint=minio_server.url, environ=_keys(minio_server))
    assert found.source == "shipped" and found.location == "qwen2-0.5b"
    assert found.config["num_hidden_layers"] == 24
    assert found.skipped == (f"{uri}config.json at {minio_server.url}: no such object",)


def test_refused_keys_fall_back_to_the_shipped_config_with_the_reason(
    minio_server: MinioServer,
) -> None:
    uri = _shipped_name_uri(minio_server, "qwen2-0.5b")
    _put_config(minio_server, uri, layers=9)  # there, but these keys may not read it
    found = resolve(uri, endpoint=minio_server.url, environ=_keys(minio_server, "not-the-key"))
    assert found.source == "shipped" and found.location == "qwen2-0.5b"
    assert found.config["num_hidden_layers"] == 24
    (why,) = found.skipped
    assert why.startswith(f"{uri}config.json at {minio_server.url}: SignatureDoesNotMatch: ")
