"""The star reduce of a replica group, tolerant of whole pipelines leaving (docs/worker.md,
"Several pipelines as processes": faults). `group.LinkGroup` is this exchange plus
membership; this module is how one reduce among the member pipelines ends with the same
bits everywhere.

**Star reduce.** For every name, the holder in the lowest *member* pipeline leads: the
others send it their contributions, it folds them in pipeline order (`reduce_sum`'s
arithmetic) and sends each the result. Members are the
pipelines training this step (`LinkGroup.members`, set by `LinkGroup.begin`; every pipeline
until then). A member whose link has ended is gone for the rest of the step: its
contribution is simply absent if it had not arrived (the step trains on what arrived).

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

**Short results.** A leader that folds a name without the contribution of every member
pipeline marks that name's result *short*, and the mark travels with the result (in its
frame's meta, and in answers to a takeover's query), so every holder of a name learns the
same mark with the same bits. Every pipeline holds every name, so when any result of a
step is short, every surviving pipeline has a stage that knows (`missed`): the step runner
then redoes the step with the pipelines left (`schedule.ShortStepError`), under an attempt's own
exchange names (`keyed`: ``grads@1``).

**A broken pipeline.** A stage learns that its pipeline broke when a frame it needs from a
neighbour cannot come, and then leaves (closes its links). Waiting in an exchange it needs
nothing from its neighbour and would not learn it, while the others wait for it: they redo
the step with it as a member while it plans the next, or they count its pipeline gone (one
of its links ended) and lead a reduce it leads too. So while a step is trained
(`watching`: not an outer step after it, which a neighbour done with the job may have left)
a wait also looks at the stage's own pipeline links every `WATCH_SECONDS`, and the stage
leaves when one has ended: it could not finish the step without it anyway.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.peers import LinkLike
from relaytrain_worker.pipeline.stats import GATHERS, TERMS
from relaytrain_worker.pipeline.transport import Frame
from relaytrain_worker.replicas.arithmetic import Slice, fold, gather, prefix, value_of
from relaytrain_worker.replicas.port import ReplicaPort

log = logging.getLogger("relaytrain.replicas")

WATCH_SECONDS = 0.5
"""How often a wait that watches this stage's own pipeline (`StarExchange._watch`) looks."""


def keyed(what: str, attempt: int) -> str:
    """The name of exchange `what` in a step's attempt `attempt` (0: the step's first, as
    named; a redo's: ``grads@1``), so that nothing of an earlier attempt answers it."""
    return what if attempt == 0 else f"{what}@{attempt}"


def base(what: str) -> str:
    """The exchange an attempt's name (`keyed`) is of."""
    return what.partition("@")[0]


class StarExchange:
    """One stage's side of star reduces among the stages of other pipelines that hold some
    of its names (`peers`: what each holds), one `ReplicaPort` per peer. `group.LinkGroup`
    adds who is a member of each step; here, `_star` takes the members as given."""

    def __init__(
        self,
        pipeline: int,
        stage: int,
        peers: Mapping[tuple[int, int], Slice],
        timeout: float,
    ) -> None:
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
        self._short: dict[tuple[str, int], set[str]] = {}
        """The names of each reduce whose result misses a member pipeline's contribution."""
        self._watch: Callable[[], str | None] | None = None
        """Asked while a wait lasts: why this stage's own pipeline is broken (else None);
        set for the exchanges a broken pipeline must not take part in."""
        self.closed = False

    @contextlib.contextmanager
    def watching(self, broken: Callable[[], str | None]) -> Iterator[None]:
        """While the block runs, every wait of an exchange also asks `broken` (why this
        stage's own pipeline is broken, else None) and raises LinkBroken when it says (the
        module's "A broken pipeline")."""
        with self._cond:
            self._watch = broken
        try:
            yield
        finally:
            with self._cond:
                self._watch = None

    def _port(self, peer: tuple[int, int], link: LinkLike) -> ReplicaPort:
        port = ReplicaPort(link, f"p{peer[0]}/s{peer[1]}", self._cond, self._on_frame)
        port.start()
        return port

    def live(self, q: int) -> bool:
        """Whether member pipeline `q` is still linked to this stage (this one always is)."""
        if q == self._pipeline:
            return True
        ports = [port for (p, _), port in self._ports.items() if p == q]
        return bool(ports) and not any(port.gone for port in ports)

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
        rounds: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        """Leaders this stage gives its terms to by a round (`_lead_rounds`): its names
        each holds."""
        sums: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        """What this stage sent back in each round: the result, when the leader says so."""
        with self._cond:
            done = self._partial.setdefault(key, {})
            short = self._short.setdefault(key, set())
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
                        if base(what) in TERMS and any(len(t) > 1 for t in part.values()):
                            rounds[peer] = part  # folded onto the leader's sum so far
                            self._ports[peer].send(Frame(f"ready:{what}", step, -1))
                        else:
                            self._ports[peer].send(Frame(f"contrib:{what}", step, -1, part))

                def answered(leaders: Iterable[tuple[int, int]] = tuple(leaders)) -> bool:
                    return all(
                        self._ports[p].gone
                        or self._ports[p].has(f"result:{what}", step)
                        or (p in rounds and self._ports[p].has(f"prefix:{what}", step))
                        for p in leaders
                    )

                self._wait(answered, deadline, key)
                for peer in leaders:
                    asked = self._ports[peer].take(f"prefix:{what}", step)
                    if asked is not None and peer in rounds:
                        part = rounds[peer]
                        summed = {
                            n: prefix([t, part[n]]) for n, t in asked.tensors.items() if n in part
                        }
                        self._ports[peer].send(Frame(f"sum:{what}", step, -1, summed))
                        sums[peer] = summed
                    frame = self._ports[peer].take(f"result:{what}", step)
                    if frame is not None:
                        short.update(n for n in frame.meta.get("short", ()) if n in mine)
                        own_at = frame.meta.get("own_at", {})
                        done.update({
                            n: _with_row(t, mine[n], own_at[n]) if n in own_at else t
                            for n, t in frame.tensors.items() if n in mine
                        })  # fmt: skip
                        if frame.meta.get("own") and peer in sums:  # the sum sent was the last
                            own = sums[peer].items()
                            done.update({n: value_of(t) for n, t in own if n in mine})
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
                        if name in mine and name not in have:
                            have[name] = value
                            if name in frame.meta.get("short", ()):
                                self._short[key].add(name)
            if have:
                log.info(
                    "Stage p%d/s%d took over step %d's %s from a pipeline that left; %d of "
                    "%d results were already out", self._pipeline, self._stage, step, what,
                    len([n for n in mine if n in have]), len(mine),
                )  # fmt: skip
        need = [n for n in mine if n not in have]
        givers = [p for p, names in holders.items() if names & set(need)]
        if base(what) in TERMS:
            return self._lead_rounds(
                key, mine, need, givers, members=members, have=have, deadline=deadline
            )
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
        rows: dict[str, list[int]] = {}  # a gathered name's stack: whose row is where
        for name in need:
            givers = [p for p in order if name in contributions[p]]
            self._mark(key, name, members, [p[0] for p in givers])
            parts = [mine[name], *(contributions[p][name] for p in givers)]
            if base(what) in GATHERS:
                result[name] = gather(parts)
                rows[name] = [self._pipeline, *(p[0] for p in givers)]
            else:
                result[name] = fold(parts)
        for peer in contributions:
            port = joins.get(peer) or self._ports[peer]
            names = {n: result[n] for n in sorted(result) if self._peers[peer].holds(n)}
            meta = {}
            if rows:  # a gather: each holder gets the others' rows; it has its own
                own = {n: rows[n].index(peer[0]) for n in names if peer[0] in rows.get(n, [])}
                names = {n: _without_row(t, own[n]) if n in own else t for n, t in names.items()}
                meta = {"own_at": own}
            port.send(Frame(f"result:{what}", step, -1, names, self._meta(key, names, meta)))
        return {n: result[n] for n in mine}

    def _lead_rounds(
        self,
        key: tuple[str, int],
        mine: dict[str, torch.Tensor],
        need: list[str],
        givers: list[tuple[int, int]],
        *,
        members: list[int],
        have: dict[str, torch.Tensor],
        deadline: float,
    ) -> dict[str, torch.Tensor]:
        """Lead a `TERMS` exchange: the sum so far starts as this stage's own terms and
        goes through the member pipelines in order. A holder with at most one term per name
        sent them (`contrib`): they are added here. One with more asked for a round
        (`ready`): it gets the sum so far (`prefix`), adds its terms in order and sends it
        back (`sum`) — so every term is added in the global micro-batch order while no
        pipeline sends more than one copy of its gradients. A holder whose sum nothing was
        added to after is told to keep it as its result (`own`): for two pipelines a round
        moves no more than a plain star. A holder gone adds nothing. The caller holds the
        condition."""
        what, step = key
        acc = {n: prefix([mine[n]]) for n in need}
        answered: list[tuple[int, int]] = []
        last: dict[str, tuple[int, int]] = {}
        """The holder whose sum each name's value is, while nothing was added after it."""
        for q in sorted({peer[0] for peer in givers}):
            peers = [peer for peer in givers if peer[0] == q]

            def spoke(peers: list[tuple[int, int]] = peers) -> bool:
                return all(
                    self._ports[p].gone
                    or self._ports[p].has(f"contrib:{what}", step)
                    or self._ports[p].has(f"ready:{what}", step)
                    for p in peers
                )

            self._wait(spoke, deadline, key)
            asked: list[tuple[int, int]] = []
            for peer in peers:
                port = self._ports[peer]
                frame = port.take(f"contrib:{what}", step)
                if frame is not None:
                    for name, terms in frame.tensors.items():
                        if name in acc:
                            acc[name] = prefix([acc[name], terms])
                            last.pop(name, None)
                    answered.append(peer)
                elif port.take(f"ready:{what}", step) is not None:
                    names = {n: acc[n] for n in need if self._peers[peer].holds(n)}
                    port.send(Frame(f"prefix:{what}", step, -1, names))
                    asked.append(peer)

            def summed(asked: list[tuple[int, int]] = asked) -> bool:
                return all(
                    self._ports[p].gone or self._ports[p].has(f"sum:{what}", step) for p in asked
                )

            self._wait(summed, deadline, key)
            for peer in asked:
                frame = self._ports[peer].take(f"sum:{what}", step)
                if frame is not None:
                    got = {n: t for n, t in frame.tensors.items() if n in acc}
                    acc.update(got)
                    last.update(dict.fromkeys(got, peer))
                    answered.append(peer)
        result = dict(have)
        result.update({name: value_of(stack) for name, stack in acc.items()})
        for name in need:
            there = [p[0] for p in answered if self._peers[p].holds(name)]
            self._mark(key, name, members, there)
        for peer in [p for p in givers if p in answered]:  # in the ports' order, as `_lead`
            names = {n: result[n] for n in sorted(result) if self._peers[peer].holds(n)}
            if names and all(last.get(n) == peer for n in names):
                meta = self._meta(key, names, {"own": True})
                self._ports[peer].send(Frame(f"result:{what}", step, -1, {}, meta))
            else:
                meta = self._meta(key, names, {})
                self._ports[peer].send(Frame(f"result:{what}", step, -1, names, meta))
        return {n: result[n] for n in mine}

    def _mark(self, key: tuple[str, int], name: str, members: list[int], gave: list[int]) -> None:
        """Mark `name`'s result of `key` short when a member pipeline but this one is not
        among those that `gave` to it. The caller holds the condition."""
        if set(members) - {self._pipeline} - set(gave):
            self._short[key].add(name)

    def _meta(
        self, key: tuple[str, int], names: Mapping[str, torch.Tensor], meta: dict[str, Any]
    ) -> dict[str, Any]:
        """`meta` of a frame carrying `names`' results of `key`, with those that are short."""
        short = sorted(n for n in names if n in self._short.get(key, ()))
        return {**meta, "short": short} if short else meta

    def missed(self, what: str, step: int) -> bool:
        """Whether any result this stage got of `what` in `step` misses a member pipeline."""
        with self._cond:
            return bool(self._short.get((what, step)))

    def _settle(self, key: tuple[str, int], result: dict[str, torch.Tensor]) -> None:
        """Keep `result` to answer late askers, and answer those waiting already."""
        self._results[key] = result
        self._partial.pop(key, None)
        what, step = key
        for old in [k for k in self._results if k[1] < step - 2]:
            del self._results[old]
        for old in [k for k in self._short if k[1] < step - 2]:
            del self._short[old]
        for peer, port in self._ports.items():
            late = [port.take(f"{kind}:{what}", step) for kind in ("contrib", "ready")]
            if any(frame is not None for frame in late):
                self._answer(port, peer, "result", what, step)
        self._answer_queries()

    def _on_frame(self, port: ReplicaPort, frame: Frame) -> bool:
        """A frame from a peer (its reader thread, under the condition): answer what can be
        answered now; keep the rest."""
        kind, _, what = frame.kind.partition(":")
        peer = self._peer_of(port)
        if peer is None:
            return False
        if kind in {"contrib", "ready"} and (what, frame.step) in self._results:
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
        port.send(Frame(f"{kind}:{what}", step, -1, names, self._meta((what, step), names, {})))

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

        while True:
            left = max(deadline - time.monotonic(), 0.0)
            watch = self._watch
            if self._cond.wait_for(check, left if watch is None else min(left, WATCH_SECONDS)):
                break
            if watch is not None and (why := watch()):
                raise LinkBroken(f"{why}: pipeline {self._pipeline} leaves step {key[1]}")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the other pipelines gave nothing for {key[0]} of step {key[1]}"
                )
        if self.closed:
            raise LinkBroken("the replica links were closed")


def _without_row(stack: torch.Tensor, at: int) -> torch.Tensor:
    """A gathered stack less row `at` (what its holder gave: it has it already)."""
    return torch.cat([stack[:at], stack[at + 1 :]])


def _with_row(stack: torch.Tensor, row: torch.Tensor, at: int) -> torch.Tensor:
    """A gathered stack with this holder's own `row` put back at `at`."""
    return torch.cat([stack[:at], row.unsqueeze(0), stack[at:]])
