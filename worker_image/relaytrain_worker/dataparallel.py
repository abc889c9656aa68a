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

The exchange goes through a `ReplicaGroup`. `InProcessGroup` (threads of one process: the
tests) is the reference; `LinkGroup` implements the same two calls over the authenticated
stage links: each holder sends its contributions to the holders of the same names in the
other pipelines (`segment_peers`), receives theirs, and folds locally in pipeline order —
an all-gather per layer segment, which keeps the fold order fixed where a ring reduce would
not. It costs each stage (R - 1) times its gradients' bytes each way per step: small for
adapters; for `full` training a reduce-scatter with a fixed chunk order would cut it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from relaytrain_worker.methods import TIED_HEAD_NAME, TIED_NAME
from relaytrain_worker.peers import AsyncLink, LinkLike
from relaytrain_worker.transport import Frame

LOSS_KEY = "relaytrain.loss_sum"
"""The last stage's float64 summed token loss, reduced with the gradients (no parameter
has this name)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_NAMES = {TIED_NAME}
"""Non-layer names held by stage 0 (the embedding)."""
TOKENS_KEY = "relaytrain.input_tokens"
"""The last stage's non-padding input tokens of the step (float64), reduced with the
gradients so that every pipeline's last stage knows the whole step's (for tokens/s)."""
_LAST_NAMES = {TIED_HEAD_NAME, "model.norm.weight", LOSS_KEY, TOKENS_KEY}
"""Non-layer names held by the last stage (final norm, head, the loss, the token count)."""

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


class ReplicaGroup(Protocol):
    """How the stages of R pipelines exchange what a step must agree on."""

    @property
    def pipelines(self) -> int:
        """R, the number of pipelines (replicas)."""
        ...

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        """Stage 0 of `pipeline` gives its share's label tokens; returns the global count."""
        ...

    def reduce(
        self, step: int, pipeline: int, stage: int, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Stage `stage` of `pipeline` gives its contributions by name; returns, for each of
        those names, the fold of every pipeline's contribution in pipeline order
        (`reduce_sum`). Contributions are not written to."""
        ...


class InProcessGroup:
    """A `ReplicaGroup` for pipelines running as threads of one process (tests, benches).

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
        self._posts: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
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
        self, step: int, pipeline: int, stage: int, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        with self._cond:
            board = self._posts.setdefault(step, {})
            self._left.setdefault(("grads", step), sum(self._stages))
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
            self._read(("grads", step), self._posts, step)
        return reduce_sum(contributions)

    def _wait(self, ready: Callable[[], bool], step: int) -> None:
        ok = self._cond.wait_for(lambda: self._error is not None or ready(), self._timeout)
        if self._error is not None:
            raise RuntimeError(f"replica group aborted: {self._error}")
        if not ok:
            raise TimeoutError(f"the other pipelines gave nothing for step {step} in time")

    def _read(self, key: tuple[str, int], boards: MutableMapping[int, Any], step: int) -> None:
        self._left[key] -= 1
        if self._left[key] == 0:
            del self._left[key]
            del boards[step]


class LinkGroup:
    """A `ReplicaGroup` over authenticated stage links: one stage's view.

    Stage `stage` of pipeline `pipeline` holds one link to every stage in
    `segment_peers(splits, pipeline, stage)` (identity `p<q>/s<j>` of the same job CA);
    `peers` says what each of them holds. `from_splits` builds it from every pipeline's
    split; a stage process builds it from its stage document, which lists its peers
    (`relaytrain_worker.replicas`).
    Each call sends every peer the contributions that peer also holds, in one frame
    (uncompressed: the sum must be exact), receives the peer's, and folds every name in
    pipeline order (`reduce_sum`) — the same R tensors in the same order on every holder,
    so the same bits. Both ends of a link make the same calls in the same order (the token
    count at the start of a step, the gradients at its end), so frames arrive in the
    order they are expected; anything else breaks the link (`AsyncLink.recv`).
    """

    def __init__(
        self,
        pipelines: int,
        pipeline: int,
        stage: int,
        peers: Mapping[tuple[int, int], Slice],
        links: Mapping[tuple[int, int], LinkLike],
    ) -> None:
        if sorted(links) != sorted(peers):
            raise ValueError(
                f"stage p{pipeline}/s{stage} needs links to {sorted(peers)}, got {sorted(links)}"
            )
        if {q for q, _ in peers} != set(range(pipelines)) - {pipeline}:
            raise ValueError(
                f"stage p{pipeline}/s{stage} has peers in pipelines "
                f"{sorted({q for q, _ in peers})}, not in every other one of {pipelines}"
            )
        self._pipelines = pipelines
        self._peers = dict(peers)
        self._pipeline = pipeline
        self._stage = stage
        self._links = {
            peer: AsyncLink(link, f"p{peer[0]}/s{peer[1]}") for peer, link in links.items()
        }
        for link in self._links.values():
            link.start()

    @classmethod
    def from_splits(
        cls,
        splits: Sequence[Sequence[tuple[int, int]]],
        pipeline: int,
        stage: int,
        links: Mapping[tuple[int, int], LinkLike],
    ) -> LinkGroup:
        """The group of stage `stage` of `pipeline`, every pipeline's split known."""
        want = segment_peers(splits, pipeline, stage)
        if sorted(links) != want:
            raise ValueError(
                f"stage p{pipeline}/s{stage} needs links to {want}, got {sorted(links)}"
            )
        peers = {(q, j): Slice.of(splits[q], j) for q, j in want}
        return cls(len(splits), pipeline, stage, peers, links)

    @property
    def pipelines(self) -> int:
        return self._pipelines

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        self._check(pipeline, 0)
        firsts = [peer for peer in self._links if peer[1] == 0]
        for peer in firsts:
            self._links[peer].send(Frame("replica_tokens", step, -1, {}, {"count": count}))
        counts = {self._pipeline: count}
        for peer in firsts:
            counts[peer[0]] = int(self._links[peer].recv("replica_tokens", step).meta["count"])
        return total_label_tokens([counts[p] for p in range(self.pipelines)])

    def reduce(
        self, step: int, pipeline: int, stage: int, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        self._check(pipeline, stage)
        for (q, j), link in self._links.items():
            theirs = {n: t.detach() for n, t in tensors.items() if self._peers[(q, j)].holds(n)}
            link.send(Frame("replica_grads", step, -1, theirs), "none")
        got: dict[int, dict[str, torch.Tensor]] = {self._pipeline: dict(tensors)}
        for (q, _), link in self._links.items():
            got.setdefault(q, {}).update(link.recv("replica_grads", step).tensors)
        return reduce_sum([{n: got[p][n] for n in tensors} for p in range(self.pipelines)])

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every frame given to the links has been handed to the socket (before
        the process exits: a peer may still be waiting for this stage's last contribution)."""
        for link in self._links.values():
            link.flush(timeout)

    def close(self) -> None:
        for link in self._links.values():
            link.close()

    def _check(self, pipeline: int, stage: int) -> None:
        if (pipeline, stage) != (self._pipeline, self._stage):
            raise ValueError(
                f"this group is p{self._pipeline}/s{self._stage}'s, not p{pipeline}/s{stage}'s"
            )
