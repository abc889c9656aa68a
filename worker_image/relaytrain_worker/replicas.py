"""A stage process's links to the other pipelines of its job (docs/worker.md, "Several
pipelines as processes").

The stage document's `replicas` section lists this stage's peers: every stage of another
pipeline that holds some of its layers (`dataparallel.segment_peers`, as the operator or
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
- **Resume step.** Pipeline 0 agrees on the step to resume from along its chain (the
  stage's handshake, which also checks the commit's files), then each of its stages tells
  its peers (`send_resume`); a stage of another pipeline takes that step from its pipeline-0
  peers (`recv_resume`): every stage of every pipeline then restores the same commit.
- A link that breaks breaks the step for everyone: the stage closes all its links, pipeline
  and replica, and every stage of every pipeline rolls back to the last commit together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from relaytrain_contract import ReplicaPeer, ReplicasSpec, StageConfig

from relaytrain_worker.dataparallel import LinkGroup, Slice
from relaytrain_worker.linkauth import LinkBroken, LinkCredentials
from relaytrain_worker.transport import Frame, Link, Listener, connect, listen

T = TypeVar("T")

Peer = tuple[int, int]
"""(pipeline, stage) of a peer."""

RESUME = "replica_resume"
"""Frame kind: pipeline 0's agreed resume step, sent to each peer before the first step."""


def peer_slices(cfg: StageConfig) -> dict[Peer, Slice]:
    """What each peer of this stage holds, from the stage document.

    A peer is first when it is its pipeline's stage 0. It is last when it holds the model's
    final layer; the document does not carry the layer count, but only a last stage has the
    last-stage names (final norm, head, loss) to send, and a last stage's final layer is the
    model's: so a peer counts as last when this stage is last and they end on the same layer.
    """
    replicas = _spec(cfg)
    mine = cfg.stage
    return {
        (p.pipeline, p.stage): Slice(
            p.layerStart,
            p.layerEnd,
            first=p.stage == 0,
            last=mine.is_last and p.layerEnd == mine.layerEnd,
        )
        for p in replicas.peers
    }


def _spec(cfg: StageConfig) -> ReplicasSpec:
    if cfg.replicas is None:
        raise ValueError("the stage document has no replicas section")
    return cfg.replicas


class ReplicaLinks:
    """The replica links of one stage process, opened afresh after every broken link."""

    def __init__(self, cfg: StageConfig, tls: LinkCredentials) -> None:
        self.spec = _spec(cfg)
        self.pipeline = self.spec.pipeline
        self.stage = cfg.stage.index
        self.tls = tls
        self.peers = peer_slices(cfg)
        self.listener: Listener | None = None
        self._lower = [p for p in self.spec.peers if p.pipeline < self.pipeline]
        self._higher = [p for p in self.spec.peers if p.pipeline > self.pipeline]

    def open(self) -> None:
        """Bind the replica listener (once; none on pipeline 0)."""
        if self.listener is None and self.spec.listen is not None:
            expect = frozenset(p.identity for p in self._lower)
            self.listener = listen(self.spec.listen, credentials=self.tls, expect=expect)

    def connect(
        self, timeout: float, meanwhile: Callable[[], T], discard: Callable[[T], None]
    ) -> tuple[T, dict[Peer, Link]]:
        """One link per peer: accept the lower pipelines' stages on a thread, run
        `meanwhile`, dial the higher pipelines' stages; returns `meanwhile`'s result and the
        links. LinkBroken or TimeoutError when a peer does not come within `timeout`
        seconds; AuthError as the links raise it. On any error every link made so far is
        closed and `meanwhile`'s result, if any, is handed to `discard` (the stage closes its
        pipeline links there, so its neighbours notice)."""
        deadline = time.monotonic() + timeout
        accepted: dict[str, Link] = {}
        failed: list[BaseException] = []
        stop = threading.Event()
        acceptor = threading.Thread(
            target=self._accept,
            args=(accepted, failed, stop, deadline),
            name=f"replica-accept-p{self.pipeline}-s{self.stage}",
            daemon=True,
        )
        acceptor.start()
        dialed: dict[Peer, Link] = {}
        made: list[T] = []
        try:
            made.append(meanwhile())
            for peer in self._higher:
                assert peer.address is not None  # the contract sets it on higher pipelines
                left = max(deadline - time.monotonic(), 1.0)
                dialed[(peer.pipeline, peer.stage)] = connect(
                    peer.address, credentials=self.tls, expect=peer.identity, retry_for=left
                )
            acceptor.join(max(deadline - time.monotonic(), 0.0))
            if acceptor.is_alive() or failed or len(accepted) < len(self._lower):
                raise failed[0] if failed else self._late(accepted)
        except BaseException:
            stop.set()
            acceptor.join()
            for link in [*dialed.values(), *accepted.values()]:
                link.close()
            for result in made:
                discard(result)
            raise
        by_identity = {p.identity: (p.pipeline, p.stage) for p in self._lower}
        return made[0], {**dialed, **{by_identity[i]: link for i, link in accepted.items()}}

    def _accept(
        self,
        accepted: dict[str, Link],
        failed: list[BaseException],
        stop: threading.Event,
        deadline: float,
    ) -> None:
        """Accept until every lower pipeline's peer has come (a second link from one peer
        replaces its first: that peer gave up on it)."""
        if not self._lower:
            return
        assert self.listener is not None  # `open` binds it whenever there are lower peers
        while len(accepted) < len(self._lower) and not stop.is_set():
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

    def _late(self, accepted: dict[str, Link]) -> TimeoutError:
        missing = sorted(p.identity for p in self._lower if p.identity not in accepted)
        return TimeoutError(f"no replica link from {', '.join(missing)} in time")

    def send_resume(self, links: dict[Peer, Link], resume: int | None) -> None:
        """Pipeline 0: tell every peer the step the job resumes from."""
        for link in links.values():
            link.send(Frame(RESUME, -1, -1, {}, {"resume": resume}))

    def recv_resume(self, links: dict[Peer, Link], timeout: float) -> int | None:
        """Another pipeline: the resume step its pipeline-0 peers agreed on (every peer of a
        stage has one there: each pipeline holds every layer)."""
        seen: set[int | None] = set()
        for (q, j), link in links.items():
            if q != 0:
                continue
            frame = link.recv(timeout=timeout)
            if frame.kind != RESUME:
                link.close()
                raise LinkBroken(f"expected {RESUME} from p{q}/s{j}, got {frame.kind}")
            seen.add(frame.meta["resume"])
        if len(seen) != 1:
            raise LinkBroken(f"pipeline 0's stages sent different resume steps: {seen}")
        return seen.pop()

    def group(self, links: dict[Peer, Link]) -> LinkGroup:
        """The step's exchange over `links` (which it then owns)."""
        return LinkGroup(len(self.spec.shares), self.pipeline, self.stage, self.peers, links)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def pipeline_zero_stages(peers: tuple[ReplicaPeer, ...]) -> list[int]:
    """The stages of pipeline 0 among `peers`: whose checkpoint files hold this stage's
    weights (pipeline 0 alone writes checkpoints, and its stages that share this stage's
    layers are exactly its peers there)."""
    return [p.stage for p in peers if p.pipeline == 0]
