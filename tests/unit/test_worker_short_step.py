"""A step whose gradient reduce missed a pipeline is dropped by every stage of the pipeline.

Two stages of one pipeline run `StepRunner` on threads over a real authenticated loopback
link; their group (what the other pipelines would be) folds only their own terms and says
whether the step's results were *short* (a member pipeline left in the middle of it), for
one stage or the other. Whichever stage learns it, the chain pass carries it to the other:
both raise `ShortStepError` with no gradient left on any parameter, and neither applies the
step; the step's last permitted attempt trains on what arrived instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import pytest
import torch
from relaytrain_testkit.replica_links import link_pair, on_threads, peer_credentials
from relaytrain_worker.model.model_slice import StageModel
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.schedule import ShortStepError, StepResult, StepRunner
from relaytrain_worker.pipeline.stats import GRADS
from relaytrain_worker.replicas.arithmetic import reduce_sum
from relaytrain_worker.state.data import MicroBatch
from torch import nn

pytestmark = [pytest.mark.unit, pytest.mark.torch]

VOCAB, HIDDEN, PIPELINES = 11, 8, 2


class _Embed(nn.Module):
    """Stage 0: token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.embed(x))


class _Head(nn.Module):
    """The last stage: the vocabulary's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.head(x))


class _Group:
    """A `ReplicaGroup` whose other pipelines gave nothing: a reduce folds this stage's own
    terms; `short` says what the test wants this stage to have learnt."""

    pipelines = PIPELINES
    first_member = 0

    def __init__(self, short: bool) -> None:
        self._short = short

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        return count

    def reduce(
        self,
        step: int,
        pipeline: int,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        what: str = GRADS,
    ) -> dict[str, torch.Tensor]:
        return reduce_sum([tensors], terms=True)

    def short(self, step: int) -> bool:
        return self._short


def _micros() -> list[MicroBatch]:
    torch.manual_seed(0)
    out = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 6))
        ones = torch.ones_like(ids)
        out.append(MicroBatch(ids, ones, torch.arange(6).expand(2, 6).contiguous(), ids.clone()))
    return out


def _step(short: tuple[bool, bool], attempt: int = 0) -> dict[int, Any]:
    """One step of the two stages, each group saying `short[k]`: each stage's StepResult or
    the exception it raised, and whether any parameter kept a gradient."""
    creds = peer_credentials([[(0, 1), (1, 2)]])
    down, up = link_pair(creds[(0, 0)], creds[(0, 1)])
    torch.manual_seed(1)
    modules: list[nn.Module] = [_Embed(), _Head()]
    peers = [Peers(None, down), Peers(up, None)]
    micros = _micros()
    kept: dict[int, bool] = {}

    def run(k: int) -> StepResult:
        runner = StepRunner(
            cast(StageModel, modules[k]),
            index=k,
            count=2,
            peers=peers[k],
            trainable=list(modules[k].named_parameters()),
            compression="none",
            max_grad_norm=1.0,
            group=_Group(short[k]),
            ordered_terms=True,
        )
        try:
            return runner.run(0, micros if k == 0 else None, len(micros), attempt)
        finally:
            kept[k] = any(p.grad is not None for p in modules[k].parameters())

    try:
        got = on_threads({k: lambda k=k: run(k) for k in range(2)})
    finally:
        for p in peers:
            p.close()
    return {k: (got[k], kept[k]) for k in range(2)}


@pytest.mark.parametrize("short", [(False, True), (True, False)], ids=["last", "first"])
def test_a_short_result_on_any_stage_drops_the_step_on_every_stage(
    short: tuple[bool, bool],
) -> None:
    for k, (result, kept) in _step(short).items():
        assert isinstance(result, ShortStepError), (k, result)
        assert not kept, f"stage {k} kept gradients of a step it will train again"


def test_a_whole_step_trains_and_the_last_permitted_attempt_keeps_what_arrived() -> None:
    for outcome in (_step((False, False)), _step((True, True), attempt=PIPELINES - 1)):
        for k, (result, kept) in outcome.items():
            assert isinstance(result, StepResult), (k, result)
            assert kept, f"stage {k} has no gradients to apply"
