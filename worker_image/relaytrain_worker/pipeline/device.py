"""Where a stage computes: its pod's GPU, or the CPU (`RELAYTRAIN_DEVICE`).

The operator sets `RELAYTRAIN_DEVICE` on every stage pod from its `workerDevice` setting
(the chart's value): `cuda` on a cluster whose GPU nodes run the NVIDIA device plugin, which
gives the container the GPU the pod asked for as device 0; `cpu` where the GPUs are only
simulated (the local test cluster's kwok nodes). `relaytrain run --local` leaves it unset:
`auto`, CUDA where torch sees a device, else the CPU.

A stage told `cuda` that sees no CUDA device stops before it loads anything, naming what
it saw, instead of training on the CPU a hundred times slower than the plan priced — the
usual cause is a node whose container runtime does not expose the GPU (no NVIDIA container
toolkit, or a pod without the runtime class that has it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from relaytrain_contract import DEVICE_ENV, DEVICES


class DeviceError(RuntimeError):
    """The device the stage was told to use is not there (`invalid`: the value itself is
    not one of `DEVICES`, which no restart can fix)."""

    def __init__(self, message: str, *, invalid: bool = False) -> None:
        super().__init__(message)
        self.invalid = invalid


def choose(value: str | None, cuda_devices: int, env: Mapping[str, str] | None = None) -> str:
    """The torch device for `value` (of `DEVICES`; None or empty is `auto`) on a machine
    where torch sees `cuda_devices` CUDA devices: ``"cuda:0"`` or ``"cpu"``. `env` is what
    the message quotes when CUDA is asked for and missing (default: this process's)."""
    wanted = (value or "auto").strip().lower()
    if wanted not in DEVICES:
        raise DeviceError(
            f"{DEVICE_ENV}={value!r} is not a device: valid are {', '.join(DEVICES)}",
            invalid=True,
        )
    if wanted == "cpu" or (wanted == "auto" and cuda_devices == 0):
        return "cpu"
    if cuda_devices == 0:
        env = os.environ if env is None else env
        seen = ", ".join(
            f"{name}={env[name]!r}" for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
            if name in env
        ) or "neither CUDA_VISIBLE_DEVICES nor NVIDIA_VISIBLE_DEVICES is set"  # fmt: skip
        raise DeviceError(
            f"{DEVICE_ENV}=cuda but torch {torch.__version__} (CUDA "
            f"{torch.version.cuda or 'none: a CPU-only build'}) sees no CUDA device ({seen}): "
            "the node's container runtime does not give this pod its GPU (is the NVIDIA "
            "container toolkit or the pod's runtime class set up?). On a cluster without "
            "GPUs, install the chart with workerDevice=cpu"
        )
    return "cuda:0"


def describe(device: torch.device) -> str:
    """How the stage's log names where it computes: the card, or the CPU and, when the
    environment names GPUs, that it sees none of them."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "cpu" if visible is None else f"cpu (CUDA_VISIBLE_DEVICES={visible}: no CUDA device)"


def stage_device(value: str | None = None) -> torch.device:
    """The device this stage computes on: `choose` for `value` (default: `DEVICE_ENV`)
    with the CUDA devices torch sees here."""
    if value is None:
        value = os.environ.get(DEVICE_ENV)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device(choose(value, count))
