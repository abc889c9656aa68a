"""Where a stage computes (`RELAYTRAIN_DEVICE`, pipeline/device.py): the pod's GPU when the
operator says `cuda`, the CPU when it says `cpu`, CUDA if there is one when unset. A stage
told `cuda` that sees no CUDA device stops before it reads anything, with a line that names
the setting and what to change, instead of training on the CPU; a value that is no device is
refused naming the valid ones. The slice, its adapters and QLoRA's quantised layers all end
on the device asked for (here the meta device stands in for a GPU: it holds no data, so
only where each tensor lives is checked; tests/unit/test_worker_pipeline_gpu.py trains on a
real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from relaytrain_contract import DEVICE_ENV
from relaytrain_contract.exits import TERMINATION_LOG_ENV, StageExit
from relaytrain_operator.domain.stage_config import build_stage_configs, pod_endpoints
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.stage_pods import JOB, PLAN
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.model.methods import lora_config, setup_method
from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model
from relaytrain_worker.pipeline.device import DeviceError, choose

pytestmark = [pytest.mark.unit, pytest.mark.torch]


@pytest.mark.parametrize(
    ("value", "devices", "want"),
    [(None, 0, "cpu"), ("", 1, "cuda:0"), ("auto", 2, "cuda:0"), ("cpu", 1, "cpu"),
     ("cuda", 1, "cuda:0"), ("CUDA", 4, "cuda:0")],
)  # fmt: skip
def test_the_device_follows_the_setting_and_what_torch_sees(
    value: str | None, devices: int, want: str
) -> None:
    assert choose(value, devices) == want


def test_cuda_without_a_device_names_the_setting_and_what_the_container_sees() -> None:
    with pytest.raises(DeviceError) as err:
        choose("cuda", 0, env={"NVIDIA_VISIBLE_DEVICES": "void"})
    message = str(err.value)
    assert not err.value.invalid
    assert f"{DEVICE_ENV}=cuda" in message and "sees no CUDA device" in message
    assert "NVIDIA_VISIBLE_DEVICES='void'" in message and "workerDevice=cpu" in message


def test_a_value_that_is_no_device_names_the_valid_ones() -> None:
    with pytest.raises(DeviceError) as err:
        choose("gpu", 1)
    assert err.value.invalid
    assert f"{DEVICE_ENV}='gpu'" in str(err.value) and "auto, cuda, cpu" in str(err.value)


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_the_slice_and_what_trains_end_on_the_device_asked_for(tmp_path: Path, method: str) -> None:
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    stage = build_stage_model(tiny_model_dir(tmp_path), SliceSpec(0, 2, True, False))
    lora = None if method == "full" else lora_config(4, 8.0, 0.0, ["q_proj", "v_proj"])
    device = "cpu" if method == "qlora" else "meta"  # bitsandbytes quantises on a real one
    trainable = setup_method(stage, method, lora, 0, device)  # type: ignore[arg-type]
    assert trainable
    where = {t.device.type for t in [*stage.parameters(), *stage.buffers()]}
    assert where == {device}, where


def _stage_process(tmp_path: Path, device: str) -> tuple[subprocess.CompletedProcess[str], str]:
    config = build_stage_configs(parse_job(JOB.build()), PLAN, pod_endpoints("smol", "t", 2))[0]
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(config))
    message = tmp_path / "termination-log"
    env = {**os.environ, DEVICE_ENV: device, TERMINATION_LOG_ENV: str(message)}
    argv = [sys.executable, "-m", "relaytrain_worker", "--config", str(path)]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300, env=env)
    return done, message.read_text() if message.exists() else ""


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the refusal needs a machine without CUDA; this one has a device (the stage trains)",
)
def test_a_stage_told_cuda_on_a_machine_without_one_stops_saying_why(tmp_path: Path) -> None:
    done, message = _stage_process(tmp_path, "cuda")
    assert done.returncode == StageExit.FAILED, done.stderr[-2000:]
    assert "stage 0: RELAYTRAIN_DEVICE=cuda" in message and "sees no CUDA device" in message
    assert "link credentials" not in done.stderr  # stopped before anything else


def test_a_stage_told_a_device_that_does_not_exist_is_an_invalid_config(tmp_path: Path) -> None:
    done, message = _stage_process(tmp_path, "tpu")
    assert done.returncode == StageExit.INVALID_CONFIG, done.stderr[-2000:]
    assert "RELAYTRAIN_DEVICE='tpu' is not a device: valid are auto, cuda, cpu" in message
