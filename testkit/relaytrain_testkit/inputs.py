"""What the in-process pipelines and the references train on: the exactness tests'
training, layer splits, and micro-batches."""

from __future__ import annotations

import itertools

import torch
from relaytrain_contract import TrainingSpec
from relaytrain_worker.state.data import MicroBatch

#: The exactness tests' training: three steps of three micro-batches of two, AdamW with
#: warm-up, cosine decay and weight decay, and a clip norm below every step's gradient norm,
#: so clipping by the global norm is always active.
CLIPPED_TRAINING = TrainingSpec(
    steps=3,
    micro_batch_size=2,
    micro_batches=3,
    learning_rate=1e-2,
    schedule="cosine",
    warmup_steps=1,
    weight_decay=0.01,
    max_grad_norm=0.05,
    seed=3,
)


def random_batches(
    steps: int, m: int, mbs: int, seq: int, vocab: int, *, seed: int = 0
) -> list[list[MicroBatch]]:
    """`steps` lists of `m` micro-batches of random full-length rows (no padding, so every
    token is a processed token; labels are the inputs), for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micros = []
        for _ in range(m):
            ids = torch.randint(0, vocab, (mbs, seq), generator=gen)
            pos = torch.arange(seq).expand(mbs, -1).contiguous()
            micros.append(MicroBatch(ids, torch.ones_like(ids), pos, ids.clone()))
        out.append(micros)
    return out


def even_splits(layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) per stage, as even as possible."""
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def masked_batches(
    steps: int, m: int, *, vocab: int = 300, seq: int = 12
) -> list[list[MicroBatch]]:
    """`steps` lists of `m` micro-batches of two rows, with right padding and masked prompts
    of different lengths, so every micro-batch has another label-token count (seeded: the
    same batches on every call)."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        micros = []
        for i in range(m):
            ids = torch.randint(0, vocab, (2, seq), generator=gen)
            mask = torch.ones(2, seq, dtype=torch.long)
            mask[1, seq - 2 - 3 * i :] = 0
            labels = ids.clone()
            labels[mask == 0] = -100
            labels[0, : 1 + 2 * i] = -100
            pos = torch.arange(seq).expand(2, -1).contiguous()
            micros.append(MicroBatch(ids, mask, pos, labels))
        out.append(micros)
    return out
