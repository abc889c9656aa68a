"""The local-directory store and the progress record written through it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from relaytrain_worker.state.progress import Progress, read_progress, write_progress
from relaytrain_worker.state.store import LocalStore, ObjectNotFound, S3Store, Store, open_store

pytestmark = pytest.mark.unit


def test_local_store_put_get_list_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert isinstance(store, Store)
    store.put("ns/job/step-1/stage-0/a.bin", b"abc")
    store.put("ns/job/step-1/stage-0/a.bin", b"replaced")
    store.put("ns/job/step-10/manifest.json", b"{}")
    store.put("ns/other/x", b"")
    assert store.get("ns/job/step-1/stage-0/a.bin") == b"replaced"
    assert store.exists("ns/other/x") and not store.exists("ns/job/nothing")
    assert store.list("ns/job/step-1") == [
        "ns/job/step-1/stage-0/a.bin",
        "ns/job/step-10/manifest.json",
    ]
    assert store.list("ns/job/step-1/") == ["ns/job/step-1/stage-0/a.bin"]
    assert store.list("nowhere/") == []
    store.delete("ns/job/step-1/stage-0/a.bin")
    store.delete("ns/job/step-1/stage-0/a.bin")  # missing is fine
    assert not (tmp_path / "ns/job/step-1").exists()
    with pytest.raises(ObjectNotFound, match=r"ns/job/step-1/stage-0/a\.bin not found"):
        store.get("ns/job/step-1/stage-0/a.bin")


def test_local_store_writes_atomically_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"x" * 1000)
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b"]
    # A write that fails half-way leaves the old object and no debris.
    with pytest.raises(TypeError):
        store.put("a/b", object())  # type: ignore[arg-type]
    assert store.get("a/b") == b"x" * 1000
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_keys_cannot_escape_the_store(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="invalid store key"):
        LocalStore(tmp_path).put(key, b"")


def test_open_store_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path / "a")), LocalStore)
    local = open_store(f"file://{tmp_path}/b")
    assert isinstance(local, LocalStore) and local.root == tmp_path / "b"
    with pytest.raises(ValueError, match="names no bucket"):
        open_store("s3:///prefix", endpoint="localhost:9000")
    with pytest.raises(ValueError, match="unsupported store URI"):
        open_store("gs://bucket/x")
    assert S3Store.__init__.__kwdefaults__ == {
        "access_key": None,
        "secret_key": None,
        "secure": False,
        "session_token": None,
        "region": None,
    }


def test_progress_round_trip_in_the_contract_format(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert read_progress(store, "default/job") is None
    write_progress(
        store,
        "default/job",
        Progress(step=12, totalSteps=100, loss=2.31, tokensPerSecond=812.5, lastCommittedStep=10),
    )
    doc = json.loads((tmp_path / "default/job/progress.json").read_text())
    assert set(doc) == {
        "step", "totalSteps", "loss", "tokensPerSecond", "lastCommittedStep", "updatedAt", "done",
    }  # fmt: skip
    assert doc["updatedAt"].endswith("Z") and doc["lastCommittedStep"] == 10
    back = read_progress(store, "default/job")
    assert back is not None and (back.step, back.loss, back.done) == (12, 2.31, False)

    write_progress(store, "default/job", Progress(step=100, totalSteps=100, loss=math.nan,
                   tokensPerSecond=0.0, lastCommittedStep=100, done=True,
                   output="s3://out/adapter/"))  # fmt: skip
    doc = json.loads((tmp_path / "default/job/progress.json").read_text())
    assert doc["loss"] is None and doc["done"] is True and doc["output"] == "s3://out/adapter/"
    with pytest.raises(ValueError, match="step 101 of 100"):
        Progress(step=101, totalSteps=100, loss=1.0, tokensPerSecond=0.0)


def test_a_writer_that_may_not_be_alone_never_moves_progress_back(tmp_path: Path) -> None:
    # Two pipelines cut apart each take themselves for the writer; the one behind (found by
    # the live partition test: it wrote step 12 over the finished job's step 200) must not
    # make the job look unfinished or earlier.
    store = LocalStore(tmp_path)

    def record(step: int, done: bool = False) -> Progress:
        return Progress(step=step, totalSteps=200, loss=1.0, tokensPerSecond=1.0, done=done)

    assert write_progress(store, "j", record(20), unless_behind=True)
    assert not write_progress(store, "j", record(12), unless_behind=True)
    assert write_progress(store, "j", record(21), unless_behind=True)
    assert write_progress(store, "j", record(200, done=True), unless_behind=True)
    assert not write_progress(store, "j", record(200), unless_behind=True)
    progress = read_progress(store, "j")
    assert progress is not None and progress.done and progress.step == 200
    # A writer sure to be alone writes what it is told (a rollback may go back).
    assert write_progress(store, "j", record(54))
    assert read_progress(store, "j").step == 54  # type: ignore[union-attr]


def test_an_s3_uri_without_an_endpoint_is_aws_s3(
    fake_minio: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # checkpoint.endpoint empty means AWS S3 (spec/job.py); the store must agree.
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    store = open_store("s3://team-bucket/ckpt", None, "AKIAEXAMPLE", "secret")
    assert isinstance(store, S3Store)
    assert (store.endpoint, store.secure, store.region) == ("s3.amazonaws.com", True, "eu-west-1")
    assert (store.bucket, store.prefix) == ("team-bucket", "ckpt")
    assert fake_minio[-1]["endpoint"] == "s3.amazonaws.com"
    assert fake_minio[-1]["secure"] is True and fake_minio[-1]["region"] == "eu-west-1"
    assert fake_minio[-1]["access_key"] == "AKIAEXAMPLE"
