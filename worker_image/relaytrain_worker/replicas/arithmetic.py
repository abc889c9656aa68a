"""Synchronous data parallelism across pipelines of different shapes: the exact arithmetic.

A job may train R pipelines whose layer splits differ (each planned on its own GPUs) on
one global batch per step. Each step is then exactly the single-pipeline step of the
whole global batch, and every pipeline ends the step with bit-identical weights:

1. **Shares.** The step's M micro-batches are cut into contiguous runs in pipeline order
   (`micro_ranges`): pipeline 0 trains micro-batches 0..c0-1, pipeline 1 the next c1, ...
2. **Normaliser.** Stage 0 of every pipeline counts the label tokens of its share; the
   group sums the counts (`total_label_tokens`, integers: order-free) and every micro-batch's
   summed token loss is divided by that global count, as one pipeline divides by its step's.
3. **Gradient sum.** After its last backward every stage hands its gradients (scaled by
   1/global count, so they are summed, never averaged) to the group, keyed by parameter
   name; the last stage adds its float64 loss under `LOSS_KEY`. Single-process
   accumulation over the global batch is the left fold ``((g_0 + g_1) + g_2) + ...`` in
   micro-batch order, and float32 addition is not associative: a later pipeline that added
   its own micro-batches first (``g_0 + (g_1 + g_2)``) would land float32 rounding away,
   and AdamW magnifies that over a run. So a stage gives *terms* (`stats.TERMS`): the stages
   of the step's lowest member pipeline (`ReplicaGroup.first_member`) accumulate their
   micro-batches as one pipeline does (a stack of one term: the fold's opening prefix); with
   the adapter methods (`ordered_terms`) every other pipeline keeps each micro-batch's
   gradient and loss apart and gives them as a stack in micro-batch order. For each name
   the reduced value is `fold`: every term of every pipeline added in turn, pipeline by
   pipeline. The shares are contiguous runs, so that is single-process accumulation itself:
   LoRA gradients, loss and (below) norm and weights equal it bit for bit for *any* shares
   and any membership from step to step, and every holder of a name folds the same terms
   in the same order, so all get the same bits. The cost: a stage of a pipeline other than
   the first sends its share's count of gradient copies instead of one, and holds them until
   the step ends (adapter gradients: a few MB per stage). `full` training keeps one
   accumulated term per pipeline (its gradients are the whole model's), so it equals
   single-process within float32 rounding — bit for bit where every later pipeline trains
   one micro-batch.
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
from relaytrain_worker.pipeline.stats import (
    GATHERS,
    GRADS,
    ITEMS_KEY,
    LOSS_KEY,
    STATS,
    TERMS,
    TOKENS_KEY,
)

MEMBER_KEY = "relaytrain.members"
"""Stage 0's membership mark (1 at its pipeline's index; 2 when rejoining), folded by the
first stages at the start of every step (`LinkGroup.agree_members`)."""
SHARES_KEY = "relaytrain.shares"
"""Stage 0's share (its micro-batches per step as planned) at its pipeline's index, folded
with the membership mark: the weights a step's micro-batches are shared by (`live_shares`),
the same for every stage, added pipelines' included."""
COUNT_KEY = "relaytrain.label_tokens"
"""Stage 0's label-token count, folded when the count is exchanged (`total_tokens`)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_NAMES = {TIED_NAME, MEMBER_KEY, SHARES_KEY, COUNT_KEY}
"""Non-layer names held by stage 0 (the embedding, the membership mark and shares, the
count)."""
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


def live_shares(
    shares: Sequence[int], members: Iterable[int], total: int | None = None
) -> list[int]:
    """The `total` micro-batches of a step (`sum(shares)` unless given) shared among
    `members` in proportion to their `shares` (each pipeline's speed, as the planner sized
    it): one micro-batch at a time to the member that would then have the least per unit of
    its own share (D'Hondt's rule); on a tie to the one with fewest so far, then the lowest
    pipeline. A function of the shares,
    the member set and the total alone, so every stage computes the same. Every pipeline a
    member and `total` their sum: `shares` unchanged (each gets its share before anyone gets
    more than one per unit of its own); the others' shares go to the members; a pipeline
    added beside the planned ones (the shares then add up to more than `total`) takes its
    part from everyone's."""
    live = sorted(set(members))
    if not live or any(not 0 <= q < len(shares) or shares[q] < 1 for q in live):
        raise ValueError(f"members {live} are not pipelines of shares {list(shares)}")
    out = [0] * len(shares)
    for _ in range(sum(shares) if total is None else total):
        q = min(live, key=lambda q: ((out[q] + 1) / shares[q], out[q], q))
        out[q] += 1
    return out


def total_label_tokens(counts: Sequence[int]) -> int:
    """The step's loss normaliser: the label tokens of every pipeline's share, summed."""
    return int(sum(counts))


def fold(parts: Sequence[torch.Tensor], *, terms: bool = False) -> torch.Tensor:
    """The left fold ``((t_0 + t_1) + t_2) + ...`` of `parts` in order, as a fresh tensor.

    With `terms`, each part is a stack whose leading dimension lists its terms (empty for a
    pipeline that trained no micro-batch), and every term of every part is added in turn:
    folding ``[a, b]`` then ``[c]`` is folding ``a, b, c``. Without, each part is one term.
    All parts empty: zeros.
    """
    if not parts:
        raise ValueError("nothing to fold")
    if not terms:
        return prefix([part.unsqueeze(0) for part in parts])[0]
    return value_of(prefix(parts))


def prefix(stacks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fold of every term of `stacks` (see `fold`) as a stack of one term, or of none
    when there is no term: what a star's leader passes on as the sum so far, so that the
    next pipeline continues it with its own terms (`star.py`, rounds)."""
    if not stacks:
        raise ValueError("nothing to fold")
    rows = [row for stack in stacks for row in stack.unbind(0)]
    if not rows:
        return stacks[0].detach().clone()
    acc = rows[0].detach().clone()
    for row in rows[1:]:
        acc.add_(row)
    return acc.unsqueeze(0)


def value_of(stack: torch.Tensor) -> torch.Tensor:
    """The value of a sum so far (`prefix`): its one term, or zeros when it has none."""
    return stack[0] if len(stack) else stack.new_zeros(stack.shape[1:])


def gather(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts as given, stacked in order (a `GATHERS` exchange's result)."""
    if not parts:
        raise ValueError("nothing to gather")
    return torch.stack([part.detach() for part in parts])


def reduce_sum(
    contributions: Sequence[Mapping[str, torch.Tensor]],
    *,
    terms: bool = False,
    gathered: bool = False,
) -> dict[str, torch.Tensor]:
    """Per name, the `fold` of every pipeline's contribution in pipeline order (with
    `gathered`, their `gather` instead).

    `contributions[p]` is pipeline p's {name: tensor} (with `terms`, a stack of terms per
    name); every pipeline must contribute the same names (they hold the same model). The
    result is fresh tensors (the inputs are not written), the same bits for every caller
    given the same inputs.
    """
    if not contributions:
        raise ValueError("no contributions to reduce")
    names = list(contributions[0])
    for p, c in enumerate(contributions[1:], start=1):
        if set(c) != set(names):
            diff = sorted(set(c) ^ set(names))
            raise ValueError(f"pipeline {p} contributes other names than pipeline 0: {diff}")
    if gathered:
        return {name: gather([c[name] for c in contributions]) for name in names}
    return {name: fold([c[name] for c in contributions], terms=terms) for name in names}


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

    @property
    def first_member(self) -> int:
        return 0  # every pipeline trains every step

    def short(self, step: int) -> bool:
        return False  # no pipeline leaves: an abort fails the step instead

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
        what: str = GRADS,
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
        return reduce_sum(contributions, terms=what in TERMS, gathered=what in GATHERS)

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
