"""Stage processes on a GPU (`RELAYTRAIN_DEVICE=cuda`, docs/stage-contract.md, "The device"):
`relaytrain run --local` of a two-stage job whose stages load their slices onto CUDA, train,
checkpoint and evaluate there, against the same job on the CPU. Runs on a GPU host (`make
gpu-check` runs the `gpu` tests); the choice of device and its refusals are checked on any
machine by tests/unit/test_worker_device.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from relaytrain_contract import DEVICE_ENV
from relaytrain_contract.prefork import PreforkError, PreforkServer
from relaytrain_testkit.local_jobs import local_job, make_workspace, start_run

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]


def _run(root: Path, name: str, device: str, method: str = "lora") -> tuple[list[float], str]:
    job = (
        local_job(root, name)
        .dataset(sequence_length=24)
        .method(method, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
        .training(steps=8, micro_batch_size=2, micro_batches=2, learning_rate=0.01,
                  warmup_steps=1)
        .checkpoint(str(root / "ckpt"), every_steps=4, keep=2)
    )  # fmt: skip
    workdir = root / f"wd-{name}"
    proc = start_run(job.write(root), workdir, env={DEVICE_ENV: device})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    history = json.loads((root / "ckpt" / "default" / name / "loss-history.json").read_text())
    logs = "".join(p.read_text() for p in sorted((workdir / "stages").glob("*.log")))
    return [e["loss"] for e in history], logs


def test_stage_processes_train_on_the_gpu_as_on_the_cpu(tmp_path: Path) -> None:
    root = make_workspace(tmp_path, layers=4, records=48)
    on_cpu, cpu_logs = _run(root, "cpu", "cpu")
    on_gpu, gpu_logs = _run(root, "gpu", "cuda")
    assert "computes on cuda:0" in gpu_logs and "computes on cpu" in cpu_logs
    assert len(on_gpu) == len(on_cpu) == 8
    assert on_gpu == pytest.approx(on_cpu, rel=1e-3)


def test_qlora_stage_processes_quantise_onto_the_gpu_and_train(tmp_path: Path) -> None:
    """QLoRA's NF4 base on CUDA (bitsandbytes' GPU kernels; its CPU path differs, so the
    check is that the loss falls, not that it matches the CPU's)."""
    pytest.importorskip("bitsandbytes")
    root = make_workspace(tmp_path, layers=4, records=48)
    losses, logs = _run(root, "qlora", "cuda", method="qlora")
    assert "computes on cuda:0" in logs
    assert len(losses) == 8 and losses[-1] < losses[0], losses


def test_a_qlora_jobs_prefork_server_would_hold_cuda_so_it_forks_nothing(tmp_path: Path) -> None:
    """Why a QLoRA job's stages on GPUs start as programs of their own (`forks_stages`):
    the server of a QLoRA job imports bitsandbytes, whose import asks each GPU for its compute
    capability, initialising CUDA in the server, and a child forked from it could not use CUDA.
    The server sees this and refuses to serve. (Should bitsandbytes stop doing so, this fails,
    and QLoRA stages on GPUs could be forked too.)"""
    pytest.importorskip("bitsandbytes")
    log = tmp_path / "prefork.log"
    with log.open("wb") as own, pytest.raises(PreforkError, match=r"did not start \(exit 1\)"):
        PreforkServer.start(dict(os.environ), log=own, qlora=True)
    assert "initialised CUDA" in log.read_text()
