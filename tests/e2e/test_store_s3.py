"""The S3 store and committed checkpoints against a real MinIO server."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path

import pytest
from relaytrain_testkit.harness.minio_server import MinioServer, start_minio, stop_minio
from relaytrain_worker.state import checkpoint as ckpt
from relaytrain_worker.state.checkpoint import CorruptCheckpoint
from relaytrain_worker.state.progress import Progress, read_progress, write_progress
from relaytrain_worker.state.store import (
    ObjectNotFound,
    S3Store,
    StoreError,
    open_store,
    refusal,
)

pytestmark = pytest.mark.e2e

JOB = "default/smollm-lora"


def _store(minio: MinioServer, bucket: str | None = None) -> S3Store:
    prefix = "checkpoints-" + secrets.token_hex(4)  # every test starts from an empty prefix
    store = open_store(
        f"s3://{bucket or minio.bucket}/{prefix}",
        endpoint=minio.url,
        access_key=minio.access_key,
        secret_key=minio.secret_key,
    )
    assert isinstance(store, S3Store)
    return store


def test_s3_store_put_get_list_delete_and_multipart(minio_server: MinioServer) -> None:
    store = _store(minio_server)
    big = os.urandom(12 << 20)  # above the client's 5 MiB part size: a multipart upload
    store.put(f"{JOB}/step-1/stage-0/big.bin", big)
    store.put(f"{JOB}/step-10/manifest.json", b"{}")
    assert store.get(f"{JOB}/step-1/stage-0/big.bin") == big
    assert store.exists(f"{JOB}/step-10/manifest.json")
    assert not store.exists(f"{JOB}/step-2/manifest.json")
    assert store.list(f"{JOB}/step-1/") == [f"{JOB}/step-1/stage-0/big.bin"]
    assert store.list(f"{JOB}/step-1") == [
        f"{JOB}/step-1/stage-0/big.bin",
        f"{JOB}/step-10/manifest.json",
    ]
    store.delete(f"{JOB}/step-1/stage-0/big.bin")
    store.delete(f"{JOB}/step-1/stage-0/big.bin")  # missing is fine
    with pytest.raises(ObjectNotFound, match=r"big\.bin not found"):
        store.get(f"{JOB}/step-1/stage-0/big.bin")
    # The prefix isolates stores in one bucket.
    assert _store(minio_server).list("") == []


def test_s3_store_creates_a_missing_bucket(minio_server: MinioServer) -> None:
    bucket = "rt-new-" + secrets.token_hex(4)
    store = _store(minio_server, bucket)
    store.put("a/b", b"hello")
    assert minio_server.client().bucket_exists(bucket)
    assert store.get("a/b") == b"hello"


def test_checkpoints_commit_fall_back_and_prune_on_s3(minio_server: MinioServer) -> None:
    store = _store(minio_server)
    for step in (10, 20, 30):
        for k in range(2):
            ckpt.save_stage(store, JOB, step, k, {"adapter.safetensors": f"{step}/{k}".encode()})
        assert not ckpt.try_commit(store, JOB, step, 3)
        ckpt.save_stage(store, JOB, step, 2, {"adapter.safetensors": f"{step}/2".encode()})
        assert ckpt.try_commit(store, JOB, step, 3)
    store.put(f"{JOB}/step-30/stage-1/adapter.safetensors", b"bit rot")
    with pytest.raises(CorruptCheckpoint, match=r"step-30/stage-1/adapter\.safetensors is corrupt"):
        ckpt.load_stage(store, JOB, 30, 1)
    assert ckpt.latest_committed(store, JOB, verify_files=True) == 20
    assert ckpt.load_stage(store, JOB, 20, 1) == {"adapter.safetensors": b"20/1"}
    assert ckpt.prune(store, JOB, keep=2) == [10]
    assert ckpt.list_steps(store, JOB) == [20, 30]

    write_progress(
        store,
        JOB,
        Progress(step=30, totalSteps=100, loss=1.5, tokensPerSecond=99.0, lastCommittedStep=20),
    )
    progress = read_progress(store, JOB)
    assert progress is not None and progress.last_committed_step == 20


@pytest.mark.timeout(600)  # retrying for ever would end here
def test_a_store_that_goes_down_is_waited_for_and_a_refusal_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A MinIO of its own, stopped and started again at the same address: an operation
    issued while it is down waits and then succeeds; one that outlasts the retry budget
    fails; wrong keys fail at once (no retry: the store's retry warning is never logged)."""
    caplog.set_level(logging.WARNING, logger="relaytrain.store")
    proc, server = start_minio(tmp_path / "data", tmp_path / "minio.log")
    try:
        server.client().make_bucket(server.bucket)
        store = _store(server)
        store.put(f"{JOB}/before", b"1")
        stop_minio(proc)
        took: dict[str, float] = {}

        def put_while_down() -> None:
            started = time.monotonic()
            store.put(f"{JOB}/during", b"2")
            took["put"] = time.monotonic() - started

        writer = threading.Thread(target=put_while_down)
        writer.start()
        outage = 12.0  # longer than the minio client's own retries (about 6 s)
        time.sleep(outage)  # the outage: the store stays down this long
        assert writer.is_alive(), "the put returned while the store was down"
        proc, _ = start_minio(tmp_path / "data", tmp_path / "minio.log", again=server)
        writer.join(timeout=120)
        assert not writer.is_alive() and took["put"] >= outage, took
        assert any("did not answer" in r.message for r in caplog.records)  # it said so
        assert store.get(f"{JOB}/during") == b"2" and store.get(f"{JOB}/before") == b"1"
        # Down for longer than the budget: the error comes out.
        stop_minio(proc)
        store.retry_seconds = 2.0
        started = time.monotonic()
        with pytest.raises(Exception) as down:
            store.get(f"{JOB}/before")
        assert time.monotonic() - started >= 2.0, down.value  # the budget, waited out
        proc, _ = start_minio(tmp_path / "data", tmp_path / "minio.log", again=server)
        # Wrong keys are an answer, not an outage: no retries.
        caplog.clear()
        with pytest.raises(StoreError, match="cannot open bucket") as refused:
            open_store(f"s3://{server.bucket}/x", endpoint=server.url,
                       access_key=server.access_key, secret_key="not-the-key")  # fmt: skip
        assert [r.message for r in caplog.records if "did not answer" in r.message] == []
        # ... which a stage ends on, in one line (its exit code says: do not retry).
        assert refusal(refused.value) == (
            f"the object store refused s3://{server.bucket} (SignatureDoesNotMatch: the secret "
            "key does not match the access key); check spec.checkpoint.credentialsSecret (its "
            "keys) and the bucket in the job's URIs"
        )
        assert refusal(down.value) is None  # an outage is no refusal
    finally:
        stop_minio(proc)
