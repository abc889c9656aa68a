"""The stage document as the worker reads it (relaytrain_contract, docs/stage-contract.md)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from relaytrain_contract import CONFIG_ENV, ConfigError, StageConfig
from relaytrain_contract.exits import TERMINATION_LOG_ENV, StageExit
from relaytrain_testkit.stage_document import DOC

pytestmark = pytest.mark.unit


def test_the_contract_example_round_trips() -> None:
    cfg = StageConfig.from_json(json.dumps(DOC))
    assert cfg.stage.layer_start == 10 and cfg.method.target_modules[0] == "q_proj"
    assert cfg.to_dict() == json.loads(json.dumps(DOC))


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[leaf]
    else:
        node[leaf] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("training.extra", 1, r"^training\.extra: unknown field$"),
        ("method.rank", KeyError, r"^method\.rank: required$"),
        ("method.rank", 0, r"^method\.rank: must be >= 1, got 0$"),
        (
            "pipeline.compression",
            "zstd",
            r"^pipeline\.compression: should be 'none', .* \(got 'zstd'\)$",
        ),
        ("training.steps", "100", r"^training\.steps: should be a valid integer \(got '100'\)$"),
        (
            "training.microBatches",
            0,
            r"^training\.microBatches: should be greater than or equal to 1 \(got",
        ),
        ("stage.layerEnd", 5, r"^stage\.layerEnd: must be above layerStart \(10\), got 5$"),
        ("links.listen", None, r"^links\.listen: is null but prevIdentity is set$"),
        ("links.prevIdentity", None, r"^links\.prevIdentity: is null but listen is set$"),
        ("links.secretEnv", "RELAYTRAIN_LINK_SECRET", r"^links\.secretEnv: unknown field$"),
        ("apiVersion", "relaytrain.io/v2", r"^apiVersion: expected 'relaytrain\.io/v1alpha1'"),
        ("dataset.packing", "yes", r"^dataset\.packing: should be a valid boolean \(got 'yes'\)$"),
        ("checkpoint.accessKeyEnv", None, r"^checkpoint\.accessKeyEnv: is null but secretKeyEnv"),
        (
            "observability.port",
            70000,
            r"^observability\.port: should be less than or equal to 65535",
        ),
    ],
)
def test_bad_documents_name_the_field(path: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StageConfig.from_json(_with(path, value))


def test_epochs_instead_of_steps() -> None:
    doc = _with("training.steps", None)
    doc["training"]["epochs"] = 2
    assert StageConfig.from_json(doc).training.epochs == 2
    doc["training"]["steps"] = 5
    with pytest.raises(ConfigError, match="exactly one of steps and epochs"):
        StageConfig.from_json(doc)


def test_a_document_that_is_not_json_says_so() -> None:
    with pytest.raises(ConfigError, match=r"^stage config: Invalid JSON"):
        StageConfig.from_json("{not json")


def test_the_worker_refuses_a_bad_document_at_start_up(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker_root = Path(__file__).resolve().parents[2] / "worker_image"
    bad = _with("training.microBatchSize", "4")
    said = tmp_path / "termination-log"  # where a kubelet's file would be
    env = {
        **os.environ,
        "PYTHONPATH": str(worker_root),
        CONFIG_ENV: json.dumps(bad),
        TERMINATION_LOG_ENV: str(said),
    }
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain_worker"],
        capture_output=True, text=True, check=False, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == StageExit.INVALID_CONFIG == 2
    line = (
        "relaytrain-worker: invalid stage config: training.microBatchSize: should be a valid "
        "integer (got '4')"
    )
    assert line in done.stderr
    # The same line is the container's termination message, which the operator quotes.
    assert said.read_text() == line
    env.pop(TERMINATION_LOG_ENV)
    # The same from a file, for a constraint rather than a type.
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(_with("method.rank", 0)))
    env.pop(CONFIG_ENV)
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain_worker", "--config", str(path)],
        capture_output=True, text=True, check=False, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert "invalid stage config: method.rank: must be >= 1, got 0" in done.stderr


def test_a_store_that_refuses_the_keys_ends_the_stage_in_one_line_with_its_code(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad keys are an answer, not an outage: one line naming the store's code and what to
    check, the termination message, and the code the operator does not retry. An error that
    is no answer of the store's goes up as the crash it is."""
    from minio.error import S3Error
    from relaytrain_worker.__main__ import _store_failure
    from relaytrain_worker.state.store import StoreError

    said = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(said))
    answer = S3Error(None, "SignatureDoesNotMatch", "no", "/b", "r", "h", bucket_name="b")  # type: ignore[arg-type]
    try:
        raise StoreError("cannot open bucket 'b'") from answer
    except StoreError as wrapped:
        code = _store_failure("stage p1/s0", wrapped)
    assert code == StageExit.STORE_REFUSED == 5
    line = (
        "relaytrain-worker: stage p1/s0: the object store refused s3://b (SignatureDoesNotMatch: "
        "the secret key does not match the access key); check "
        "spec.checkpoint.credentialsSecret (its keys) and the bucket in the job's URIs"
    )
    assert capsys.readouterr().err.strip() == line and said.read_text() == line
    assert _store_failure("stage 0", StoreError("the store did not answer")) == StageExit.FAILED
    with pytest.raises(ZeroDivisionError):
        _store_failure("stage 0", ZeroDivisionError("a bug"))
