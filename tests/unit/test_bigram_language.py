"""The benchmarks' language (testkit/bigram.py): what the fine-tuning task changes, and the
loss floor the benchmarks report against."""

from __future__ import annotations

import math

import pytest
import torch
from relaytrain_testkit import bigram

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
