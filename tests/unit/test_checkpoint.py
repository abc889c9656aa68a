"""Committed checkpoints on a local store: commit rule, verification, fallback, pruning."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from relaytrain_worker.state import checkpoint as ckpt
from relaytrain_worker.state.checkpoint import CheckpointError, CorruptCheckpoint
from relaytrain_worker.state.store import LocalStore

pytestmark = pytest.mark.unit

JOB = "default/smollm-lora"


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "ckpt")


def _files(step: int, stage: int) -> dict[str, bytes]:
    return {
        "adapter.safetensors": ckpt.tensors_to_bytes({"w": torch.full((4,), float(step))}),
        "state.json": ckpt.json_to_bytes({"step": step, "stage": stage}),
    }


def _save_all(store: LocalStore, step: int, stages: int = 3) -> None:
    for k in range(stages):
        ckpt.save_stage(store, JOB, step, k, _files(step, k))
    assert ckpt.try_commit(store, JOB, step, stages)


def test_a_step_commits_only_once_every_stage_has_saved(store: LocalStore) -> None:
    ckpt.save_stage(store, JOB, 10, 0, _files(10, 0))
    ckpt.save_stage(store, JOB, 10, 2, _files(10, 2))
    assert not ckpt.try_commit(store, JOB, 10, 3)
    assert ckpt.latest_committed(store, JOB) is None
    assert not store.exists(ckpt.manifest_key(JOB, 10))
    with pytest.raises(CheckpointError, match="not committed"):
        ckpt.load_stage(store, JOB, 10, 0)

    ckpt.save_stage(store, JOB, 10, 1, _files(10, 1))
    assert ckpt.try_commit(store, JOB, 10, 3)
    assert ckpt.try_commit(store, JOB, 10, 3)  # idempotent
    assert ckpt.latest_committed(store, JOB, verify_files=True) == 10
    assert ckpt.load_stage(store, JOB, 10, 1) == _files(10, 1)
    manifest = json.loads(store.get(f"{JOB}/step-10/manifest.json"))
    listed = manifest["body"]["stages"]["2"]["files"]
    assert set(listed) == {"adapter.safetensors", "state.json"}
    assert all(len(f["sha256"]) == 64 for f in listed.values())


def test_a_survivor_can_check_its_own_copy_against_the_commit(store: LocalStore) -> None:
    _save_all(store, 10)
    assert ckpt.matches_commit(store, JOB, 10, 1, _files(10, 1))
    assert not ckpt.matches_commit(store, JOB, 10, 1, _files(10, 2))
    assert not ckpt.matches_commit(store, JOB, 10, 1, {**_files(10, 1), "extra": b""})
    assert not ckpt.matches_commit(store, JOB, 10, 7, _files(10, 1))


def test_partial_newer_step_is_ignored(store: LocalStore) -> None:
    _save_all(store, 10)
    ckpt.save_stage(store, JOB, 20, 0, _files(20, 0))  # stage 1 and 2 died before saving
    assert ckpt.latest_committed(store, JOB) == 10


def test_corrupt_manifest_falls_back_to_the_previous_commit(store: LocalStore) -> None:
    _save_all(store, 10)
    _save_all(store, 20)
    key = ckpt.manifest_key(JOB, 20)
    doc = json.loads(store.get(key))
    doc["body"]["stages"]["0"]["files"]["state.json"]["size"] += 1  # valid JSON, wrong body
    store.put(key, json.dumps(doc).encode())
    assert ckpt.latest_committed(store, JOB) == 10
    with pytest.raises(CorruptCheckpoint, match=r"manifest default/smollm-lora/step-20/.*checksum"):
        ckpt.load_stage(store, JOB, 20, 0)

    store.put(key, b'{"body": {"step": 2')  # truncated
    assert ckpt.latest_committed(store, JOB) == 10
    with pytest.raises(CorruptCheckpoint, match=r"manifest .*step-20/manifest\.json is corrupt"):
        ckpt.load_stage(store, JOB, 20, 1)


def test_corrupt_or_missing_file_is_named_and_never_restored(store: LocalStore) -> None:
    _save_all(store, 10)
    _save_all(store, 20)
    bad = f"{JOB}/step-20/stage-1/adapter.safetensors"
    data = bytearray(store.get(bad))
    data[-1] ^= 0xFF
    store.put(bad, bytes(data))
    with pytest.raises(CorruptCheckpoint, match=f"checkpoint file {bad} is corrupt"):
        ckpt.load_stage(store, JOB, 20, 1)
    assert ckpt.load_stage(store, JOB, 20, 0) == _files(20, 0)  # other stages still verify
    assert ckpt.latest_committed(store, JOB, verify_files=True) == 10
    assert ckpt.latest_committed(store, JOB) == 20  # the cheap check reads manifests only

    store.delete(f"{JOB}/step-10/stage-2/state.json")
    with pytest.raises(CorruptCheckpoint, match=r"stage-2/state\.json is missing"):
        ckpt.load_stage(store, JOB, 10, 2)
    assert ckpt.latest_committed(store, JOB, verify_files=True) is None


def test_committed_steps_are_never_overwritten(store: LocalStore) -> None:
    _save_all(store, 10)
    with pytest.raises(CheckpointError, match="already committed"):
        ckpt.save_stage(store, JOB, 10, 0, {"adapter.safetensors": b"new"})
    assert ckpt.load_stage(store, JOB, 10, 0) == _files(10, 0)


def test_nothing_is_committed_behind_the_newest_checkpoint(store: LocalStore) -> None:
    # A writer the job went on without (cut off from the other pipelines) comes back at
    # step 10 while the job has committed 10 and 20 and pruned 10: it must not re-create
    # step 10 behind step 20.
    _save_all(store, 10)
    _save_all(store, 20)
    assert ckpt.prune(store, JOB, keep=1) == [10]
    with pytest.raises(CheckpointError, match=r"step 20 of .* is already committed, after step 15"):
        ckpt.save_stage(store, JOB, 15, 0, {"adapter.safetensors": b"stale"}, pipeline=1)
    assert ckpt.committed_steps(store, JOB)[-1] == 20
    # A rollback removes the later steps first; then the step is written again.
    ckpt.discard_after(store, JOB, 10)
    ckpt.save_stage(store, JOB, 15, 0, {"adapter.safetensors": b"retrained"})


def test_a_retried_step_never_commits_a_stale_listing(store: LocalStore) -> None:
    ckpt.save_stage(store, JOB, 20, 0, {"a.bin": b"first attempt"})
    # Recovery rolls back; on the rerun stage 0 rewrites its files.
    ckpt.save_stage(store, JOB, 20, 0, {"a.bin": b"second attempt"})
    ckpt.save_stage(store, JOB, 20, 1, {"a.bin": b"stage 1"})
    assert ckpt.try_commit(store, JOB, 20, 2)
    assert ckpt.load_stage(store, JOB, 20, 0) == {"a.bin": b"second attempt"}


def test_prune_keeps_the_newest_n_commits_and_in_flight_steps(store: LocalStore) -> None:
    for step in (10, 20):
        _save_all(store, step)
    ckpt.save_stage(store, JOB, 25, 0, _files(25, 0))  # abandoned partial step
    for step in (30, 40):
        _save_all(store, step)
    ckpt.save_stage(store, JOB, 50, 0, _files(50, 0))  # in flight right now
    assert ckpt.prune(store, JOB, keep=2) == [10, 20, 25]
    assert ckpt.list_steps(store, JOB) == [30, 40, 50]
    assert ckpt.committed_steps(store, JOB) == [30, 40]
    assert ckpt.prune(store, JOB, keep=2) == []
    assert ckpt.load_stage(store, JOB, 30, 2) == _files(30, 2)
    assert not (store.root / JOB / "step-10").exists()  # no empty directories left behind
    with pytest.raises(ValueError, match="keep must be >= 1"):
        ckpt.prune(store, JOB, keep=0)


def test_prune_never_deletes_the_last_good_commit_behind_a_corrupt_one(store: LocalStore) -> None:
    _save_all(store, 10)
    _save_all(store, 20)
    store.put(ckpt.manifest_key(JOB, 20), b"garbage")
    assert ckpt.prune(store, JOB, keep=1) == []
    assert ckpt.latest_committed(store, JOB) == 10


def test_discard_after_clears_the_way_for_a_rerun(store: LocalStore) -> None:
    _save_all(store, 10)
    _save_all(store, 20)
    ckpt.save_stage(store, JOB, 30, 1, _files(30, 1))
    assert ckpt.discard_after(store, JOB, 10) == [20, 30]
    assert ckpt.list_steps(store, JOB) == [10]
    _save_all(store, 20)  # the rerun can write step 20 again
    assert ckpt.latest_committed(store, JOB, verify_files=True) == 20


def test_tensors_and_json_round_trip() -> None:
    w = torch.randn(8, 4)
    tensors = {"w": w, "w_t": w, "b": torch.randn(3).to(torch.bfloat16), "n": torch.tensor(7)}
    back = ckpt.tensors_from_bytes(ckpt.tensors_to_bytes(tensors))  # shared storage is fine
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    doc = {"epoch": 1, "offset": 12345, "files": ["a.jsonl"]}
    assert ckpt.json_from_bytes(ckpt.json_to_bytes(doc)) == doc


def _train(opt: torch.optim.Optimizer, p: torch.nn.Parameter, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        (p**2).sum().backward()
        opt.step()


def test_optimizer_state_round_trip_continues_identically() -> None:
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(5))
    opt1 = torch.optim.AdamW([p1], lr=0.1)
    _train(opt1, p1, 3)
    saved, params = ckpt.optimizer_to_bytes(opt1.state_dict()), p1.detach().clone()
    _train(opt1, p1, 2)

    p2 = torch.nn.Parameter(params)
    opt2 = torch.optim.AdamW([p2], lr=0.5)  # hyper-parameters come back from the file
    opt2.load_state_dict(ckpt.optimizer_from_bytes(saved))
    _train(opt2, p2, 2)
    assert torch.equal(p1, p2)


def test_rng_states_round_trip() -> None:
    saved = ckpt.rng_to_bytes()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    ckpt.restore_rng(saved)
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert np.array_equal(first[2], again[2])


def test_a_commit_by_another_pipeline_names_its_split_and_its_files_are_apart(
    store: LocalStore,
) -> None:
    # Pipeline 0 is out: pipeline 1 (two stages, not pipeline 0's three) writes step 20.
    _save_all(store, 10)
    for k in range(2):
        ckpt.save_stage(store, JOB, 20, k, _files(20, k), pipeline=1)
    assert not ckpt.try_commit(store, JOB, 20, 2)  # pipeline 0's stages saved nothing
    assert ckpt.try_commit(store, JOB, 20, 2, pipeline=1)
    assert ckpt.committed_by(store, JOB, 20) == (1, 2)
    assert ckpt.committed_by(store, JOB, 10) == (0, 3)
    assert ckpt.stage_key(JOB, 20, 1, 1).endswith("step-20/p1/stage-1")
    assert store.exists(f"{JOB}/step-20/p1/stage-1/files.json")
    assert not store.exists(f"{JOB}/step-20/stage-1/files.json")
    assert ckpt.load_stage(store, JOB, 20, 1) == _files(20, 1)
    assert ckpt.latest_committed(store, JOB, verify_files=True) == 20
    # A kept copy is pipeline 1's only when pipeline 1 wrote the step.
    assert ckpt.matches_commit(store, JOB, 20, 1, _files(20, 1), pipeline=1)
    assert not ckpt.matches_commit(store, JOB, 20, 1, _files(20, 1))
    # A manifest written before pipelines were recorded is pipeline 0's.
    key = ckpt.manifest_key(JOB, 10)
    doc = json.loads(store.get(key))
    del doc["body"]["pipeline"]
    doc["sha256"] = ckpt._sha256(ckpt._canonical(doc["body"]))
    store.put(key, ckpt._canonical(doc))
    assert ckpt.committed_by(store, JOB, 10) == (0, 3)
    assert ckpt.load_stage(store, JOB, 10, 2) == _files(10, 2)


def test_a_listing_of_another_pipeline_is_not_committed_as_this_ones(store: LocalStore) -> None:
    ckpt.save_stage(store, JOB, 10, 0, _files(10, 0), pipeline=1)
    listing = f"{JOB}/step-10/p1/stage-0/files.json"
    doc = json.loads(store.get(listing))
    doc["pipeline"] = 2
    store.put(listing, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpoint, match="pipeline 2"):
        ckpt.try_commit(store, JOB, 10, 1, pipeline=1)


def test_a_pipeline_saving_a_step_another_committed_is_refused(store: LocalStore) -> None:
    # Two pipelines cut apart each took itself for the lowest left: the first commit wins.
    ckpt.save_stage(store, JOB, 10, 0, _files(10, 0), pipeline=1)
    assert ckpt.try_commit(store, JOB, 10, 1, pipeline=1)
    with pytest.raises(CheckpointError, match="already committed"):
        ckpt.save_stage(store, JOB, 10, 0, _files(10, 0))
    assert ckpt.committed_by(store, JOB, 10) == (1, 1)
