"""The codec on CUDA tensors: the same bytes as on the CPU, so stages on different devices agree."""

from __future__ import annotations

import pytest
import torch
from relaytrain_worker.pipeline.compression import COMPRESSIONS, decode, encode

pytestmark = [pytest.mark.unit, pytest.mark.gpu]


@pytest.mark.parametrize("mode", COMPRESSIONS)
def test_cuda_encoding_matches_the_cpu_bit_for_bit(mode: str) -> None:
    x = torch.randn(4, 512, 576, generator=torch.Generator().manual_seed(0))
    x[..., 7] *= 40.0
    cpu, gpu = encode(x, mode), encode(x.cuda(), mode)
    assert gpu.data.device.type == "cpu"  # ready for the wire
    assert torch.equal(cpu.data, gpu.data)
    for a, b in ((cpu.scales, gpu.scales), (cpu.channel_scales, gpu.channel_scales)):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
    back = decode(gpu, device="cuda")
    assert back.device.type == "cuda"
    assert torch.equal(back.cpu(), decode(cpu))
