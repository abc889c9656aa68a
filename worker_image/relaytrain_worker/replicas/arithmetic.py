"""Synchronous data parallelism across pipelines of different shapes: the exact arithmetic.

A job may train R pipelines whose layer splits differ (each planned on its own GPUs) on
one global batch per step. Each step is then exactly the single-pipeline step of the
whole global batch, and every pipeline ends the step with bit-identical weights:

1. **Shares.** The step's M micro-batches are cut into contiguous runs in pipeline order
   (`micro_ranges`): pipeline 0 trains micro-batches 0..c0-1, pipeline 1 the next c1, ...
2. **Normaliser.** Stage 0 of every pipeline counts the label tokens of its share; the
   group sums the counts (`total_label_tokens`, integers: order-free) and every micro-batch's
   summed token loss is divided by that global count, as one pipeline divides by its step's.
3. **Gradient sum.** After its last backward every stage hands its accumulated gradients
   (scaled by 1/global count, so they are summed, never averaged) to the group, keyed by
   parameter name; the last stage adds its float64 loss sum under `LOSS_KEY`. For each
   name the reduced value is the left fold in pipeline order (`reduce_sum`):
   ``((c_0 + c_1) + c_2) + ...``. Every holder of a name in every pipeline folds the same
   R tensors in the same order, so all get the same bits. Against single-process
   accumulation over the global batch, ``((g_0 + g_1) + g_2) + ...`` in micro-batch order:
   the shares are contiguous and autograd accumulates a stage's micro-batches in order, so
   pipeline 0 gives ``(g_0 + g_1) + ...`` and the fold continues that very sum as long as
   every later pipeline gives a single micro-batch's gradient (shares such as 2:1, 1:1,
   3:1:1): then LoRA gradients and the loss are equal bit for bit. A later pipeline with
   several micro-batches adds them among themselves first (``g_0 + (g_1 + g_2)``): equal
   to float32 rounding, not bit for bit — and every replica still gets the same bits.
   A tied weight (`full` training: the embedding on stage 0, the head on the last stage)
   is reduced as two halves under two keys, `TIED_NAME` (the embedding's half) and
   `TIED_HEAD_NAME` (the head's); the pipeline then adds the two reduced halves as it does
   without replicas (a + b == b + a), so every holder has the same sum.
4. **Clip norm.** The global norm is computed inside each pipeline from the reduced
   gradients, by the pipeline's existing chain pass (`schedule.StepRunner._finish`): one
   2-norm per parameter (`torch._foreach_norm`), listed in model order — stage after stage,
   the slice's parameter order within a stage, which is the unsplit model's order; a tied
   weight counted once, first — and the last stage takes the 2-norm of that vector. Each
   entry is a function of a reduced gradient, identical in every pipeline, and the vector's
   order does not depend on the split, so every pipeline computes the same total, bit for
   bit: the number `clip_grad_norm_` gives on the unsplit model. Every stage of every
   pipeline then scales by the same coefficient and AdamW (per-tensor, `foreach=False`)
   applies the same update from the same state.

The exchange goes through a `ReplicaGroup` (`pipeline/stats.py`: what a pipeline's step
asks of the others). `InProcessGroup` (threads of one process: the tests) is the reference;
`LinkGroup` (`group.py`) implements the same two calls over the authenticated stage links as
a star per name: the holder in the lowest member pipeline receives the other
holders' contributions, folds them in pipeline order (so the fold order stays fixed) and
sends each its result. It survives a pipeline leaving mid-exchange (see `LinkGroup`); a
member pipeline that left simply contributes nothing to that step. It costs the leader
(R - 1) times its gradients' bytes each way per step and every other stage one times: small
for adapters; for `full` training a reduce-scatter with a fixed chunk order would cut the
leader's share. With pipelines missing, a step's micro-batches are shared among the members
by `live_shares`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relaytrain_worker.model.methods import TIED_HEAD_NAME, TIED_NAME
from relaytrain_worker.pipeline.stats import ITEMS_KEY, LOSS_KEY, STATS, TOKENS_KEY

MEMBER_KEY = "relaytrain.members"
"""Stage 0's membership mark (1 at its pipeline's index; 2 when rejoining), folded by the
first stages at the start of every step (`LinkGroup.agree_members`)."""
COUNT_KEY = "relaytrain.label_tokens"
"""Stage 0's label-token count, folded when the count is exchanged (`total_tokens`)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_NAMES = {TIED_NAME, MEMBER_KEY, COUNT_KEY}
"""Non-layer names held by stage 0 (the embedding, the membership mark, the count)."""
_LAST_NAMES = {TIED_HEAD_NAME, "model.norm.weight", LOSS_KEY, TOKENS_KEY, ITEMS_KEY}
"""Non-layer names held by the last stage (final norm, head, the loss, the token counts)."""

WAIT_SECONDS = 900.0
"""Longest wait for the other pipelines' contributions; a live pipeline never takes this long."""


def micro_ranges(counts: Sequence[int]) -> list[range]:
    """The micro-batches of a step each pipeline trains: contiguous runs in pipeline order.

    `counts[p]` is pipeline p's share (micro-batches per step); the global batch has
    `sum(counts)` micro-batches. Contiguity is what makes the fold in `reduce_sum` continue
    single-process accumulation exactly.
    """
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"shares must be non-negative micro-batch counts, got {list(counts)}")
    out = []
    start = 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def live_shares(shares: Sequence[int], members: Iterable[int]) -> list[int]:
    """Every pipeline's micro-batches of a step trained by `members` only: the others'
    shares go to the members, one micro-batch at a time to the member that would then have
    the least per unit of its own share (its speed, as the planner sized it), the lowest
    pipeline on a tie. A function of the shares and the member set alone, so every stage
    computes the same; the step keeps all `sum(shares)` micro-batches. All pipelines
    members: `shares` unchanged."""
    live = sorted(set(members))
    if not live or any(not 0 <= q < len(shares) for q in live):
        raise ValueError(f"members {live} are not pipelines of {len(shares)} shares")
    out = [shares[q] if q in live else 0 for q in range(len(shares))]
    for _ in range(sum(shares) - sum(out)):
        q = min(live, key=lambda q: ((out[q] + 1) / max(shares[q], 1), q))
        out[q] += 1
    return out


def total_label_tokens(counts: Sequence[int]) -> int:
    """The step's loss normaliser: the label tokens of every pipeline's share, summed."""
    return int(sum(counts))


def reduce_sum(contributions: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per name, the left fold ``((c[0] + c[1]) + c[2]) + ...`` in pipeline order.

    `contributions[p]` is pipeline p's {name: tensor}; every pipeline must contribute the
    same names (they hold the same model). The result is fresh tensors (the inputs are
    not written), the same bits for every caller given the same inputs.
    """
    if not contributions:
        raise ValueError("no contributions to reduce")
    names = list(contributions[0])
    for p, c in enumerate(contributions[1:], start=1):
        if set(c) != set(names):
            diff = sorted(set(c) ^ set(names))
            raise ValueError(f"pipeline {p} contributes other names than pipeline 0: {diff}")
    out = {}
    for name in names:
        acc = contributions[0][name].detach().clone()
        for c in contributions[1:]:
            acc.add_(c[name])
        out[name] = acc
    return out


def layer_of(name: str) -> int | None:
    """The global decoder layer a parameter name belongs to (None for embedding, head...)."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Slice:
    """What one stage holds: decoder layers [start, end), and the embedding (first) or the
    final norm and head (last)."""

    start: int
    end: int
    first: bool
    last: bool

    @classmethod
    def of(cls, split: Sequence[tuple[int, int]], stage: int) -> Slice:
        """Stage `stage` of a pipeline split as `split` ([start, end) per stage)."""
        start, end = split[stage]
        return cls(start, end, stage == 0, stage == len(split) - 1)

    def holds(self, name: str) -> bool:
        """Whether this stage holds the parameter (or reduced value) `name`."""
        layer = layer_of(name)
        if layer is not None:
            return self.start <= layer < self.end
        if name in _FIRST_NAMES:
            return self.first
        if name in _LAST_NAMES:
            return self.last
        raise ValueError(f"{name!r} is neither a decoder layer's nor a known end-stage name")


def holds(split: Sequence[tuple[int, int]], stage: int, name: str) -> bool:
    """Whether stage `stage` of a pipeline split as `split` ([start, end) per stage) holds
    the parameter (or reduced value) `name`."""
    return Slice.of(split, stage).holds(name)


def segment_peers(
    splits: Sequence[Sequence[tuple[int, int]]], pipeline: int, stage: int
) -> list[tuple[int, int]]:
    """(pipeline, stage) of every stage of the other pipelines that shares some layer, or the
    embedding or head, with stage `stage` of pipeline `pipeline`: whom a link-based group
    exchanges with. In pipeline order, then stage order."""
    mine = splits[pipeline]
    start, end = mine[stage]
    out = []
    for q, split in enumerate(splits):
        if q == pipeline:
            continue
        for j, (s, e) in enumerate(split):
            overlap = max(start, s) < min(end, e)
            ends = (stage == 0 and j == 0) or (stage == len(mine) - 1 and j == len(split) - 1)
            if overlap or ends:
                out.append((q, j))
    return out


class InProcessGroup:
    """A `ReplicaGroup` (pipeline/stats.py) for pipelines running as threads of one process
    (tests, benches).

    Every stage of every pipeline calls `reduce` once per step and stage 0 of each pipeline
    calls `total_tokens` once per step. A caller waits until every pipeline has given the
    names it gave (not for unrelated stages), then folds them itself — as a link-based group
    would after receiving its peers' frames.
    """

    def __init__(self, stages: Sequence[int], *, timeout: float = WAIT_SECONDS) -> None:
        """`stages[p]`: stage count of pipeline p."""
        if not stages:
            raise ValueError("a group needs at least one pipeline")
        self._stages = list(stages)
        self._timeout = timeout
        self._cond = threading.Condition()
        self._tokens: dict[int, dict[int, int]] = {}
        self._posts: dict[tuple[str, int], dict[str, dict[int, torch.Tensor]]] = {}
        self._left: dict[tuple[str, int], int] = {}
        """(board, step) -> callers that have not read it yet (the board is dropped at 0)."""
        self._error: str | None = None

    @property
    def pipelines(self) -> int:
        return len(self._stages)

    def abort(self, reason: str) -> None:
        """Wake every waiter with an error (a pipeline failed)."""
        with self._cond:
            self._error = reason
            self._cond.notify_all()

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        with self._cond:
            board = self._tokens.setdefault(step, {})
            self._left.setdefault(("tokens", step), self.pipelines)
            if pipeline in board:
                raise ValueError(f"pipeline {pipeline} gave its token count of step {step} twice")
            board[pipeline] = count
            self._cond.notify_all()
            self._wait(lambda: len(board) == self.pipelines, step)
            total = total_label_tokens([board[p] for p in range(self.pipelines)])
            self._read(("tokens", step), self._tokens, step)
        return total

    def reduce(
        self,
        step: int,
        pipeline: int,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        what: str = "grads",
    ) -> dict[str, torch.Tensor]:
        key = (what, step)
        with self._cond:
            board = self._posts.setdefault(key, {})
            self._left.setdefault(key, self.pipelines if what == STATS else sum(self._stages))
            for name, tensor in tensors.items():
                slot = board.setdefault(name, {})
                if pipeline in slot:
                    raise ValueError(
                        f"pipeline {pipeline} gave {name} twice in step {step} (stage {stage})"
                    )
                slot[pipeline] = tensor.detach().clone()
            self._cond.notify_all()
            self._wait(lambda: all(len(board[n]) == self.pipelines for n in tensors), step)
            contributions = [{n: board[n][p] for n in tensors} for p in range(self.pipelines)]
            self._read(key, self._posts, key)
        return reduce_sum(contributions)

    def _wait(self, ready: Callable[[], bool], step: int) -> None:
        ok = self._cond.wait_for(lambda: self._error is not None or ready(), self._timeout)
        if self._error is not None:
            raise RuntimeError(f"replica group aborted: {self._error}")
        if not ok:
            raise TimeoutError(f"the other pipelines gave nothing for step {step} in time")

    def _read(self, key: tuple[str, int], boards: MutableMapping[Any, Any], board: Any) -> None:
        self._left[key] -= 1
        if self._left[key] == 0:
            del self._left[key]
            del boards[board]
