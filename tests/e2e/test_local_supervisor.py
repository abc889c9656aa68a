"""`relaytrain run --local` as a supervisor: stopping leaves no stage behind (also while a
stage crash-loops), a second run of a live job is refused, and each job keeps its own state.

Tiny random Llama models (no downloads); real `python -m relaytrain_worker` processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaytrain_worker.testing import CORPUS, tiny_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("supervisor")
    tiny_model_dir(root / "model", layers=2)
    with (root / "data.jsonl").open("w") as f:
        for i in range(16):
            record = {"prompt": f"q{i}: {CORPUS[i % 5][:12]}", "completion": CORPUS[(i + 1) % 5]}
            f.write(json.dumps(record) + "\n")
    return root


def _job(root: Path, name: str, *, steps: int, checkpoint: bool = True, **spec: Any) -> Path:
    manifest: dict[str, Any] = {
        "apiVersion": "relaytrain.io/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": str(root / "model"), "dtype": "float32"},
            "dataset": {"uri": str(root / "data.jsonl"), "format": "prompt-completion",
                        "sequenceLength": 16},
            "method": {"type": "lora", "rank": 2, "alpha": 4, "targetModules": ["q_proj"]},
            "training": {"steps": steps, "microBatchSize": 1, "microBatches": 2},
            "pipeline": {"stages": 2, "compression": "none"},
            "failurePolicy": {"maxStageRestarts": 2, "backoffSeconds": 0},
            **spec,
        },
    }  # fmt: skip
    if checkpoint:
        manifest["spec"]["checkpoint"] = {"uri": str(root / "ckpt"), "everySteps": 2}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _run(job: Path, workdir: Path | None, cwd: Path | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "worker_image")])
    cmd = [sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
           "--no-progress"]  # fmt: skip
    if workdir is not None:
        cmd += ["--workdir", str(workdir)]
    return subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_for(what: str, ready: Any, proc: subprocess.Popen[str], timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}: {proc.communicate()[0]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}: {proc.communicate()[0]}")


def _state(workdir: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((workdir / "state.json").read_text()))
    except (OSError, ValueError):
        return None


def _stage_processes(workdir: Path) -> list[tuple[int, str]]:
    """Every live process (PID, command line) running one of `workdir`'s stage documents."""
    stages = str(workdir.resolve() / "stages") + os.sep
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if any(a.decode(errors="replace").startswith(stages) for a in args):
            found.append((int(entry.name), b" ".join(args).decode(errors="replace")))
    return found


def _none_left(workdir: Path) -> None:
    deadline = time.monotonic() + 5
    while _stage_processes(workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _stage_processes(workdir) == []


def test_sigterm_mid_run_stops_every_stage(workspace: Path) -> None:
    workdir = workspace / "wd-term"
    proc = _run(_job(workspace, "term", steps=500), workdir)
    progress = workspace / "ckpt" / "default" / "term" / "progress.json"
    _wait_for("a step finished", progress.is_file, proc)
    assert len(_stage_processes(workdir)) == 2  # the scan sees the stages while they run
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopping every stage" in out
    _none_left(workdir)


def test_sigterm_while_a_stage_crash_loops_restarts_nothing(workspace: Path) -> None:
    # Stage 0 cannot read its data and exits at start-up, again and again; stage 1 waits for
    # it. The supervisor is stopped while it restarts stage 0.
    workdir = workspace / "wd-loop"
    job = _job(
        workspace,
        "loop",
        steps=500,
        failurePolicy={"maxStageRestarts": 100, "backoffSeconds": 1},
    )
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["dataset"]["uri"] = str(workspace / "missing.jsonl")
    job.write_text(yaml.safe_dump(manifest))
    proc = _run(job, workdir)

    def looping() -> bool:
        state = _state(workdir)
        return bool(state) and state["stages"][0]["restarts"] >= 2  # type: ignore[index]

    _wait_for("stage 0 restarted twice", looping, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    _none_left(workdir)
    state = _state(workdir)
    assert state is not None
    for stage in state["stages"]:  # every process it ever started is gone
        for pid in stage["pids"]:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_a_second_run_of_a_live_job_is_refused(workspace: Path) -> None:
    workdir = workspace / "wd-twice"
    job = _job(workspace, "twice", steps=500)
    first = _run(job, workdir)
    _wait_for("the stages started", lambda: _state(workdir), first)
    documents = {p.name: p.stat().st_mtime_ns for p in (workdir / "stages").glob("*.json")}
    second = _run(job, workdir)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2, out
    holder = f"(PID {first.pid})"
    assert f"job default/twice is already running in {workdir.resolve()} {holder}" in out
    # The refused run wrote nothing and started nothing; the first one runs on.
    assert {p.name: p.stat().st_mtime_ns for p in (workdir / "stages").glob("*.json")} == (
        documents
    )
    assert first.poll() is None and len(_stage_processes(workdir)) == 2
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 130, out
    _none_left(workdir)


def test_two_jobs_started_from_one_directory_keep_their_own_state(
    workspace: Path, tmp_path: Path
) -> None:
    names = ("alpha", "beta")
    jobs = {n: _job(workspace, n, steps=2, checkpoint=False) for n in names}
    runs = {n: _run(jobs[n], None, cwd=tmp_path) for n in names}  # side by side, no --workdir
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, out)
    for name in names:
        other = next(n for n in names if n != name)
        state_dir = tmp_path / "relaytrain-local" / "default" / name
        documents = [p.read_text() for p in (state_dir / "stages").glob("stage-*.json")]
        assert len(documents) == 2
        assert all(f"/default/{name}/" in d and f"/{other}/" not in d for d in documents)
        assert json.loads((state_dir / "summary.json").read_text())["job"] == name
        # The default checkpoint store is the job's own directory too.
        output = state_dir / "checkpoints" / "default" / name / "output"
        assert (output / "adapter_model.safetensors").is_file()
