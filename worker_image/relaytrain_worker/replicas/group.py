"""A replica group over authenticated stage links (`LinkGroup`): one stage's view of the
other pipelines — who trains each step, pipelines rejoining, the two calls of a
`ReplicaGroup` (pipeline/stats.py) over the star reduce of `star.py`, and the frames of a
state hand-over.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.peers import LinkLike
from relaytrain_worker.pipeline.stats import GRADS
from relaytrain_worker.pipeline.transport import Frame
from relaytrain_worker.replicas.arithmetic import (
    COUNT_KEY,
    MEMBER_KEY,
    SHARES_KEY,
    WAIT_SECONDS,
    Slice,
    live_shares,
    micro_ranges,
    segment_peers,
)
from relaytrain_worker.replicas.star import StarExchange, keyed


class LinkGroup(StarExchange):
    """A `ReplicaGroup` over authenticated stage links: one stage's view, tolerant of whole
    pipelines leaving (docs/worker.md, "Several pipelines as processes": faults).

    Stage `stage` of pipeline `pipeline` holds one link to every stage in
    `segment_peers(splits, pipeline, stage)` (identity `p<q>/s<j>` of the same job CA);
    `peers` says what each of them holds. Each link is read by a thread of its own
    (`port.ReplicaPort`), so a peer's departure is seen at once and queries are answered
    whatever this stage is doing.

    Every reduce is a star per name (`star.StarExchange`: the holder in the lowest member
    pipeline folds, and a holder takes over when that one leaves mid-exchange); this class
    adds the members of each step (`begin`, `agree_members`), pipelines rejoining (`join`,
    `offer`) and the hand-over of state (`send_to`, `recv_from`).
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
        share: int = 1,
        slots: int | None = None,
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
        super().__init__(pipeline, stage, peers, timeout)
        self._pipelines = pipelines
        self.share = share
        """This pipeline's planned micro-batches per step: its weight in `live_shares` (the
        relinking thread sets what the store's fleet document plans: ReplicaLinks.follow;
        the next mark this stage 0 makes carries it)."""
        self._slots = pipelines if slots is None else slots
        """Length of a membership mark, the same for every stage of the job (the job's
        micro-batches per step: no job has more pipelines), so that stages that know of
        different pipelines (one was added) fold the same shape."""
        if self._slots < pipelines:
            raise ValueError(f"{pipelines} pipelines do not fit membership marks of {slots}")
        self._items: tuple[int, int] | None = None
        """(step, global label tokens) when the stage already knows the step's count."""
        self._broke: dict[int, int] = {}
        """Lower pipeline -> the step its link to this stage ended (the hiccup rule)."""
        self.step = -1
        self.attempt = 0
        """The current step's attempt: 0, then one more for each redo (`ShortStepError`)."""
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

    def add_peers(self, peers: Mapping[tuple[int, int], Slice]) -> None:
        """Stages of pipelines added to the job (above every pipeline this stage knew): no
        member until a step admits them (`begin`), linked by `links.ReplicaLinks.relink`
        meanwhile (they count as gone peers until then)."""
        with self._cond:
            new = {peer: where for peer, where in peers.items() if peer not in self._peers}
            if any(q < self._pipelines for q, _ in new):
                raise ValueError(f"{sorted(new)} are not stages of added pipelines")
            if any(q >= self._slots for q, _ in new):
                raise ValueError(f"{sorted(new)}: no more than {self._slots} pipelines")
            self._peers.update(new)
            self._pipelines = max([self._pipelines, *(q + 1 for q, _ in new)])
            self._cond.notify_all()

    # -- membership ------------------------------------------------------------------

    def gone_peers(self) -> list[tuple[int, int]]:
        """Peers with no working link (their pipeline left, or never came): whom a survivor
        links to again (`links.ReplicaLinks.relink`)."""
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

    def begin(
        self, step: int, members: Iterable[int], joined: Iterable[int] = (), attempt: int = 0
    ) -> None:
        """Step `step` (its attempt `attempt`: a redo's is 1 or more) trains `members`;
        `joined` of them rejoin with it. Their offered links
        become the group's (waited for while missing). LinkBroken when a lower pipeline this
        stage lost its link to is still a member two steps later: a break between two live
        pipelines (not a crash), after which the higher one leaves and rejoins."""
        members = set(members)
        with self._cond:
            self.step, self.attempt = step, attempt
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

    def agree_members(self, step: int, attempt: int = 0) -> Membership:
        """Stage 0: the pipelines that train step `step` (its attempt `attempt`), those of
        them that rejoin at it, and every member's share, agreed among the first stages of
        every member (a star reduce of who is there, led as any other; the leader admits the
        pipelines whose join request it holds — at a step's first attempt only)."""
        self._check_first()
        what = keyed("member", attempt)
        got = self._star(what, step, self._own_mark(1.0), sorted(self.members))
        return _members(got)

    def join(self, timeout: float) -> tuple[int, Membership]:
        """Stage 0 of a pipeline rejoining: ask the lowest member's first stage to admit this
        pipeline (with its share); returns the step it is admitted at and that step's
        membership. LinkBroken
        when that stage leaves meanwhile (the pipeline then tries again from scratch)."""
        self._check_first()
        with self._cond:
            firsts = [p for p in sorted(self._ports) if p[1] == 0 and self.live(p[0])]
            if not firsts:
                raise LinkBroken("no live pipeline to rejoin")
            leader = self._ports[firsts[0]]
        leader.send(Frame("join", -1, -1, self._own_mark(2.0)))
        with self._cond:
            ok = self._cond.wait_for(
                lambda: leader.gone or leader.has("result:member", None), timeout
            )
            frame = leader.take("result:member", None)
        if frame is None:
            if not ok:
                raise TimeoutError(f"{leader.name} did not admit this pipeline in time")
            raise LinkBroken(f"{leader.name} left before admitting this pipeline")
        return frame.step, _members(frame.tensors)

    def _own_mark(self, value: float) -> dict[str, torch.Tensor]:
        """This stage 0's membership mark (`value` at its pipeline: 1 a member, 2 rejoining)
        and its share at the same index."""
        mark = torch.zeros(self._slots, dtype=torch.float64)
        mark[self._pipeline] = value
        shares = torch.zeros(self._slots, dtype=torch.float64)
        shares[self._pipeline] = float(self.share)
        return {MEMBER_KEY: mark, SHARES_KEY: shares}

    # -- the calls of a ReplicaGroup -------------------------------------------------

    @property
    def first_member(self) -> int:
        return min(self.members)

    def set_items(self, step: int, items: int) -> None:
        """The global label-token count of `step`, known to stage 0 from the whole step's
        data: `total_tokens` then returns it without an exchange."""
        self._items = (step, items)

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        self._check(pipeline, 0)
        if self._items is not None and self._items[0] == step:
            return self._items[1]
        mine = {COUNT_KEY: torch.tensor(float(count), dtype=torch.float64)}
        got = self._star(keyed("tokens", self.attempt), step, mine, sorted(self.members))
        return int(got[COUNT_KEY])

    def reduce(
        self,
        step: int,
        pipeline: int,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        what: str = GRADS,
    ) -> dict[str, torch.Tensor]:
        self._check(pipeline, stage)
        got = self._star(keyed(what, self.attempt), step, dict(tensors), sorted(self.members))
        return {name: value.clone() for name, value in got.items()}

    def short(self, step: int) -> bool:
        """Whether a gradient result of `step`'s current attempt this stage holds misses a
        member pipeline (one left in the middle of the step): the step is to be redone."""
        return self.missed(keyed(GRADS, self.attempt), step)

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


class Membership(NamedTuple):
    """Who trains a step: the member pipelines, those of them (re)joining with it, and each
    pipeline's share (0 for a pipeline no member: `arithmetic.live_shares`'s weights)."""

    members: set[int]
    joined: set[int]
    shares: tuple[int, ...]

    def mine(self, pipeline: int, total: int) -> range:
        """The step's micro-batches `pipeline` trains of `total`."""
        return micro_ranges(live_shares(self.shares, self.members, total))[pipeline]

    def to_meta(self) -> dict[str, list[int]]:
        return {"members": sorted(self.members), "joined": sorted(self.joined),
                "shares": list(self.shares)}  # fmt: skip

    @classmethod
    def of_meta(cls, meta: Mapping[str, Any]) -> Membership:
        return cls(set(meta["members"]), set(meta["joined"]), tuple(meta["shares"]))


def _members(folded: Mapping[str, torch.Tensor]) -> Membership:
    """The membership of a folded mark: 1 a member, 2 one rejoining; and the shares."""
    values = [int(v) for v in folded[MEMBER_KEY].tolist()]
    shares = tuple(int(v) for v in folded[SHARES_KEY].tolist())
    end = max(q for q, v in enumerate(values) if v > 0) + 1
    return Membership(
        {q for q, v in enumerate(values) if v > 0},
        {q for q, v in enumerate(values) if v == 2},
        shares[:end],
    )
