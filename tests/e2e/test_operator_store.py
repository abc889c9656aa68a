"""The operator's observer reads a job's object store (MinIO) with the job's own credentials:
the Secret that spec.checkpoint.credentialsSecret names, read from the real API server."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from relaytrain_operator.loop.apply import ClusterApi
from relaytrain_operator.loop.decide import Needs, Observed
from relaytrain_operator.loop.observe import Observer
from relaytrain_testkit.harness.minio_server import MinioServer
from relaytrain_testkit.harness.operator_cases import cluster_job, namespace
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.e2e

WANTED = Needs(model=True, progress=True)


@pytest.fixture
def admin(kube_cluster: Any) -> client.ApiClient:
    return kube_cluster.api_client()


@pytest.fixture
def ns(admin: client.ApiClient) -> Iterator[str]:
    with namespace(admin, "rtstore") as name:
        yield name


def put_json(minio: MinioServer, key: str, value: dict[str, Any]) -> None:
    data = json.dumps(value).encode()
    minio.client().put_object(minio.bucket, key, io.BytesIO(data), len(data))


def store_job(ns: str, minio: MinioServer, prefix: str, endpoint: str) -> dict[str, Any]:
    """Job `j` with its model and checkpoints under `prefix` in MinIO, reached at `endpoint`
    with the keys in Secret `s3`."""
    job = cluster_job("j", f"s3://{minio.bucket}/{prefix}/models/smol/", ns)
    job = job.checkpoint(f"s3://{minio.bucket}/{prefix}/runs", endpoint=endpoint)
    return job.credentials("s3").build()


def test_the_observer_reads_the_store_with_the_job_s_credentials(
    admin: client.ApiClient, ns: str, minio_server: MinioServer
) -> None:
    core = client.CoreV1Api(admin)
    prefix = "observer-" + secrets.token_hex(4)
    put_json(minio_server, f"{prefix}/models/smol/config.json", SMOLLM2_135M_CONFIG)
    record = {
        "step": 3,
        "totalSteps": 100,
        "loss": 1.25,
        "tokensPerSecond": 0.0,
        "lastCommittedStep": 2,
    }
    put_json(minio_server, f"{prefix}/runs/{ns}/j/progress.json", record)
    job = store_job(ns, minio_server, prefix, minio_server.url)
    observer = Observer(ClusterApi(admin))

    def observe(of: dict[str, Any] | None = None) -> Observed:
        return observer.observe(of or job, {}, {}, WANTED, datetime.now(UTC))

    def credentials(access_key: str, secret_key: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "s3"},
            "stringData": {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key},
        }

    # No Secret yet, or one without the keys the job names: the model cannot be read, and
    # the error names the field to fix; no progress.
    missing = observe()
    assert missing.model is not None and missing.model.config is None
    assert missing.model.error.startswith(
        f"spec.checkpoint.credentialsSecret.name: Secret 's3' does not exist in namespace "
        f"'{ns}'; create it with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    ), missing.model.error
    assert missing.progress is None
    core.create_namespaced_secret(ns, {"metadata": {"name": "s3"}, "stringData": {"key": "v"}})
    keyless = observe().model
    assert keyless is not None and keyless.error == (
        "spec.checkpoint.credentialsSecret.accessKeyKey: Secret 's3' has no key "
        "'AWS_ACCESS_KEY_ID' (it has: key)"
    )
    core.delete_namespaced_secret("s3", ns)

    # Keys the store does not know: the model cannot be read (and says why); no progress.
    core.create_namespaced_secret(ns, credentials("nobody", "not-a-secret-key"))
    refused = observe()
    assert refused.model is not None and refused.model.config is None
    assert "InvalidAccessKeyId" in refused.model.error
    assert refused.progress is None

    # The Secret now holds the store's keys: the next pass reads both with them.
    core.replace_namespaced_secret(
        "s3", ns, credentials(minio_server.access_key, minio_server.secret_key)
    )
    read = observe()
    assert read.model is not None and read.model.config == SMOLLM2_135M_CONFIG
    assert read.progress is not None
    assert read.progress.status == {
        "step": 3,
        "totalSteps": 100,
        "stepOfTotal": "3/100",
        "loss": 1.25,
        "tokensPerSecond": 0.0,
        "lastCommittedStep": 2,
    }

    # Without the Secret the store is not asked at all: no progress, and the model config,
    # though read before, is not served from the cache (every job's credentials are
    # checked, whatever an earlier read found).
    core.delete_namespaced_secret("s3", ns)
    anonymous = observe()
    assert anonymous.progress is None and anonymous.model is not None
    assert anonymous.model.config is None and anonymous.model.error.startswith(
        "spec.checkpoint.credentialsSecret.name: Secret 's3' does not exist"
    )

    # With its keys again, a progress.json that is not there yet is no progress either.
    core.create_namespaced_secret(ns, credentials(minio_server.access_key, minio_server.secret_key))
    minio_server.client().remove_object(minio_server.bucket, f"{prefix}/runs/{ns}/j/progress.json")
    assert observe().progress is None

    # A store that does not answer: the model says so, and the progress stays unknown.
    down = store_job(ns, minio_server, prefix + "-down", "http://127.0.0.1:9")
    unreachable = observe(down)
    assert unreachable.model is not None and unreachable.model.config is None
    assert "reading config.json under" in unreachable.model.error
    assert unreachable.progress is None
