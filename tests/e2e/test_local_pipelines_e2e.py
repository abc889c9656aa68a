"""Several pipelines trained as one job by real stage processes (`relaytrain run --local`).

Two pipelines of different splits — [0-1 | 2-3] and [0 | 1-2 | 3] — share each step's three
micro-batches 2:1, exchanging the token count and the gradients over their authenticated
replica links; every stage is its own `python -m relaytrain_worker`. What a user would
notice is checked against one pipeline training the same job and global batch: the loss
of every step and the final adapter are the same bits (the in-process proof of
test_worker_dataparallel, now through processes, their documents and their links), and so
is the job's tokens per step; pipeline 0 alone writes the checkpoints. A stage of pipeline
1 killed mid-run takes every pipeline back to the last commit, and the job still ends with
the same losses.

OMP_NUM_THREADS is pinned to 1 in every run so that both runs compute with the same
kernels whatever the machine's core count (`run --local` divides the cores among stages).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.local_jobs import (
    job_manifest,
    make_workspace,
    progress,
    run_state,
    start_run,
    wait_while_running,
    write_job,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 12
EVERY = 3
ENV = {"OMP_NUM_THREADS": "1"}
PIPELINES = ["--stages", "2,3"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("pipelines"), layers=4, records=48)


def _job(root: Path, name: str, replicas: int) -> Path:
    manifest = job_manifest(
        root,
        name,
        dataset={"sequenceLength": 24},
        method={"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]},
        training={"steps": STEPS, "microBatchSize": 2, "microBatches": 3,
                  "learningRate": 0.01, "warmupSteps": 1},
        pipeline={"stages": 2, "compression": "none", "replicas": replicas},
        checkpoint={"uri": str(root / "ckpt"), "everySteps": EVERY, "keep": 2},
    )  # fmt: skip
    return write_job(root, manifest)


def _run(root: Path, name: str, replicas: int, *flags: str) -> dict[str, Any]:
    proc = start_run(_job(root, name, replicas), root / f"wd-{name}", flags=flags, env=ENV)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return json.loads((root / f"wd-{name}" / "summary.json").read_text())


def _history(root: Path, name: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = json.loads(
        (root / "ckpt" / "default" / name / "loss-history.json").read_text()
    )
    return records


def _adapter(root: Path, name: str) -> dict[str, Any]:
    import safetensors.torch

    path = root / "ckpt" / "default" / name / "output" / "adapter_model.safetensors"
    return safetensors.torch.load_file(str(path))


def _step_tokens(root: Path, name: str) -> int:
    """Non-padding tokens of the last step, from progress.json: tokens/s x seconds."""
    record = progress(root / "ckpt", name)
    assert record is not None and record["done"]
    return round(record["tokensPerSecond"] * record["stepSeconds"])


@pytest.fixture(scope="module")
def one_pipeline(workspace: Path) -> list[float]:
    summary = _run(workspace, "one", 1)
    assert [p["stages"] for p in summary["pipelines"]] == [2]
    return [r["loss"] for r in _history(workspace, "one")]


def test_two_pipelines_train_the_same_bits_as_one(
    workspace: Path, one_pipeline: list[float]
) -> None:
    import torch

    # The job asks for 2 pipelines; the flag gives them 2 and 3 stages; the shares are the
    # planner's with every layer costing the same: 2 micro-batches and 1.
    summary = _run(workspace, "two", 2, *PIPELINES)
    assert summary["pipelines"] == [
        {"stages": 2, "layers": [[0, 2], [2, 4]], "microBatches": 2},
        {"stages": 3, "layers": [[0, 1], [1, 3], [3, 4]], "microBatches": 1},
    ]
    losses = [r["loss"] for r in _history(workspace, "two")]
    assert len(losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(losses, one_pipeline, strict=True))
    print(f"two pipelines vs one: largest per-step loss difference {worst!r} over {STEPS} steps")
    assert losses == one_pipeline  # bit for bit (what the 1e-6 bound allows, and more)
    assert losses[-1] < losses[0]
    mine, reference = _adapter(workspace, "two"), _adapter(workspace, "one")
    assert set(mine) == set(reference) and len(mine) == 16  # 4 layers x q, v x A, B
    assert all(torch.equal(mine[name], reference[name]) for name in mine)
    # progress.json speaks for the whole job: its loss is the global step's, its rate counts
    # every pipeline's tokens (pipeline 0 alone trains only two thirds of them).
    done = progress(workspace / "ckpt", "two")
    assert done is not None and done["loss"] == losses[-1] and done["step"] == STEPS
    assert _step_tokens(workspace, "two") == _step_tokens(workspace, "one")
    # One checkpoint writer: each commit holds pipeline 0's two stages, nothing else.
    job_dir = workspace / "ckpt" / "default" / "two"
    for step_dir in job_dir.glob("step-*"):
        assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json", "stage-0", "stage-1"]
    state = run_state(workspace / "wd-two")
    assert state is not None
    assert [(s["pipeline"], s["index"]) for s in state["stages"]] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (1, 2),
    ]  # fmt: skip
    logs = sorted(p.name for p in (workspace / "wd-two" / "stages").glob("*.log"))
    assert logs == [
        "p0-stage-0.log", "p0-stage-1.log", "p1-stage-0.log", "p1-stage-1.log", "p1-stage-2.log",
    ]  # fmt: skip


def test_a_stage_killed_in_one_pipeline_rolls_every_pipeline_back(
    workspace: Path, one_pipeline: list[float]
) -> None:
    name, workdir = "kill", workspace / "wd-kill"
    proc = start_run(
        _job(workspace, name, 2), workdir, flags=[*PIPELINES, "--shares", "2,1"], env=ENV
    )

    def past_first_commit() -> dict[str, Any] | None:
        at = progress(workspace / "ckpt", name)
        return at if at is not None and at["step"] >= EVERY + 1 else None

    at = wait_while_running("the step to kill at", past_first_commit, proc, interval=0.005)
    state = run_state(workdir)
    assert state is not None
    before = {(s["pipeline"], s["index"]): s["pid"] for s in state["stages"]}
    os.kill(before[(1, 1)], signal.SIGKILL)  # the middle stage of pipeline 1
    assert not at.get("done"), f"the job finished before the kill could land: {at}"
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert "stage p1/s1 exited with -9; restarting it (1/2)" in out
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["restarts"] == {"p1/s1": 1}
    after = json.loads((workdir / "state.json").read_text())["stages"]
    for stage in after:
        key = (stage["pipeline"], stage["index"])
        if key != (1, 1):
            assert stage["pid"] == before[key], f"p{key[0]}/s{key[1]} was restarted"
    # Every survivor, in both pipelines, lost a link and rolled back to the same commit:
    # pipeline 0 from its own copies, pipeline 1 by parameter name from pipeline 0's files.
    restored = {}
    for p, k in before:
        log = (workdir / "stages" / f"p{p}-stage-{k}.log").read_text()
        if (p, k) != (1, 1):
            assert f"Stage p{p}/s{k} lost a link at step" in log
        steps = re.findall(rf"Stage p{p}/s{k} restored committed step (\d+)", log)
        assert steps, log
        restored[(p, k)] = int(steps[-1])
        if p == 1:
            assert f"Stage p1/s{k} restored committed step {steps[-1]} by name" in log
    assert len(set(restored.values())) == 1 and EVERY <= restored[(0, 0)] < STEPS
    losses = [r["loss"] for r in _history(workspace, name)]
    assert losses == one_pipeline  # every step, the redone ones included
