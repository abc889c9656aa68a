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
stage links as a star per name: the holder in the lowest member pipeline receives the other
holders' contributions, folds them in pipeline order (so the fold order stays fixed) and
sends each its result. It survives a pipeline leaving mid-exchange (see `LinkGroup`); a
member pipeline that left simply contributes nothing to that step. It costs the leader
(R - 1) times its gradients' bytes each way per step and every other stage one times: small
for adapters; for `full` training a reduce-scatter with a fixed chunk order would cut the
leader's share. With pipelines missing, a step's micro-batches are shared among the members
by `live_shares`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from relaytrain_worker.linkauth import LinkBroken
from relaytrain_worker.methods import TIED_HEAD_NAME, TIED_NAME
from relaytrain_worker.peers import LinkLike, ReplicaPort
from relaytrain_worker.transport import Frame

log = logging.getLogger("relaytrain.replicas")

LOSS_KEY = "relaytrain.loss_sum"
"""The last stage's float64 summed token loss, reduced with the gradients (no parameter
has this name)."""

MEMBER_KEY = "relaytrain.members"
"""Stage 0's membership mark (1 at its pipeline's index; 2 when rejoining), folded by the
first stages at the start of every step (`LinkGroup.agree_members`)."""
COUNT_KEY = "relaytrain.label_tokens"
"""Stage 0's label-token count, folded when the count is exchanged (`total_tokens`)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_NAMES = {TIED_NAME, MEMBER_KEY, COUNT_KEY}
"""Non-layer names held by stage 0 (the embedding, the membership mark, the count)."""
TOKENS_KEY = "relaytrain.input_tokens"
"""The last stage's non-padding input tokens of the step (float64), reduced with the
gradients so that every pipeline's last stage knows the whole step's (for tokens/s)."""
ITEMS_KEY = "relaytrain.loss_items"
"""The last stage's label tokens of its pipeline's share (float64), reduced with the loss
sum in periodic mode, where each pipeline's loss is normalised by its own share."""
_LAST_NAMES = {TIED_HEAD_NAME, "model.norm.weight", LOSS_KEY, TOKENS_KEY, ITEMS_KEY}
"""Non-layer names held by the last stage (final norm, head, the loss, the token counts)."""

STATS = "stats"
"""The exchange of the last stages alone (periodic mode's loss and counts, every step)."""

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
        self,
        step: int,
        pipeline: int,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        what: str = "grads",
    ) -> dict[str, torch.Tensor]:
        """Stage `stage` of `pipeline` gives its contributions by name; returns, for each of
        those names, the fold of every pipeline's contribution in pipeline order
        (`reduce_sum`). Contributions are not written to. `what` names the exchange: every
        stage of every pipeline makes one of each per step (`grads`: the step's gradients;
        `outer`: a periodic outer step's weights, `periodic`)."""
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


class LinkGroup:
    """A `ReplicaGroup` over authenticated stage links: one stage's view, tolerant of whole
    pipelines leaving (docs/worker.md, "Several pipelines as processes": faults).

    Stage `stage` of pipeline `pipeline` holds one link to every stage in
    `segment_peers(splits, pipeline, stage)` (identity `p<q>/s<j>` of the same job CA);
    `peers` says what each of them holds. Each link is read by a thread of its own
    (`peers.ReplicaPort`), so a peer's departure is seen at once and queries are answered
    whatever this stage is doing.

    **Star reduce.** For every name, the holder in the lowest *member* pipeline leads: the
    others send it their contributions, it folds them in pipeline order (`reduce_sum`'s
    arithmetic: the same bits as before) and sends each the result. Members are the
    pipelines training this step (`members`, set by `begin`; every pipeline until then).
    A member whose link has ended is gone for the rest of the step: its contribution is
    simply absent if it had not arrived (the step trains on what arrived).

    **Leader failure.** A holder waiting for a result whose leader's link ends turns to the
    holder of the next lowest member pipeline still linked and sends it its contribution.
    That holder, finding itself leading while a lower member has gone, first asks every
    member holder whether it already has the result of this step (a query, answered by the
    reader thread once the answerer has the result or has seen every lower pipeline gone —
    so no late result of the old leader can arrive afterwards): a result anyone has wins,
    name by name. Only the names nobody has are folded again from the contributions. A
    stage that has a step's result answers a late contribution with it (`_results`, the
    last two steps). Under crash failures (a pipeline that leaves closes all its links)
    every member therefore ends the step with the same bits.
    """

    def __init__(
        self,
        pipelines: int,
        pipeline: int,
        stage: int,
        peers: Mapping[tuple[int, int], Slice],
        links: Mapping[tuple[int, int], LinkLike],
        *,
        members: Iterable[int] | None = None,
        timeout: float = WAIT_SECONDS,
    ) -> None:
        self.members: set[int] = set(range(pipelines)) if members is None else {*members, pipeline}
        """The pipelines training the current step, as this stage knows them."""
        unlinked = {q for q, _ in set(peers) - set(links)}
        if set(links) - set(peers) or unlinked & self.members:
            raise ValueError(
                f"stage p{pipeline}/s{stage} needs links to {sorted(peers)} (but those of "
                f"pipelines given up), got {sorted(links)}"
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
        self._timeout = timeout
        self._cond = threading.Condition()
        self._ports: dict[tuple[int, int], ReplicaPort] = {}
        """The links of this stage to member pipelines' stages (and, after `begin`, joiners')."""
        self._offered: dict[tuple[int, int], ReplicaPort] = {}
        """Links to the stages of a pipeline rejoining, not admitted yet (`offer`)."""
        self._results: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        """Settled results of this stage's names, by (what, step): the last two steps."""
        self._partial: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        """Results of a reduce under way, name by name as they came (answers use them)."""
        self._queries: list[tuple[ReplicaPort, tuple[int, int], str, int]] = []
        """Queries of a takeover leader not answered yet."""
        self._items: tuple[int, int] | None = None
        """(step, global label tokens) when the stage already knows the step's count."""
        self._broke: dict[int, int] = {}
        """Lower pipeline -> the step its link to this stage ended (the hiccup rule)."""
        self.step = -1
        self.closed = False
        for peer, link in links.items():
            self._ports[peer] = self._port(peer, link)

    @classmethod
    def from_splits(
        cls,
        splits: Sequence[Sequence[tuple[int, int]]],
        pipeline: int,
        stage: int,
        links: Mapping[tuple[int, int], LinkLike],
        **kwargs: Any,
    ) -> LinkGroup:
        """The group of stage `stage` of `pipeline`, every pipeline's split known."""
        want = segment_peers(splits, pipeline, stage)
        if sorted(links) != want:
            raise ValueError(
                f"stage p{pipeline}/s{stage} needs links to {want}, got {sorted(links)}"
            )
        peers = {(q, j): Slice.of(splits[q], j) for q, j in want}
        return cls(len(splits), pipeline, stage, peers, links, **kwargs)

    @property
    def pipelines(self) -> int:
        return self._pipelines

    def _port(self, peer: tuple[int, int], link: LinkLike) -> ReplicaPort:
        port = ReplicaPort(link, f"p{peer[0]}/s{peer[1]}", self._cond, self._on_frame)
        port.start()
        return port

    # -- membership ------------------------------------------------------------------

    def live(self, q: int) -> bool:
        """Whether member pipeline `q` is still linked to this stage (this one always is)."""
        if q == self._pipeline:
            return True
        ports = [port for (p, _), port in self._ports.items() if p == q]
        return bool(ports) and not any(port.gone for port in ports)

    def gone_peers(self) -> list[tuple[int, int]]:
        """Peers with no working link (their pipeline left, or never came): whom a survivor
        links to again (`replicas.ReplicaLinks.relink`)."""
        with self._cond:
            out = []
            for peer in self._peers:
                port = self._offered.get(peer) or self._ports.get(peer)
                if port is None or port.gone:
                    out.append(peer)
            return out

    def links(self) -> dict[str, LinkLike]:
        """The link to each member pipeline's peer stage by the peer's name (`p1/s0`): what
        the stage's link metrics count."""
        with self._cond:
            return {port.name: port.out.link for port in self._ports.values()}

    def offer(self, peer: tuple[int, int], link: LinkLike) -> None:
        """A fresh link to `peer`, a stage of a pipeline rejoining: read at once, used from
        the step that admits its pipeline (`begin`)."""
        if peer not in self._peers:
            link.close()
            raise ValueError(f"p{peer[0]}/s{peer[1]} is no peer of this stage")
        with self._cond:
            if self.closed:
                link.close()
                return
            old = self._offered.pop(peer, None)
            if old is not None:
                old.close()
            self._offered[peer] = self._port(peer, link)
            self._cond.notify_all()

    def begin(self, step: int, members: Iterable[int], joined: Iterable[int] = ()) -> None:
        """Step `step` trains `members`; `joined` of them rejoin with it. Their offered links
        become the group's (waited for while missing). LinkBroken when a lower pipeline this
        stage lost its link to is still a member two steps later: a break between two live
        pipelines (not a crash), after which the higher one leaves and rejoins."""
        members = set(members)
        with self._cond:
            self.step = step
            for q in sorted(set(joined)):
                want = [
                    peer
                    for peer in self._peers
                    if peer[0] == q and (peer not in self._ports or self._ports[peer].gone)
                ]
                ok = self._cond.wait_for(
                    lambda want=want: all(p in self._offered for p in want),  # type: ignore[misc]
                    self._timeout,
                )
                if not ok:
                    raise TimeoutError(f"pipeline {q} rejoined without linking to this stage")
                for peer in want:
                    old = self._ports.get(peer)
                    if old is not None:
                        old.close()
                    self._ports[peer] = self._offered.pop(peer)
            for (q, _), port in self._ports.items():
                if port.gone and q < self._pipeline:
                    self._broke.setdefault(q, step)
            for q, at in list(self._broke.items()):
                if q in members and self.live(q):
                    del self._broke[q]  # it rejoined: a new link
                elif q in members and step >= at + 2:
                    raise LinkBroken(
                        f"pipeline {q} is still training but its link to this stage broke at "
                        f"step {at}: pipeline {self._pipeline} leaves"
                    )
            self.members = members | {self._pipeline}
            for port in [*self._ports.values(), *self._offered.values()]:
                port.drop_before(step - 1)
            for table in (self._results, self._partial):
                for key in [k for k in table if k[1] < step - 2]:
                    del table[key]

    def agree_members(self, step: int) -> tuple[set[int], set[int]]:
        """Stage 0: the pipelines that train step `step` and those of them that rejoin at it,
        agreed among the first stages of every member (a star reduce of who is there,
        led as any other; the leader admits the pipelines whose join request it holds)."""
        self._check_first()
        mark = torch.zeros(self._pipelines, dtype=torch.float64)
        mark[self._pipeline] = 1.0
        got = self._star("member", step, {MEMBER_KEY: mark}, sorted(self.members))
        return _members(got[MEMBER_KEY])

    def join(self, timeout: float) -> tuple[int, set[int], set[int]]:
        """Stage 0 of a pipeline rejoining: ask the lowest member's first stage to admit this
        pipeline; returns (step, members, joined) of the step it is admitted at. LinkBroken
        when that stage leaves meanwhile (the pipeline then tries again from scratch)."""
        self._check_first()
        mark = torch.zeros(self._pipelines, dtype=torch.float64)
        mark[self._pipeline] = 2.0
        with self._cond:
            firsts = [p for p in sorted(self._ports) if p[1] == 0 and self.live(p[0])]
            if not firsts:
                raise LinkBroken("no live pipeline to rejoin")
            leader = self._ports[firsts[0]]
        leader.send(Frame("join", -1, -1, {MEMBER_KEY: mark}))
        with self._cond:
            ok = self._cond.wait_for(
                lambda: leader.gone or leader.has("result:member", None), timeout
            )
            frame = leader.take("result:member", None)
        if frame is None:
            if not ok:
                raise TimeoutError(f"{leader.name} did not admit this pipeline in time")
            raise LinkBroken(f"{leader.name} left before admitting this pipeline")
        members, joined = _members(frame.tensors[MEMBER_KEY])
        return frame.step, members, joined

    # -- the two calls of a ReplicaGroup ---------------------------------------------

    def set_items(self, step: int, items: int) -> None:
        """The global label-token count of `step`, known to stage 0 from the whole step's
        data: `total_tokens` then returns it without an exchange."""
        self._items = (step, items)

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        self._check(pipeline, 0)
        if self._items is not None and self._items[0] == step:
            return self._items[1]
        mine = {COUNT_KEY: torch.tensor(float(count), dtype=torch.float64)}
        got = self._star("tokens", step, mine, sorted(self.members))
        return int(got[COUNT_KEY])

    def reduce(
        self,
        step: int,
        pipeline: int,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        what: str = "grads",
    ) -> dict[str, torch.Tensor]:
        self._check(pipeline, stage)
        got = self._star(what, step, dict(tensors), sorted(self.members))
        return {name: value.clone() for name, value in got.items()}

    # -- the star --------------------------------------------------------------------

    def _star(
        self,
        what: str,
        step: int,
        mine: dict[str, torch.Tensor],
        members: list[int],
    ) -> dict[str, torch.Tensor]:
        """This stage's part of one star reduce of `mine` among `members`; returns the
        result of every name (fresh tensors; also kept to answer late askers)."""
        key = (what, step)
        deadline = time.monotonic() + self._timeout
        sent: set[tuple[int, int]] = set()
        with self._cond:
            done = self._partial.setdefault(key, {})
            while True:
                lead = min(q for q in members if self.live(q))
                if lead == self._pipeline:
                    done.update(self._lead(key, mine, members, done, deadline))
                    break
                want = {n for n in mine if n not in done}
                leaders = {
                    peer: {n for n in want if self._peers[peer].holds(n)}
                    for peer in self._ports
                    if peer[0] == lead
                }
                leaders = {peer: names for peer, names in leaders.items() if names}
                if not leaders:
                    raise LinkBroken(f"pipeline {lead} holds none of {sorted(want)[:3]}")
                for peer, names in leaders.items():
                    if peer not in sent:
                        sent.add(peer)
                        part = {n: mine[n] for n in sorted(names)}
                        self._ports[peer].send(Frame(f"contrib:{what}", step, -1, part))

                def answered(leaders: Iterable[tuple[int, int]] = tuple(leaders)) -> bool:
                    return all(
                        self._ports[p].gone or self._ports[p].has(f"result:{what}", step)
                        for p in leaders
                    )

                self._wait(answered, deadline, key)
                for peer in leaders:
                    frame = self._ports[peer].take(f"result:{what}", step)
                    if frame is not None:
                        done.update({n: t for n, t in frame.tensors.items() if n in mine})
                if all(n in done for n in mine):
                    break
            self._settle(key, done)
        return done

    def _lead(
        self,
        key: tuple[str, int],
        mine: dict[str, torch.Tensor],
        members: list[int],
        have: dict[str, torch.Tensor],
        deadline: float,
    ) -> dict[str, torch.Tensor]:
        """Lead the names of `mine` not in `have`: adopt results other holders already have
        (when a lower member has gone: this stage takes over), else fold the contributions
        in pipeline order; answer every contributor. The caller holds the condition."""
        what, step = key
        holders = {
            peer: {n for n in mine if self._peers[peer].holds(n)}
            for peer in self._ports
            if peer[0] in members and peer[0] != self._pipeline
        }
        holders = {peer: names for peer, names in holders.items() if names}
        have = dict(have)
        if any(q < self._pipeline for q in members):  # a takeover: ask who has it already
            asked = [p for p in holders if not self._ports[p].gone]
            for peer in asked:
                self._ports[peer].send(Frame(f"query:{what}", step, -1))
            self._wait(
                lambda: all(
                    self._ports[p].gone or self._ports[p].has(f"answer:{what}", step) for p in asked
                ),
                deadline,
                key,
            )
            for peer in sorted(asked):
                frame = self._ports[peer].take(f"answer:{what}", step)
                if frame is not None:
                    for name, value in frame.tensors.items():
                        if name in mine:
                            have.setdefault(name, value)
            if have:
                log.info(
                    "Stage p%d/s%d took over step %d's %s from a pipeline that left; %d of "
                    "%d results were already out", self._pipeline, self._stage, step, what,
                    len([n for n in mine if n in have]), len(mine),
                )  # fmt: skip
        need = [n for n in mine if n not in have]
        givers = [p for p, names in holders.items() if names & set(need)]
        contributions: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        joins: dict[tuple[int, int], ReplicaPort] = {}
        if need:
            self._wait(
                lambda: all(
                    self._ports[p].gone or self._ports[p].has(f"contrib:{what}", step)
                    for p in givers
                ),
                deadline,
                key,
            )
            for peer in givers:
                frame = self._ports[peer].take(f"contrib:{what}", step)
                if frame is not None:
                    contributions[peer] = frame.tensors
            if what == "member":  # the first stages of pipelines asking to rejoin
                for peer, port in [*self._offered.items(), *self._ports.items()]:
                    if peer[0] not in members and port.has("join", None):
                        joins[peer] = port
                        contributions[peer] = port.take("join", None).tensors  # type: ignore[union-attr]
        order = sorted(contributions)
        result = dict(have)
        for name in need:
            acc = mine[name].detach().clone()
            for peer in order:
                if name in contributions[peer]:
                    acc.add_(contributions[peer][name])
            result[name] = acc
        for peer in contributions:
            port = joins.get(peer) or self._ports[peer]
            names = {n: result[n] for n in sorted(result) if self._peers[peer].holds(n)}
            port.send(Frame(f"result:{what}", step, -1, names))
        return {n: result[n] for n in mine}

    def _settle(self, key: tuple[str, int], result: dict[str, torch.Tensor]) -> None:
        """Keep `result` to answer late askers, and answer those waiting already."""
        self._results[key] = result
        self._partial.pop(key, None)
        what, step = key
        for old in [k for k in self._results if k[1] < step - 2]:
            del self._results[old]
        for peer, port in self._ports.items():
            frame = port.take(f"contrib:{what}", step)
            if frame is not None:
                self._answer(port, peer, "result", what, step)
        self._answer_queries()

    def _on_frame(self, port: ReplicaPort, frame: Frame) -> bool:
        """A frame from a peer (its reader thread, under the condition): answer what can be
        answered now; keep the rest."""
        kind, _, what = frame.kind.partition(":")
        peer = self._peer_of(port)
        if peer is None:
            return False
        if kind == "contrib" and (what, frame.step) in self._results:
            self._answer(port, peer, "result", what, frame.step)
            return True
        if kind == "query":
            self._queries.append((port, peer, what, frame.step))
            self._answer_queries()
            return True
        return False

    def _answer_queries(self) -> None:
        """Answer each query once this stage has the result, or once every pipeline below
        the asker has gone from it (then no result of theirs can still arrive here)."""
        waiting = []
        for port, peer, what, step in self._queries:
            below = [
                q
                for (q, _), p in self._ports.items()
                if q < peer[0] and (not p.gone or p.has(f"result:{what}", step))
            ]
            # Below the asker, this stage is alive although the asker thinks it left (a
            # break between live pipelines): it cannot promise anything, so answers now.
            if (what, step) in self._results or not below or self._pipeline < peer[0]:
                self._answer(port, peer, "answer", what, step)
            else:
                waiting.append((port, peer, what, step))
        self._queries = waiting

    def _answer(
        self, port: ReplicaPort, peer: tuple[int, int], kind: str, what: str, step: int
    ) -> None:
        result = self._results.get((what, step)) or self._partial.get((what, step), {})
        names = {n: t for n, t in result.items() if self._peers[peer].holds(n)}
        port.send(Frame(f"{kind}:{what}", step, -1, names))

    def _peer_of(self, port: ReplicaPort) -> tuple[int, int] | None:
        for table in (self._ports, self._offered):
            for peer, mine in table.items():
                if mine is port:
                    return peer
        return None

    def _wait(self, ready: Callable[[], bool], deadline: float, key: tuple[str, int]) -> None:
        """Wait (holding the condition) until `ready`; every answer of a query or
        departure of a peer wakes the check."""

        def check() -> bool:
            self._answer_queries()
            return self.closed or ready()

        if not self._cond.wait_for(check, max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError(f"the other pipelines gave nothing for {key[0]} of step {key[1]}")
        if self.closed:
            raise LinkBroken("the replica links were closed")

    # -- state transfer --------------------------------------------------------------

    def send_to(self, peer: tuple[int, int], frame: Frame) -> bool:
        """Send `frame` to `peer` (False: its link has ended)."""
        with self._cond:
            port = self._ports.get(peer)
        return port is not None and port.send(frame)

    def recv_from(self, peer: tuple[int, int], kind: str, step: int) -> Frame:
        """The next frame of `kind` and `step` from `peer`; LinkBroken when its link ends."""
        with self._cond:
            port = self._ports[peer]
            self._wait(lambda: port.gone or port.has(kind, step), time.monotonic() +
                       self._timeout, (kind, step))  # fmt: skip
            frame = port.take(kind, step)
        if frame is None:
            raise LinkBroken(f"{port.name} left before sending {kind} of step {step}")
        return frame

    def holds(self, peer: tuple[int, int], name: str) -> bool:
        return self._peers[peer].holds(name)

    def peers_in(self, pipeline: int) -> list[tuple[int, int]]:
        return sorted(p for p in self._peers if p[0] == pipeline)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every frame given to the links has been handed to the socket (before
        the process exits: a peer may still be waiting for this stage's last contribution)."""
        for port in list(self._ports.values()):
            port.flush(timeout)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            ports = [*self._ports.values(), *self._offered.values()]
            self._cond.notify_all()
        for port in ports:
            port.close()

    def _check_first(self) -> None:
        if self._stage != 0:
            raise ValueError(
                f"only a first stage agrees on members, not p{self._pipeline}/s{self._stage}"
            )

    def _check(self, pipeline: int, stage: int) -> None:
        if (pipeline, stage) != (self._pipeline, self._stage):
            raise ValueError(
                f"this group is p{self._pipeline}/s{self._stage}'s, not p{pipeline}/s{stage}'s"
            )


def _members(mark: torch.Tensor) -> tuple[set[int], set[int]]:
    """(members, joined) from a folded membership mark: 1 a member, 2 one rejoining."""
    values = [int(v) for v in mark.tolist()]
    return {q for q, v in enumerate(values) if v > 0}, {q for q, v in enumerate(values) if v == 2}
