"""`relaytrain run --local` with real stage processes: recovery, corrupt checkpoints, link TLS.

Tiny random Llama models (no downloads); every stage is its own `python -m
relaytrain_worker` process on loopback links, supervised by local_run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from relaytrain_contract.names import LINK_CA_FILE
from relaytrain_operator.cli.local_run.stages import write_link_folder
from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.local_jobs import (
    local_job,
    make_workspace,
    progress,
    run_env,
    run_state,
    start_run,
    wait_while_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EVERY = 3
STEPS = 12


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("local"), layers=4, records=48)


def _job(root: Path, name: str) -> Job:
    """This module's job on the workspace at `root`: LoRA r4 on q and v, STEPS steps of 2
    micro-batches of 2 x 24 tokens, a checkpoint every EVERY steps under `root/ckpt`."""
    return (
        local_job(root, name)
        .dataset(sequence_length=24)
        .method(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
        .training(steps=STEPS, micro_batch_size=2, micro_batches=2, learning_rate=0.01,
                  warmup_steps=1)
        .checkpoint(str(root / "ckpt"), every_steps=EVERY, keep=2)
    )  # fmt: skip


def _losses(ckpt: Path, name: str) -> list[float]:
    history = json.loads((ckpt / "default" / name / "loss-history.json").read_text())
    return [e["loss"] for e in history]


@pytest.fixture(scope="module")
def uninterrupted(workspace: Path) -> list[float]:
    proc = start_run(_job(workspace, "calm").write(workspace), workspace / "wd-calm")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "finalLoss" in out and (workspace / "wd-calm" / "loss.png").is_file()
    # The last stage wrote a chunk per commit (not the whole history after every step),
    # merged as a binary counter carries: 4 commits of 3 steps are one chunk of 12 steps.
    # And the consolidated array once at the end.
    chunks = sorted((workspace / "ckpt" / "default" / "calm" / "loss-history").iterdir())
    assert (STEPS // EVERY, [c.name for c in chunks]) == (4, [f"{1:09d}-{STEPS:09d}.jsonl"])
    lines = [json.loads(line) for c in chunks for line in c.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    losses = _losses(workspace / "ckpt", "calm")
    assert losses == [r["loss"] for r in lines]
    # Where training stands in the data: STEPS steps of 2 x 2 rows over the rows the 48
    # records (less the held-out none) filled, every example's tokens counted once a pass.
    done = progress(workspace / "ckpt", "calm")
    assert done is not None and done["done"]
    report = json.loads((workspace / "ckpt" / "default" / "calm" / "data-report.json").read_text())
    assert done["epoch"] == STEPS * 4 / report["rows"]
    assert 0 < done["tokensTrained"] < done["tokensSeen"] and done["examplesSeen"] >= STEPS * 4
    return losses


def test_kill_9_of_a_stage_is_survived(workspace: Path, uninterrupted: list[float]) -> None:
    workdir = workspace / "wd-kill"
    proc = start_run(_job(workspace, "kill").write(workspace), workdir)

    def past_first_commit() -> dict[str, Any] | None:
        at = progress(workspace / "ckpt", "kill")
        return at if at is not None and at["step"] >= EVERY + 1 else None

    # On an idle machine the tiny job takes a few milliseconds a step: poll often, and
    # kill early enough that most of the run is still ahead.
    at = wait_while_running("the step to kill at", past_first_commit, proc, interval=0.005)
    state = run_state(workdir)
    assert state is not None
    before = state["stages"]
    victim = before[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    assert not at.get("done"), f"the job finished before the kill could land: {at}"
    killed_at = time.time()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    after = json.loads((workdir / "state.json").read_text())["stages"]
    assert after[0]["pid"] == before[0]["pid"]  # the survivor kept its process
    assert after[1]["pid"] != victim and after[1]["restarts"] == 1
    log0 = (workdir / "stages" / "stage-0.log").read_text()
    lost = int(re.search(r"lost a link at step (\d+)", log0).group(1))  # type: ignore[union-attr]
    restored = [int(s) for s in re.findall(r"restored committed step (\d+)", log0)]
    assert restored and lost - restored[-1] <= EVERY  # at most one interval redone
    # The survivor rolled back from its own copy (checked against the manifest), without
    # restarting or reloading the base model.
    assert f"Stage 0 rolls back from its own copy of step {restored[-1]}" in log0
    # Time from the kill to the replacement stage holding the restored state and its links
    # agreed (training resumes right after): a fresh process, imports and its slice load.
    log1 = (workdir / "stages" / "stage-1.log").read_text()
    stamp = re.findall(r"^(\S+ \S+) INFO relaytrain.stage: Stage 1 restored", log1, re.M)[-1]
    resumed = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    print(f"recovery: kill -9 to restored replacement in {resumed - killed_at:.1f} s")
    assert 0 < resumed - killed_at < 120
    # Same seed, same data positions, restored optimizer and RNG: the curve after the
    # rollback is the uninterrupted one (tolerance only for float summation order).
    losses = _losses(workspace / "ckpt", "kill")
    assert len(losses) == STEPS
    # The replacement and the rollback neither repeat nor skip data: the same counts.
    seen = ("epoch", "examplesSeen", "tokensSeen", "tokensTrained")
    calm, killed = progress(workspace / "ckpt", "calm"), progress(workspace / "ckpt", "kill")
    assert calm and killed and {k: killed[k] for k in seen} == {k: calm[k] for k in seen}
    assert losses[-1] == pytest.approx(uninterrupted[-1], rel=1e-6)
    adapter = workspace / "ckpt" / "default" / "kill" / "output" / "adapter_model.safetensors"
    assert adapter.is_file()


def test_a_corrupt_manifest_is_never_restored(workspace: Path, uninterrupted: list[float]) -> None:
    job_dir = workspace / "ckpt" / "default" / "calm"
    manifest = job_dir / f"step-{STEPS}" / "manifest.json"
    manifest.write_text(manifest.read_text()[:-20] + "garbage")
    (job_dir / "output" / "adapter_model.safetensors").unlink()
    proc = start_run(_job(workspace, "calm").write(workspace), workspace / "wd-calm")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    logs = "".join(p.read_text() for p in (workspace / "wd-calm" / "stages").glob("*.log"))
    assert f"Skipped checkpoint step {STEPS}" in logs
    assert f"restored committed step {STEPS - EVERY}" in logs
    assert (job_dir / "output" / "adapter_model.safetensors").is_file()
    assert _losses(workspace / "ckpt", "calm")[-1] == pytest.approx(uninterrupted[-1], rel=1e-6)


def test_a_corrupt_stage_file_is_never_restored(
    workspace: Path, uninterrupted: list[float]
) -> None:
    # Stage 1's weights of the newest commit rot in the store; its manifest is intact.
    job_dir = workspace / "ckpt" / "default" / "calm"
    weights = job_dir / f"step-{STEPS}" / "stage-1" / "trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)
    weights.write_bytes(bytes(data))
    (job_dir / "output" / "adapter_model.safetensors").unlink()
    stages = workspace / "wd-calm" / "stages"
    # Stage logs are appended to by every run of this job: read only this run's part.
    before = {p.name: p.stat().st_size for p in stages.glob("*.log")}
    proc = start_run(_job(workspace, "calm").write(workspace), workspace / "wd-calm")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    logs = {p.name: p.read_bytes()[before.get(p.name, 0) :].decode() for p in stages.glob("*.log")}
    # Stage 1 found its own file bad and says which step it skipped and why; stage 0,
    # whose files of that step are fine, is sent back too by the handshake.
    assert re.search(
        rf"Stage 1 skipped checkpoint step {STEPS}: checkpoint file \S+trainable.safetensors "
        r"is corrupt",
        logs["stage-1.log"],
    ), logs["stage-1.log"]
    for name, log in logs.items():
        restored = re.findall(r"restored committed step (\d+)", log)
        assert restored and int(restored[-1]) == STEPS - EVERY, (name, log)
    # The steps after the good commit are redone: same final loss, a fresh output.
    assert (job_dir / "output" / "adapter_model.safetensors").is_file()
    assert _losses(workspace / "ckpt", "calm")[-1] == pytest.approx(uninterrupted[-1], rel=1e-6)


def test_each_stage_process_is_given_a_gpu_of_its_own(workspace: Path, tmp_path: Path) -> None:
    """On a machine with several GPUs (here an `nvidia-smi` that lists two: this one has
    none, so the stages train on the CPU all the same), stage k computes on GPU k: its
    process sees only that one (`CUDA_VISIBLE_DEVICES`, by the GPU's UUID), as a stage pod
    sees only its own."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA A100 (UUID: GPU-a)'\n"
                   "echo 'GPU 1: NVIDIA A100 (UUID: GPU-b)'\n")  # fmt: skip
    smi.chmod(0o755)
    env = {"PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}"}
    workdir = workspace / "wd-gpus"
    proc = start_run(local_job(workspace, "gpus").write(workspace), workdir, env=env)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "on GPUs: stage 0 on GPU-a, stage 1 on GPU-b" in out
    for k, uuid in enumerate(("GPU-a", "GPU-b")):
        log = (workdir / "stages" / f"stage-{k}.log").read_text()
        assert f"computes on cpu (CUDA_VISIBLE_DEVICES={uuid}: no CUDA device)" in log, log[-2000:]


def test_a_stage_with_another_jobs_certificate_is_refused(workspace: Path) -> None:
    from relaytrain_operator.cli.local_run import LocalRun
    from relaytrain_operator.spec import parse_job

    # Two runs of one job name mint two CAs, as two incarnations of a job would: a stage
    # holding the other CA's certificate (same identity) must get nowhere.
    manifest = _job(workspace, "intruded").build()
    run = LocalRun.prepare(parse_job(manifest), workspace / "wd-intruded", None)
    other = LocalRun.prepare(parse_job(manifest), workspace / "wd-intruder", None)
    run.write_stage_files()
    other.write_stage_files()
    ours, theirs = run.stages[0].link_dir, other.stages[0].link_dir
    assert ours is not None and theirs is not None
    assert (ours / LINK_CA_FILE).read_text() != (theirs / LINK_CA_FILE).read_text()
    # This run's stage 0 (its ports, its identity), holding the other run's credentials.
    links = {**run.documents[0]["links"], "credentialsDir": str(theirs)}
    intruder_doc = workspace / "wd-intruder" / "intruder.json"
    intruder_doc.write_text(json.dumps({**run.documents[0], "links": links}))
    cmd = [sys.executable, "-m", "relaytrain_worker", "--config"]
    listener = subprocess.Popen(
        [*cmd, str(run.stages[1].config_path)], env=run_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        intruder = subprocess.run(
            [*cmd, str(intruder_doc)], env=run_env(),
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert intruder.returncode == 4, intruder.stderr
        assert "link refused" in intruder.stderr
        assert "does not verify against this job's link CA" in intruder.stderr
        assert "expected relaytrain://default/intruded/p0/s1" in intruder.stderr
        assert listener.poll() is None  # the listening stage is unharmed and still waiting
    finally:
        listener.kill()
        out = listener.communicate()[0]
        run.remove_credentials()
        other.remove_credentials()
    assert "Refused link" in out and "refused this stage's certificate" in out
    assert not (workspace / "ckpt" / "default" / "intruded").exists()  # nothing half-written


def test_full_training_writes_weights_that_load_as_a_model(workspace: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    job = _job(workspace, "full").training(steps=4, learning_rate=1e-3)
    proc = start_run(
        job.set("spec.method", {"type": "full"}).write(workspace), workspace / "wd-full"
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    output = workspace / "ckpt" / "default" / "full" / "output"
    tuned = AutoModelForCausalLM.from_pretrained(str(output))
    base = AutoModelForCausalLM.from_pretrained(str(workspace / "model"))
    tuned_sd, base_sd = tuned.state_dict(), base.state_dict()
    assert set(tuned_sd) == set(base_sd)
    assert all(not torch.equal(tuned_sd[n], base_sd[n]) for n in base_sd if "layers.0.mlp" in n)
    # The tied weight was updated identically on both ends: the head is the embedding.
    assert torch.equal(tuned.lm_head.weight, tuned.model.embed_tokens.weight)


def test_metrics_while_running_and_ctrl_c_stops_every_stage(workspace: Path) -> None:
    import urllib.request

    workdir = workspace / "wd-ctrlc"
    proc = start_run(_job(workspace, "ctrlc").training(steps=200).write(workspace), workdir)
    wait_while_running("a step finished", lambda: progress(workspace / "ckpt", "ctrlc"), proc)
    state = run_state(workdir)
    assert state is not None
    stages = state["stages"]
    for k in range(2):
        port = json.loads((workdir / "stages" / f"stage-{k}.json").read_text())["observability"][
            "port"
        ]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"relaytrain_step{" in metrics and b"relaytrain_link_sent_bytes_total" in metrics
        health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert health.status == 200 and json.loads(health.read())["state"] == "training"
    proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "stopping every stage" in out
    for stage in stages:  # every stage process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(stage["pid"], 0)


def test_a_stage_restarted_after_the_final_commit_finishes_without_its_peers(
    workspace: Path,
) -> None:
    # A stage killed between the job's final commit and its output: its peers finished and
    # exited, so its replacement has nobody to wait for. It must see that nothing is left
    # to train: the output writer (the last stage) writes the output, any other stage exits.
    workdir = workspace / "wd-end"
    proc = start_run(_job(workspace, "end").write(workspace), workdir)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    job_dir = workspace / "ckpt" / "default" / "end"
    adapter = job_dir / "output" / "adapter_model.safetensors"
    adapter.unlink()
    record = json.loads((job_dir / "progress.json").read_text())
    (job_dir / "progress.json").write_text(json.dumps({**record, "done": False, "output": None}))
    losses = _losses(workspace / "ckpt", "end")

    pki = mint_link_credentials("default", "end", [2], now=datetime.now(UTC))
    alone = workspace / "end-alone"
    alone.mkdir()

    def stage_alone(k: int) -> str:
        doc = json.loads((workdir / "stages" / f"stage-{k}.json").read_text())
        # The run removed its stages' keys when it ended; this stage gets fresh ones.
        assert not Path(doc["links"]["credentialsDir"]).exists()
        folder, path = alone / f"stage-{k}", alone / f"stage-{k}.json"
        write_link_folder(folder, stage_pem(pki, 0, k))
        doc["links"]["credentialsDir"] = str(folder)
        path.write_text(json.dumps(doc))
        cmd = [sys.executable, "-m", "relaytrain_worker", "--config", str(path)]
        done = subprocess.run(
            cmd, env=run_env(), capture_output=True, text=True, timeout=180, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    first = stage_alone(0)
    assert "Stage 0 restored the job's final commit: nothing left to train" in first
    assert not adapter.exists() and not progress(workspace / "ckpt", "end")["done"]  # type: ignore[index]
    last = stage_alone(1)
    assert "Stage 1 restored the job's final commit: nothing left to train" in last
    assert adapter.is_file()
    final = progress(workspace / "ckpt", "end")
    assert final is not None and final["done"] and final["step"] == STEPS
    assert _losses(workspace / "ckpt", "end") == losses


def test_a_run_told_to_stop_at_the_end_of_the_data_trains_each_example_once(
    workspace: Path,
) -> None:
    """training.endOfData stop: steps that would outrun one pass end with it, and every
    stage agrees on the shorter run (progress's totalSteps and epoch say so)."""
    job = _job(workspace, "once").training(steps=500).set("spec.training.endOfData", "stop")
    proc = start_run(job.write(workspace), workspace / "wd-once")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    done = progress(workspace / "ckpt", "once")
    report = json.loads((workspace / "ckpt" / "default" / "once" / "data-report.json").read_text())
    one_pass = -(-report["rows"] // 4)  # rows over 2 micro-batches of 2 rows, the last partial
    assert done is not None and done["done"] and done["step"] == done["totalSteps"] == one_pass
    assert done["epoch"] == one_pass * 4 / report["rows"] >= 1.0
    log0 = (workspace / "wd-once" / "stages" / "stage-0.log").read_text()
    assert f"The data runs out after {one_pass} of training.steps 500" in log0


STEPS_LISTED = 60
"""Five passes of the module's data (48 rows, 4 a step): the run is stopped at step 16 or
later, and the tiny job must not finish in the moment that takes."""


def test_no_example_is_repeated_or_skipped_across_a_stop_and_start(
    workspace: Path,
) -> None:
    """Five passes over the data, stopped (SIGTERM, as a suspend) and started again from its
    last commit **in three stages instead of two** (what the operator's re-split does: every
    stage starts again from the last commit under the new split), which redoes the steps
    after it: every stage restores the commit by parameter name; the rows each step finally
    trained, listed from stage 0's own logs, take every row exactly once per pass;
    progress.json's counts are those of five passes; and every step's loss is an
    uninterrupted two-stage run's. (A stage killed and replaced reports the counts of an
    uninterrupted run: test_kill_9_of_a_stage_is_survived.)"""
    job = _job(workspace, "listed").training(steps=STEPS_LISTED).write(workspace)
    debug = {"RELAYTRAIN_LOG_LEVEL": "DEBUG"}
    first = start_run(job, workspace / "wd-listed", env=debug)

    def at(step: int) -> Any:
        now = progress(workspace / "ckpt", "listed")
        return now if now is not None and now["step"] >= step else None

    wait_while_running("a step past the first commits", lambda: at(16), first, interval=0.005)
    # Stage 0 held (SIGSTOP) so that the tiny job cannot finish first; then the run stops
    # (SIGTERM: a suspend) ...
    feeder = run_state(workspace / "wd-listed")["stages"][0]["pid"]  # type: ignore[index]
    os.kill(feeder, signal.SIGSTOP)
    first.send_signal(signal.SIGTERM)
    # Held until the supervisor's SIGTERM reached it (the supervisor acts within its poll,
    # half a second: long enough for the tiny job to finish were stage 0 let go at once).
    # Stage 0 may also be gone by then: the supervisor SIGKILLs a stage still there after
    # its grace, and a loaded machine once showed it gone before this saw the SIGTERM
    # (/proc/PID/status missing); either way the run has stopped, and what follows holds.
    try:
        wait_for(
            "the supervisor's SIGTERM pending at stage 0, or stage 0 gone",
            lambda: (p := _pending(feeder)) is None or p & (1 << (signal.SIGTERM - 1)),
            timeout=30,
            interval=0.02,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(feeder, signal.SIGCONT)
    try:
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:  # never leave it running (or unreaped) for later tests
            first.kill()
            first.communicate()
    assert first.returncode == 128 + signal.SIGTERM, out
    stopped = progress(workspace / "ckpt", "listed")
    assert stopped is not None and not stopped["done"], stopped
    # ... and starts again, split in three.
    resplit = _job(workspace, "listed").training(steps=STEPS_LISTED).pipeline(stages=3)
    second = start_run(resplit.write(workspace), workspace / "wd-listed-again", env=debug)
    calm = start_run(  # the reference, beside it
        _job(workspace, "listed-calm").training(steps=STEPS_LISTED).write(workspace),
        workspace / "wd-listed-calm",
    )
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out
    calm_out, _ = calm.communicate(timeout=600)
    assert calm.returncode == 0, calm_out
    committed = stopped.get("lastCommittedStep")
    for k in range(3):
        log = (workspace / "wd-listed-again" / "stages" / f"stage-{k}.log").read_text()
        assert f"Stage {k} restored committed step {committed} by name" in log, log[-3000:]
    losses, reference = _losses(workspace / "ckpt", "listed"), _losses(workspace / "ckpt",
                                                                         "listed-calm")  # fmt: skip
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"two stages, stopped at step {stopped['step']}, three from commit {committed}: "
          f"largest per-step loss difference {worst!r} against two stages throughout")  # fmt: skip
    assert losses == reference  # bit for bit: a split moves no arithmetic

    line = re.compile(r"Step (\d+) trains rows \[([\d, ]*)\]")
    trained: dict[int, list[int]] = {}
    resumed_at = None
    for run in ("wd-listed", "wd-listed-again"):
        for m in line.finditer((workspace / run / "stages" / "stage-0.log").read_text()):
            step = int(m.group(1))
            resumed_at = step if run == "wd-listed-again" and resumed_at is None else resumed_at
            trained[step] = [int(r) for r in m.group(2).split(",")]  # a redone step: its last
    assert resumed_at is not None and resumed_at > 1, "the second run started from scratch"
    assert sorted(trained) == list(range(1, STEPS_LISTED + 1))
    report = json.loads(
        (workspace / "ckpt" / "default" / "listed" / "data-report.json").read_text()
    )
    rows = report["rows"]
    order = [r for step in range(1, STEPS_LISTED + 1) for r in trained[step]]
    passes = [order[i : i + rows] for i in range(0, len(order), rows)]
    for p, taken in enumerate(passes):
        assert len(set(taken)) == len(taken), f"pass {p + 1} repeats a row"
        if len(taken) == rows:
            assert sorted(taken) == list(range(rows)), f"pass {p + 1} skips a row"
    done = progress(workspace / "ckpt", "listed")
    assert done is not None and done["epoch"] == len(order) / rows


def _pending(pid: int) -> int | None:
    """The signals pending at process `pid` (its own and its thread group's), as a mask;
    None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines())
    if fields.get("State", "").strip().startswith("Z"):
        return None  # ended, not yet reaped
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
