"""The benchmarks' language (testkit/bigram.py): what the fine-tuning task changes, and the
loss floor the benchmarks report against."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from relaytrain_testkit import bigram
from relaytrain_testkit.random_models import config_dir, random_model

pytestmark = pytest.mark.unit


def test_a_shifted_language_changes_that_share_of_the_successors() -> None:
    base = bigram.successors()
    assert sorted(base.tolist()) == list(range(bigram.VOCAB))  # a permutation
    for share in (0.25, 0.5):
        shifted = bigram.successors(share)
        assert sorted(shifted.tolist()) == list(range(bigram.VOCAB))
        changed = int((shifted != base).sum())
        # The moved tokens trade successors; a few may draw their own back.
        assert share * bigram.VOCAB * 0.9 <= changed <= share * bigram.VOCAB, changed
    assert torch.equal(bigram.successors(0.25), bigram.successors(0.25))


def test_rows_follow_their_language_and_the_entropy_is_its_floor() -> None:
    perm = bigram.successors(0.5)
    x = bigram.rows(400, 32, 3, perm)
    follows = (x[:, 1:] == perm[x[:, :-1]]).double().mean()
    assert abs(float(follows) - (1 - bigram.NOISE + bigram.NOISE / bigram.VOCAB)) < 0.01
    # The empirical cross-entropy of the true next-token distribution on these rows.
    p_right = 1 - bigram.NOISE + bigram.NOISE / bigram.VOCAB
    p_other = bigram.NOISE / bigram.VOCAB
    nll = -torch.where(x[:, 1:] == perm[x[:, :-1]], math.log(p_right), math.log(p_other))
    assert abs(float(nll.mean()) - bigram.entropy()) < 0.05
    # Drawn from a generator, rows continue its stream; from a seed, they repeat.
    assert torch.equal(bigram.rows(3, 8, 5), bigram.rows(3, 8, 5))
    gen = torch.Generator().manual_seed(5)
    assert torch.equal(bigram.rows(3, 8, gen), bigram.rows(3, 8, 5))
    assert not torch.equal(bigram.rows(3, 8, gen), bigram.rows(3, 8, 5))


def test_a_pretrained_base_is_kept_and_taken_back_from_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": bigram.VOCAB, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
    }  # fmt: skip
    model_dir = config_dir(tmp_path / "config", config)
    cache = tmp_path / "bases"
    fits = {"n": 0}
    real_fit = bigram.fit

    def counted(*args: Any, **kwargs: Any) -> float:
        fits["n"] += 1
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(bigram, "fit", counted)

    def base(steps: int, seed: int = 0) -> tuple[torch.nn.Module, float]:
        model = random_model(model_dir, dtype="float32", device="cpu", seed=seed)
        loss = bigram.fit_cached(model, cache, steps=steps, rows_per_step=2, seq=8)
        return model, loss

    first, loss = base(3)
    assert fits["n"] == 1 and not torch.equal(
        first.lm_head.weight, random_model(model_dir, dtype="float32", device="cpu").lm_head.weight
    )
    again, again_loss = base(3)  # the same model and steps: taken from the cache
    assert fits["n"] == 1 and again_loss == loss
    for (name, a), b in zip(first.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert b.requires_grad, name  # as `fit` leaves them
    base(4)  # other steps, other weights drawn: each its own fit
    base(3, seed=1)
    assert fits["n"] == 3
    assert len(list(cache.glob("*.safetensors"))) == 3 and not list(cache.glob("*.part"))
    bigram.fit_cached(random_model(model_dir, dtype="float32", device="cpu"), None, steps=3,
                      rows_per_step=2, seq=8)  # fmt: skip
    assert fits["n"] == 4  # no cache: always fit
