"""The local-directory store and the progress record written through it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from relaytrain_worker.progress import Progress, read_progress, write_progress
from relaytrain_worker.store import LocalStore, ObjectNotFound, S3Store, Store, open_store

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
    with pytest.raises(ValueError, match="needs an S3 endpoint"):
        open_store("s3://bucket/prefix")
    with pytest.raises(ValueError, match="names no bucket"):
        open_store("s3:///prefix", endpoint="localhost:9000")
    with pytest.raises(ValueError, match="unsupported store URI"):
        open_store("gs://bucket/x")
    assert S3Store.__init__.__kwdefaults__ == {
        "access_key": None,
        "secret_key": None,
        "secure": False,
    }


def test_progress_round_trip_in_the_contract_format(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert read_progress(store, "default/job") is None
    write_progress(store, "default/job", Progress(12, 100, 2.31, 812.5, 10))
    doc = json.loads((tmp_path / "default/job/progress.json").read_text())
    assert set(doc) == {
        "step", "totalSteps", "loss", "tokensPerSecond", "lastCommittedStep", "updatedAt", "done",
    }  # fmt: skip
    assert doc["updatedAt"].endswith("Z") and doc["lastCommittedStep"] == 10
    back = read_progress(store, "default/job")
    assert back is not None and (back.step, back.loss, back.done) == (12, 2.31, False)

    write_progress(store, "default/job", Progress(100, 100, math.nan, 0.0, 100, done=True,
                                                  output="s3://out/adapter/"))  # fmt: skip
    doc = json.loads((tmp_path / "default/job/progress.json").read_text())
    assert doc["loss"] is None and doc["done"] is True and doc["output"] == "s3://out/adapter/"
    with pytest.raises(ValueError, match="step 101 of 100"):
        Progress(101, 100, 1.0, 0.0, None)
