"""`delta`'s codes on a real model's boundary: SmolLM2-135M-Instruct's hidden states after
layer 15 of 30 (a four-stage split's middle boundary), where the first token carries massive
activations (most of a row's energy). Every token crosses at its code's error, in the identity
and in fitted bases: until 2026-12-07 the row's error budget let the massive token pay for
leaving every other token out (docs/links-and-checkpoints.md, "Massive activations"). And what
a code's error costs the model itself: the rows' loss with a four-stage split's three
boundaries decoded (docs/links-and-checkpoints.md, "A real model through the links")."""

from __future__ import annotations

import math

import pytest
import torch
from relaytrain_testkit.prose import prose
from relaytrain_worker.pipeline import transform
from relaytrain_worker.pipeline.boundary import ROWS, codec_for
from relaytrain_worker.pipeline.lowbit import distortion
from relaytrain_worker.prepare_model import default_dir, prepare

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEQ = 256
FRAMES = transform.FIRST_FIT + 2  # a row a frame; rows coded in a basis from the fifth


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    """Pinned packages' READMEs (`relaytrain_testkit.prose`) in SmolLM2's tokens, once for the
    module's tests."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(prepare(default_dir())))
    return tokenizer(prose(), return_tensors="pt").input_ids[0]


@pytest.fixture(scope="module")
def hidden(tokens: torch.Tensor) -> torch.Tensor:
    """[FRAMES, SEQ, 576] bf16: the hidden states after layer 15 of rows of `tokens`, as a link
    gets them."""
    from transformers import AutoModelForCausalLM

    where = prepare(default_dir())
    ids = tokens[: FRAMES * SEQ].view(FRAMES, SEQ)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.hidden_states[15].to(torch.bfloat16)


@pytest.mark.parametrize(
    ("error", "fitted"), [("int3", False), ("int4", False), ("int4", True), ("int3", True)]
)
def test_every_token_of_a_real_boundary_crosses_at_its_codes_error(
    hidden: torch.Tensor, error: str, fitted: bool
) -> None:
    """At int4's error, the default, a row's change (its second crossing) comes within half of
    it (`boundary.ACTIVATION_ERRORS`: a quarter of its square, for a row that moved about
    that error, as here); at int3's within int3's."""
    x = hidden.float()
    energy = x.square().sum(dim=-1)
    first = float((energy[:, 0] / energy.sum(dim=-1)).min())
    assert first > 0.9, f"the first token holds {first:.1%} of a row's energy, not most of it"
    sender, receiver = codec_for(error, transform=fitted), codec_for(error, transform=fitted)
    full = 1.05 * math.sqrt(distortion(int(error[-1]), "unshrunk"))
    moved = hidden.float() * (
        1 + 0.1 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
    )
    for crossing, rows in enumerate((hidden, moved.to(torch.bfloat16))):
        bound = full * (0.5 if crossing and error == "int4" else 1.0)
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


@pytest.mark.parametrize("fitted", [False, True], ids=["identity", "fitted-bases"])
def test_int4s_codes_at_a_real_models_boundaries_keep_its_loss(
    tokens: torch.Tensor, fitted: bool
) -> None:
    """The default code (int4's error) at the three boundaries of SmolLM2-135M split in four
    stages (after layers 8, 15 and 22), each row's first crossing, frames of 2 rows: the
    rows' loss within 3 % of the rows' own. Measured on these rows (pinned packages'
    READMEs, 2026-12-07): +2.02 % in the identity, +1.99 % in fitted bases, where with the
    first token, the attention sink, crossing at the others' relative error (no
    `allocation.MASSIVE`) fitted bases cost +7.1 % (the identity, whose full codes give every
    block 4 bits, +2.19 %); and before that every token but the first was left out."""
    from relaytrain_testkit.inputs import even_splits
    from transformers import AutoModelForCausalLM

    where = prepare(default_dir())
    ids = tokens[: 48 * 32].view(48, 32)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32).eval()
    layers = model.model.layers
    cuts = [end for _, end in even_splits(len(layers), 4)[:-1]]
    links = {c: (codec_for("int4", transform=fitted), codec_for("int4", transform=fitted))
             for c in cuts}  # fmt: skip
    sent = dict.fromkeys(cuts, 0)

    def decoded(cut: int, x: torch.Tensor) -> torch.Tensor:
        sender, receiver = links[cut]
        out = []
        for frame in x.to(torch.bfloat16).split(2):
            rows = torch.arange(sent[cut], sent[cut] + frame.shape[0])
            sent[cut] += frame.shape[0]
            ((entry, parts),) = sender.encode("activation", {"hidden": frame, ROWS: rows})
            it = iter(parts)
            out.append(
                receiver.decode("activation", entry, frame.dtype, lambda _n, _d, it=it: next(it))
            )
        return torch.cat(out).float()

    def loss() -> float:
        with torch.no_grad():
            return sum(
                float(model(input_ids=chunk, labels=chunk, use_cache=False).loss)
                for chunk in ids.split(8)
            ) / len(ids.split(8))

    plain = loss()
    for c in cuts:
        layers[c - 1].register_forward_hook(
            lambda _m, _a, out, c=c: (
                (decoded(c, out[0]), *out[1:]) if isinstance(out, tuple) else decoded(c, out)
            )
        )
    coded = loss()
    assert all(n == len(ids) for n in sent.values()), sent  # every boundary coded every row
    if fitted:
        assert all(sender.sender.bases.held(False) == 1 for sender, _ in links.values())
    assert coded < 1.03 * plain, (plain, coded)
