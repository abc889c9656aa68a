"""`relaytrain run --local` gives each stage process a GPU of its own where the machine has
several, as a cluster gives each stage pod one: the GPUs `CUDA_VISIBLE_DEVICES` lists (up to
its first invalid entry), else `nvidia-smi -L`'s by UUID, none when the stages are told to
use the CPU or nothing lists a GPU; stages take them in turn."""

from __future__ import annotations

from pathlib import Path

import pytest
from relaytrain_operator.cli.local_run.layout import Layout
from relaytrain_operator.cli.local_run.report import on_gpus
from relaytrain_operator.cli.local_run.stages import forks_stages, local_gpus, stage_procs

pytestmark = pytest.mark.unit

SMI = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-a)\nGPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-b)\n"


def _none() -> str | None:
    raise AssertionError("nvidia-smi is not asked when CUDA_VISIBLE_DEVICES says")


@pytest.mark.parametrize(
    ("env", "listing", "want"),
    [
        ({}, lambda: SMI, ["GPU-a", "GPU-b"]),
        ({}, lambda: "GPU 0: Tesla V100\nGPU 1: Tesla V100\n", ["0", "1"]),  # no UUIDs
        ({}, lambda: None, []),  # no nvidia-smi, or no driver
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, _none, ["2", "3"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-b, 0"}, _none, ["GPU-b", "0"]),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, _none, ["1"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, _none, []),
        ({"RELAYTRAIN_DEVICE": "cpu"}, _none, []),
        ({"RELAYTRAIN_DEVICE": "cuda"}, lambda: SMI, ["GPU-a", "GPU-b"]),
    ],
)  # fmt: skip
def test_the_gpus_a_local_run_offers_its_stages(
    env: dict[str, str], listing: object, want: list[str]
) -> None:
    assert local_gpus(env, listing) == want  # type: ignore[arg-type]


def test_stages_take_the_gpus_in_turn_and_their_processes_see_only_theirs(tmp_path: Path) -> None:
    layout = Layout(splits=[[(0, 2), (2, 4)], [(0, 1), (1, 4)]], shares=[1, 1])
    stages = stage_procs(tmp_path, layout, gpus=["0", "1", "2"])
    assert [(s.name, s.gpu) for s in stages] == [
        ("stage p0/s0", "0"), ("stage p0/s1", "1"), ("stage p1/s0", "2"), ("stage p1/s1", "0"),
    ]  # fmt: skip
    base = {"PATH": "/bin"}
    assert stages[2].env(base) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2"}
    assert on_gpus(stages).startswith(", on GPUs: stage p0/s0 on 0, stage p0/s1 on 1")
    alone = stage_procs(tmp_path, Layout(splits=[[(0, 4)]], shares=[1]), gpus=[])
    assert alone[0].gpu is None and alone[0].env(base) is base and on_gpus(alone) == ""


def test_qlora_stages_on_gpus_start_as_programs_of_their_own(tmp_path: Path) -> None:
    """The server of a QLoRA job imports bitsandbytes, which initialises CUDA on a GPU host;
    a stage forked from it could not use its GPU (tests/e2e/test_local_gpu.py on a GPU)."""
    layout = Layout(splits=[[(0, 2), (2, 4)]], shares=[1])
    on_gpus_ = stage_procs(tmp_path, layout, gpus=["0"])
    on_cpu = stage_procs(tmp_path, layout, gpus=[])
    assert not forks_stages({}, "qlora", on_gpus_)
    assert forks_stages({}, "lora", on_gpus_) and forks_stages({}, "full", on_gpus_)
    assert forks_stages({}, "qlora", on_cpu)
    assert not forks_stages({"RELAYTRAIN_PREFORK": "0"}, "lora", on_cpu)
