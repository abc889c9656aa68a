"""`delta`'s codes on a real model's boundary: SmolLM2-135M-Instruct's hidden states after
layer 15 of 30 (a four-stage split's middle boundary), where the first token carries massive
activations (most of a row's energy). Every token crosses at its code's error, in the identity
and in fitted bases: until 2026-12-07 the row's error budget let the massive token pay for
leaving every other token out (docs/links-and-checkpoints.md, "Massive activations")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from relaytrain_worker.pipeline import transform
from relaytrain_worker.pipeline.boundary import ROWS, codec_for
from relaytrain_worker.pipeline.lowbit import distortion
from relaytrain_worker.prepare_model import default_dir, prepare

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SEQ = 256
FRAMES = transform.FIRST_FIT + 2  # a row a frame; rows coded in a basis from the fifth


@pytest.fixture(scope="module")
def hidden() -> torch.Tensor:
    """[FRAMES, SEQ, 576] bf16: the hidden states after layer 15 of rows of this repository's
    docs, as a link gets them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = prepare(default_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tokenizer(text, return_tensors="pt").input_ids[0][: FRAMES * SEQ].view(FRAMES, SEQ)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.hidden_states[15].to(torch.bfloat16)


@pytest.mark.parametrize(("error", "fitted"), [("int3", False), ("int4", True), ("int3", True)])
def test_every_token_of_a_real_boundary_crosses_at_its_codes_error(
    hidden: torch.Tensor, error: str, fitted: bool
) -> None:
    x = hidden.float()
    energy = x.square().sum(dim=-1)
    first = float((energy[:, 0] / energy.sum(dim=-1)).min())
    assert first > 0.9, f"the first token holds {first:.1%} of a row's energy, not most of it"
    sender, receiver = codec_for(error, transform=fitted), codec_for(error, transform=fitted)
    bound = 1.05 * math.sqrt(distortion(int(error[-1]), "unshrunk"))
    moved = hidden.float() * (
        1 + 0.1 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
    )
    for crossing, rows in enumerate((hidden, moved.to(torch.bfloat16))):
        for i in range(FRAMES):
            frame = rows[i : i + 1]
            ((entry, parts),) = sender.encode(
                "activation", {"hidden": frame, ROWS: torch.tensor([i])}
            )
            it = iter(parts)
            y = receiver.decode("activation", entry, frame.dtype, lambda _n, _d, it=it: next(it))
            truth = frame.float()
            each = (y.float() - truth).norm(dim=-1) / truth.norm(dim=-1)
            rms = float(each.square().mean().sqrt())
            assert rms < bound, (crossing, i, rms, bound)
    if fitted:
        assert sender.sender.bases.held(False) == 1  # the last full codes were in a basis
