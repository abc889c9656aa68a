"""A stage process's links to the other pipelines of its job (docs/worker.md, "Several
pipelines as processes").

The stage document's `replicas` section lists this stage's peers: every stage of another
pipeline that holds some of its layers (`arithmetic.segment_peers`, as the operator or
`relaytrain run --local` computed it), with its layers, its address and its identity.
`ReplicaLinks` turns that into one mutually authenticated link per peer and a `LinkGroup`
over them:

- **Who dials whom.** Of two peers, the stage of the lower pipeline dials; the other accepts.
  Pipeline 0 only dials (it has no replica listener); the last pipeline only accepts.
- **Order.** Every stage binds its replica listener once, at start-up (`open`, with its
  pipeline listener). `connect` starts accepting the lower pipelines' stages on a thread,
  then runs `meanwhile` (the stage connects its own pipeline's links there), then dials the
  higher pipelines' stages with retries, and waits until every expected peer has come. The
  accepting never waits on anything, so no cycle of stages dialling each other can stall;
  a dial that reaches a stage not accepting yet is retried, as on the pipeline links.
- **Given up.** The operator names the pipelines it gave up for good in the job's store
  (names.GIVEN_UP_FILE, read by `given_up`): `connect` neither waits for nor dials their
  stages, and they are no member of the group.
- **Resume step.** The lowest pipeline not given up (pipeline 0 unless it was) agrees on
  the step to resume from along its chain (the stage's handshake, which also checks the
  commit's files), then each of its stages tells its peers (`send_resume`); a stage of
  another pipeline takes that step from its peers there (`recv_resume`): every stage of
  every pipeline then restores the same commit.
- **Hello.** Right after a replica link is made each end says whether it is training
  (`live`) or (re)joining, and at which step (`exchange_hellos`). A stage that finds no live
  peer starts as above (every pipeline restores the same commit); one that finds live peers
  rejoins the job from their state instead (`membership.Replicated._rejoin`).
- **A pipeline leaves alone.** A broken replica link is a peer's pipeline leaving: the
  group (`group.LinkGroup`) goes on without it. A broken pipeline link makes the stage
  close every link (so to its peers its whole pipeline has left) and rejoin. Meanwhile a
  survivor links again to the stages it lost in the background (`relink`: it dials the
  higher pipelines' stages and accepts the lower ones', as at start-up), says hello, and
  offers each link to its group, which uses it from the step that admits that pipeline.
- **State by name.** A rejoining stage takes the weights, AdamW moments and schedule of the
  names it holds from its peers in the lowest surviving pipeline at the step boundary that
  admits it (`handover.py`): their split may differ.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from relaytrain_contract import ReplicaPeer, ReplicasSpec, StageConfig
from relaytrain_contract.fleet import FleetDocument

from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.linkauth import AuthError, CertificateRefused, LinkBroken
from relaytrain_worker.pipeline.transport import Frame, Link, Listener, connect, listen
from relaytrain_worker.replicas.arithmetic import Slice
from relaytrain_worker.replicas.group import LinkGroup

log = logging.getLogger("relaytrain.replicas")

T = TypeVar("T")

Peer = tuple[int, int]
"""(pipeline, stage) of a peer."""

RESUME = "replica_resume"
"""Frame kind: pipeline 0's agreed resume step, sent to each peer before the first step."""
HELLO = "replica_hello"
"""Frame kind: the first frame on every replica link, each way: training or (re)joining."""
HELLO_SECONDS = 600.0
"""How long a live stage waits for a rejoining peer to say hello (it links to all its peers
first, its own pipeline's replacement stage included)."""


def peer_slices(cfg: StageConfig) -> dict[Peer, Slice]:
    """What each peer of this stage holds, from the stage document.

    A peer is first when it is its pipeline's stage 0. It is last when it holds the model's
    final layer; the document does not carry the layer count, but only a last stage has the
    last-stage names (final norm, head, loss) to send, and a last stage's final layer is the
    model's: so a peer counts as last when this stage is last and they end on the same layer.
    """
    return _slices(cfg, _spec(cfg).peers)


def _slices(cfg: StageConfig, peers: Iterable[ReplicaPeer]) -> dict[Peer, Slice]:
    mine = cfg.stage
    return {
        (p.pipeline, p.stage): Slice(
            p.layer_start,
            p.layer_end,
            first=p.stage == 0,
            last=mine.is_last and p.layer_end == mine.layer_end,
        )
        for p in peers
    }


def added_peers(cfg: StageConfig, fleet: FleetDocument, known: int) -> list[ReplicaPeer]:
    """The stages of the pipelines `fleet` adds beyond the `known` ones that share a layer
    with this stage (the embedding and the head go with the first and last layer): its
    peers there, as the operator picks a document's."""
    mine = cfg.stage
    return [
        peer
        for added in fleet.added
        if added.pipeline >= known
        for peer in added.stages
        if max(mine.layer_start, peer.layer_start) < min(mine.layer_end, peer.layer_end)
    ]


def _spec(cfg: StageConfig) -> ReplicasSpec:
    if cfg.replicas is None:
        raise ValueError("the stage document has no replicas section")
    return cfg.replicas


class Polled(Generic[T]):
    """A document of the job's store read through `read` (its bytes, None while there is
    none) at most every `every` seconds and parsed by `parse`; `empty` while there is none.
    A bad read or document keeps the last value (a stage must not end on it), and is
    logged once until it changes (a store outage would otherwise fill the log)."""

    def __init__(
        self,
        read: Callable[[], bytes | None],
        parse: Callable[[bytes], T],
        empty: T,
        what: str,
        every: float = 2.0,
    ) -> None:
        self._read = read
        self._parse = parse
        self._what = what
        self._every = every
        self._at = -float("inf")
        self._value = empty
        self._empty = empty
        self._failed: str | None = None

    def __call__(self) -> T:
        now = time.monotonic()
        if now - self._at >= self._every:
            self._at = now
            try:
                raw = self._read()
                self._value = self._empty if raw is None else self._parse(raw)
                self._failed = None
            except Exception as exc:  # a bad read must not end the stage
                if str(exc) != self._failed:
                    log.warning("Could not read %s: %s", self._what, exc)
                self._failed = str(exc)
        return self._value


def given_up(read: Callable[[], bytes | None], every: float = 2.0) -> Polled[frozenset[int]]:
    """The pipelines the operator gave up (names.GIVEN_UP_FILE: `{"pipelines": [...]}`): a
    stage waiting for its peers polls it. An unreadable document counts as none given up
    (the stage waits, as it would without one)."""
    return Polled(read, lambda raw: frozenset(int(q) for q in json.loads(raw)["pipelines"]),
                  frozenset(), "the given-up pipelines", every)  # fmt: skip


def fleet(read: Callable[[], bytes | None], every: float = 2.0) -> Polled[FleetDocument | None]:
    """The pipelines added to the job (names.FLEET_FILE), polled while a stage trains."""
    return Polled(read, FleetDocument.from_json, None, "the added pipelines", every)


class ReplicaLinks:
    """The replica links of one stage process, opened afresh after every broken link."""

    def __init__(
        self,
        cfg: StageConfig,
        tls: LinkCredentials,
        fleet: Callable[[], FleetDocument | None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.spec = _spec(cfg)
        self.pipeline = self.spec.pipeline
        self.fleet = fleet
        """The pipelines added to the job (names.FLEET_FILE), read at most every few seconds."""
        self.all_peers = list(self.spec.peers)
        """Its document's peers, and the stages of added pipelines that share its layers."""
        self.stage = cfg.stage.index
        self.tls = tls
        self.grace = cfg.links.renewal_grace_seconds
        """How long a dial refused on the certificate chain is tried again (a renewal)."""
        self.peers = peer_slices(cfg)
        self.listener: Listener | None = None
        self._lower = [p for p in self.spec.peers if p.pipeline < self.pipeline]
        self.out: frozenset[int] = frozenset()
        """The pipelines given up when `connect` last linked: no member, no leader."""
        self.share = self.spec.shares[self.pipeline]
        """Its pipeline's share of a step: its document's, or names.FLEET_FILE's (`follow`)."""

    def follow(self) -> dict[Peer, Slice]:
        """Take in the pipelines added to the job since this stage last looked (its
        peers there join `all_peers`, and the higher ones it dials) and this pipeline's
        share as the fleet document plans it; returns what each new peer holds."""
        fleet = self.fleet()
        if fleet is None:
            return {}
        planned = dict(enumerate(fleet.shares)).get(self.pipeline, self.share)
        if planned != self.share:
            self.share = planned
            log.info("Stage p%d/s%d takes %d of each step's micro-batches as planned now",
                     self.pipeline, self.stage, planned)  # fmt: skip
        new = added_peers(self.cfg, fleet, self.count)
        added = _slices(self.cfg, new)
        if new:
            self.all_peers.extend(new)
            self.peers.update(added)
            log.info("Stage p%d/s%d links to the added pipeline(s) %s", self.pipeline,
                     self.stage, sorted({p.pipeline for p in new}))  # fmt: skip
        return added

    @property
    def count(self) -> int:
        """The pipelines this stage knows of: its document's, and those added since."""
        return max(len(self.spec.shares), *(p.pipeline + 1 for p in self.all_peers))

    @property
    def _higher(self) -> list[ReplicaPeer]:
        """The peers this stage dials: those of higher pipelines, added ones included."""
        return [p for p in self.all_peers if p.pipeline > self.pipeline]

    def open(self) -> None:
        """Bind the replica listener (once; none on pipeline 0)."""
        if self.listener is None and self.spec.listen is not None:
            expect = frozenset(p.identity for p in self._lower)
            self.listener = listen(self.spec.listen, credentials=self.tls, expect=expect)

    def connect(
        self,
        timeout: float,
        meanwhile: Callable[[], T],
        discard: Callable[[T], None],
        given_up: Callable[[], frozenset[int]] = frozenset,
    ) -> tuple[T, dict[Peer, Link]]:
        """One link per peer not in a pipeline `given_up` names (polled while waiting):
        accept the lower pipelines' stages on a thread, run `meanwhile`, dial the higher
        pipelines' stages; returns `meanwhile`'s result and the links, and keeps the given-up
        pipelines in `out`. LinkBroken or TimeoutError when a peer does not come within
        `timeout` seconds; AuthError as the links raise it. On any error every link made so
        far is closed and `meanwhile`'s result, if any, is handed to `discard` (the stage
        closes its pipeline links there, so its neighbours notice)."""
        deadline = time.monotonic() + timeout
        accepted: dict[str, Link] = {}
        failed: list[BaseException] = []
        stop = threading.Event()
        acceptor = threading.Thread(
            target=self._accept,
            args=(accepted, failed, stop, deadline, given_up),
            name=f"replica-accept-p{self.pipeline}-s{self.stage}",
            daemon=True,
        )
        acceptor.start()
        dialed: dict[Peer, Link] = {}
        made: list[T] = []
        try:
            made.append(meanwhile())
            for peer in self._higher:
                link = self._dial(peer, deadline, given_up)
                if link is not None:
                    dialed[(peer.pipeline, peer.stage)] = link
            acceptor.join(max(deadline - time.monotonic(), 0.0))
            out = given_up()
            missing = self._missing(accepted, out)
            if acceptor.is_alive() or failed or missing:
                raise (
                    failed[0]
                    if failed
                    else TimeoutError(f"no replica link from {', '.join(missing)} in time")
                )
        except BaseException:
            stop.set()
            acceptor.join()
            for link in [*dialed.values(), *accepted.values()]:
                link.close()
            for result in made:
                discard(result)
            raise
        by_identity = {p.identity: (p.pipeline, p.stage) for p in self._lower}
        links = {**dialed, **{by_identity[i]: link for i, link in accepted.items()}}
        self.out = out
        for key in [key for key in links if key[0] in out]:
            links.pop(key).close()  # given up as it linked: it trains no more
        if out:
            log.info("Stage p%d/s%d links without given-up pipeline(s) %s",
                     self.pipeline, self.stage, sorted(out))  # fmt: skip
        return made[0], links

    def _dial(
        self, peer: ReplicaPeer, deadline: float, given_up: Callable[[], frozenset[int]]
    ) -> Link | None:
        """Dial a higher pipeline's stage until it answers (or the deadline: LinkBroken);
        None once its pipeline is given up."""
        assert peer.address is not None  # the contract sets it on higher pipelines
        refused_until: float | None = None
        while True:
            if peer.pipeline in given_up():
                return None
            left = deadline - time.monotonic()
            try:
                return connect(
                    peer.address, credentials=self.tls, expect=peer.identity,
                    retry_for=max(min(left, 5.0), 1.0), refused_for=self.grace,
                )  # fmt: skip
            except CertificateRefused:
                now = time.monotonic()
                refused_until = refused_until or now + self.grace
                if now >= refused_until or left <= 5.0:
                    raise
            except LinkBroken:
                if left <= 5.0:
                    raise

    def _missing(self, accepted: dict[str, Link], out: frozenset[int]) -> list[str]:
        """The lower pipelines' stages not given up that have not linked yet."""
        return sorted(
            p.identity for p in self._lower if p.identity not in accepted and p.pipeline not in out
        )

    def _accept(
        self,
        accepted: dict[str, Link],
        failed: list[BaseException],
        stop: threading.Event,
        deadline: float,
        given_up: Callable[[], frozenset[int]],
    ) -> None:
        """Accept until every lower pipeline's peer not given up has come (a second link
        from one peer replaces its first: that peer gave up on it)."""
        if not self._lower:
            return
        assert self.listener is not None  # `open` binds it whenever there are lower peers
        while self._missing(accepted, given_up()) and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                link = self.listener.accept(timeout=min(left, 1.0))
            except TimeoutError:
                continue
            except BaseException as exc:
                failed.append(exc)
                return
            old = accepted.pop(link.peer_identity, None)
            if old is not None:
                old.close()
            accepted[link.peer_identity] = link

    @property
    def leader(self) -> int:
        """The pipeline that agrees on the resume step: the lowest not given up."""
        return min(set(range(self.count)) - self.out)

    def send_resume(self, links: dict[Peer, Link], resume: int | None) -> None:
        """The leader's stages: tell every peer the step the job resumes from."""
        for link in links.values():
            link.send(Frame(RESUME, -1, -1, {}, {"resume": resume}))

    def recv_resume(self, links: dict[Peer, Link], timeout: float) -> int | None:
        """Another pipeline: the resume step its peers in the leader's pipeline agreed on
        (every stage has peers there: each pipeline holds every layer)."""
        seen: set[int | None] = set()
        for (q, j), link in links.items():
            if q != self.leader:
                continue
            frame = link.recv(timeout=timeout)
            if frame.kind != RESUME:
                link.close()
                raise LinkBroken(f"expected {RESUME} from p{q}/s{j}, got {frame.kind}")
            seen.add(frame.meta["resume"])
        if len(seen) != 1:
            raise LinkBroken(f"pipeline {self.leader}'s stages sent different resume steps: {seen}")
        return seen.pop()

    def group(self, links: dict[Peer, Link], members: Iterable[int] | None = None) -> LinkGroup:
        """The step's exchange over `links` (which it then owns), among `members` (every
        pipeline not given up when None)."""
        if members is None:
            members = set(range(self.count)) - self.out
        return LinkGroup(
            self.count, self.pipeline, self.stage, self.peers, links, members=members,
            share=self.share, slots=self.cfg.training.micro_batches,
        )  # fmt: skip

    def relink(self, group: LinkGroup, step: Callable[[], int], stop: threading.Event) -> None:
        """Start the background threads of a training stage that link it again to the peers
        it lost when they come back: one dials the higher pipelines' stages, one accepts the
        lower ones' (as at start-up); each new link says hello and, when the peer rejoins,
        is offered to `group`. They end when `stop` is set."""
        threading.Thread(
            target=self._dial_loop, args=(group, step, stop), daemon=True,
            name=f"relink-dial-p{self.pipeline}-s{self.stage}",
        ).start()  # fmt: skip
        if self.listener is not None and self._lower:
            threading.Thread(
                target=self._accept_loop, args=(group, step, stop), daemon=True,
                name=f"relink-accept-p{self.pipeline}-s{self.stage}",
            ).start()  # fmt: skip

    def _dial_loop(self, group: LinkGroup, step: Callable[[], int], stop: threading.Event) -> None:
        greeting: set[Peer] = set()
        while not stop.wait(0.5):
            added = self.follow()
            if added:
                group.add_peers(added)
            group.share = self.share
            by_key = {(p.pipeline, p.stage): p for p in self._higher}
            for key in group.gone_peers():
                peer = by_key.get(key)
                if peer is None or key in greeting or stop.is_set():
                    continue
                assert peer.address is not None
                try:
                    link = connect(
                        peer.address, credentials=self.tls, expect=peer.identity, retry_for=1.0
                    )
                except (LinkBroken, AuthError):
                    continue
                greeting.add(key)

                def greet(key: Peer = key, link: Link = link) -> None:
                    try:
                        self._greet(group, key, link, step(), stop)
                    finally:
                        greeting.discard(key)

                threading.Thread(target=greet, daemon=True, name="relink-greet").start()

    def _accept_loop(
        self, group: LinkGroup, step: Callable[[], int], stop: threading.Event
    ) -> None:
        assert self.listener is not None
        by_identity = {p.identity: (p.pipeline, p.stage) for p in self._lower}
        while not stop.is_set():
            try:
                link = self.listener.accept(timeout=1.0)
            except TimeoutError:
                continue
            except (LinkBroken, AuthError):  # closed; or PlanReplaced: this stage's plan is
                return  # over, and it stops on its pipeline's links or at its next checkpoint
            key = by_identity.get(link.peer_identity)
            if key is None:
                link.close()
                continue
            threading.Thread(
                target=self._greet, args=(group, key, link, step(), stop), daemon=True,
                name="relink-greet",
            ).start()  # fmt: skip

    def _greet(
        self, group: LinkGroup, key: Peer, link: Link, step: int, stop: threading.Event
    ) -> None:
        try:
            hello = exchange_hellos({key: link}, live=True, step=step)[key]
        except (LinkBroken, TimeoutError, OSError):
            link.close()
            return
        if hello.get("live") or stop.is_set():
            link.close()  # two training stages do not link afresh
            return
        log.info("Stage p%d/s%d linked to p%d/s%d again", self.pipeline, self.stage, *key)
        try:
            group.offer(key, link)
        except ValueError:
            link.close()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def peer_stages(peers: Iterable[ReplicaPeer], pipeline: int) -> list[int]:
    """The stages of `pipeline` among `peers`: whose checkpoint files hold this stage's
    weights when that pipeline wrote the commit (its stages that share this stage's layers
    are exactly its peers there)."""
    return [p.stage for p in peers if p.pipeline == pipeline]


def exchange_hellos(
    links: dict[Peer, Link], *, live: bool, step: int, timeout: float = HELLO_SECONDS
) -> dict[Peer, dict[str, Any]]:
    """Say on every link whether this stage is training (`live`, at `step`) or (re)joining,
    and read what each peer says; LinkBroken when a peer says anything else."""
    for link in links.values():
        link.send(Frame(HELLO, -1, -1, {}, {"live": live, "step": step}))
    out = {}
    for peer, link in links.items():
        frame = link.recv(timeout=timeout)
        if frame.kind != HELLO:
            link.close()
            raise LinkBroken(f"expected {HELLO} from p{peer[0]}/s{peer[1]}, got {frame.kind}")
        out[peer] = frame.meta
    return out
