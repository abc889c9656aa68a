"""The README's commands that need everything: `make demo` and `relaytrain run --local`,
each run as written (docs/commands.yaml names these tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from relaytrain_testkit.demo_job import MadeDemo
from relaytrain_testkit.doc_commands import Shell, clean_env, doc_commands
from relaytrain_testkit.jobs import Job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _documented(command: str) -> None:
    """The test runs what the docs show; when the docs change, so must the test."""
    assert command in {c.text for c in doc_commands()}, f"no doc shows {command!r} any more"


def test_run_local_runs_as_written(tmp_path: Path) -> None:
    """`relaytrain run --local JOB.yaml`, JOB.yaml a tiny random Llama on a small data set."""
    from relaytrain_testkit.tiny_models import CORPUS, tiny_model_dir

    command = "relaytrain run --local JOB.yaml"
    _documented(command)
    tiny_model_dir(tmp_path / "model", layers=4)
    with (tmp_path / "data.jsonl").open("w") as f:
        for i in range(16):
            record = {"prompt": f"q{i}: {CORPUS[i % 5][:12]}", "completion": CORPUS[(i + 1) % 5]}
            f.write(json.dumps(record) + "\n")
    (
        Job("doc-local")
        .model(str(tmp_path / "model"), dtype="float32")
        .dataset(str(tmp_path / "data.jsonl"), format="prompt-completion", sequence_length=24)
        .method("lora", rank=4, alpha=8)
        .training(steps=3, micro_batch_size=2, micro_batches=2)
        .pipeline(stages=2, compression="int8")
        .checkpoint(str(tmp_path / "checkpoints"), every_steps=3)
        .write(tmp_path / "JOB.yaml")
    )
    result = Shell(clean_env(), tmp_path).run(command, timeout=600)
    assert result.rc == 0, result.output
    assert "finalLoss" in result.output
    state_dir = tmp_path / "relaytrain-local" / "default" / "doc-local"  # one per job
    summary = json.loads((state_dir / "summary.json").read_text())
    assert summary, result.output
    adapter = tmp_path / "checkpoints" / "default" / "doc-local" / "output"
    assert (adapter / "adapter_model.safetensors").is_file(), result.output


def test_make_demo_runs_as_written(made_demo: MadeDemo) -> None:
    """`make demo` in the repository, as a user types it: the session's one run (the
    `made_demo` fixture, tests/e2e/conftest.py; test_loss_curves reads its losses too)."""
    command = "make demo"
    _documented(command)
    result = made_demo.result
    assert result.rc == 0, result.output[-20000:]
    for line in (
        "[demo] Killed stage p1/s1's process",
        "[demo] Job Running but Degraded:",
        "[demo] Pipeline 1 is back",
        "no rollback",
        "'s replacement: Stage p1/s1 rejoined at step",
        "(falling)",
        "kept its pod and process",
        "[demo]   with the adapter:",
        "[demo] Stopped the operator, the stage processes, MinIO and the cluster.",
    ):
        assert line in result.output, result.output[-20000:]
