"""The writers' plan (names.PLAN_FILE) against a stage's own (`job.uid`, `job.planEpoch`):
which stages may still write checkpoints. The whole path, with real stage processes, is
tests/e2e/test_local_supervisor.py's `test_a_stage_of_a_replaced_plan_commits_nothing_more`;
the operator's side, tests/unit/test_operator_decide_resplit.py and _growth.py."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
from relaytrain_contract import ConfigError, StageConfig
from relaytrain_contract.fence import plan_document, superseded_by
from relaytrain_testkit.stage_document import DOC
from relaytrain_worker.state.fence import SupersededError, check_writer, plan_key
from relaytrain_worker.state.store import LocalStore

pytestmark = pytest.mark.unit

PREFIX = "default/smollm-lora"


def _stage(epoch: int) -> StageConfig:
    doc = copy.deepcopy(DOC)
    doc["job"]["planEpoch"] = epoch
    return StageConfig.from_json(doc)


def test_who_may_write_follows_the_incarnation_and_the_newest_plan() -> None:
    assert superseded_by(plan_document("u1", 2), "u1", 2) is None
    # The operator has not named a newer plan yet (or the write failed): nothing is taken.
    assert superseded_by(plan_document("u1", 1), "u1", 2) is None
    assert superseded_by(plan_document("u1", 3), "u1", 2) == (
        "every stage of the job was replaced by plan 3's (this stage is of plan 2)"
    )
    # Another incarnation's document (a job of the same name deleted and created again over
    # the same store, before its operator names a plan there) is not this job's to decide.
    assert superseded_by(plan_document("u2", 7), "u1", 0) is None
    for bad in ({"uid": "u1"}, {"uid": 1, "epoch": 0}, {"uid": "u1", "epoch": True}):
        with pytest.raises(ValueError, match="not"):
            superseded_by(bad, "u1", 0)


def test_a_stage_checks_the_store_before_it_writes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    stage = _stage(1)
    check_writer(store, PREFIX, stage, 20)  # no document: a plan never replaced
    store.put(plan_key(PREFIX), json.dumps(plan_document("u1", 1)).encode())
    check_writer(store, PREFIX, stage, 20)
    store.put(plan_key(PREFIX), json.dumps(plan_document("u1", 2)).encode())
    with pytest.raises(SupersededError, match="stops without writing step 40: every stage"):
        check_writer(store, PREFIX, stage, 40)
    # A document that is not one is said, and takes nothing away.
    store.put(plan_key(PREFIX), b"[1, 2]")
    with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
        check_writer(store, PREFIX, stage, 40)
    assert "Could not read plan.json of default/smollm-lora: not a JSON object" in caplog.text


def test_the_epoch_travels_in_the_document_only_once_a_plan_was_replaced() -> None:
    assert "planEpoch" not in _stage(0).to_dict()["job"]
    assert _stage(3).to_dict()["job"]["planEpoch"] == 3
    with pytest.raises(ConfigError, match=r"job\.planEpoch"):
        _stage(-1)
