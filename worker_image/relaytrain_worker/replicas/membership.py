"""A stage as one of several pipelines (`Replicated`): the multi-pipeline side of its life
(docs/worker.md, "Several pipelines as processes"), at the points its runtime
(`pipeline.stage.StageRuntime`) calls `pipeline.replication.Replication`.

- **Links.** Besides its pipeline links the stage holds a link to each stage of the other
  pipelines that shares its layers (`links.ReplicaLinks`), made with its pipeline links;
  the pipelines the operator gave up are skipped (`links.given_up`); those it added to the
  running job are linked to as they come (`links.fleet`, `ReplicaLinks.follow`).
- **Resume or rejoin.** By the hello on its replica links a (re)starting stage finds
  whether any pipeline is training. If one is, it rejoins at a step boundary with a live
  peer's state, by parameter name (`_rejoin`, `_hand_state`); if none is, pipeline 0 (the
  lowest not given up) agrees on the resume step along its chain and tells the others,
  which take it from their peers there, and every stage restores that commit.
- **Members.** At every step the first stages agree on the pipelines that train it
  (`group.LinkGroup.agree_members`) and send the plan down their chains; the step's
  micro-batches are shared among those (`arithmetic.live_shares`). The step's token count,
  gradients, loss and token rate are reduced over every pipeline (the group is the step
  runner's).
- **One writer.** One pipeline writes for all — saves checkpoints, commits, and writes
  progress.json and the output: every pipeline holds the same weights. The writer of a
  step is the lowest pipeline training it, so pipeline 0 unless it is out, when the next
  takes over (its files under `step-N/p<w>/`, its split in the manifest) and gives the
  writing back when pipeline 0 has rejoined.
- **Faults.** A broken pipeline link makes the stage close every link and rejoin; a broken
  replica link is a peer's pipeline leaving, and the others train on.
- **Periodic.** With `replicas.sync.mode: periodic` only the loss and the counts are
  reduced each step; an outer step (`periodic.PeriodicSync`) averages the weights every
  `everySteps` steps, after the last, and before every checkpoint and evaluation, so that
  what the writer saves and evaluates is every replica's weights.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import torch
from relaytrain_contract import FLEET_FILE, GIVEN_UP_FILE, StageConfig
from relaytrain_contract.stage import lora_merge_of

from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.evaluation import due
from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.loading import job_prefix
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.replication import DepartedError, RunnerOptions
from relaytrain_worker.pipeline.schedule import (
    ShortStepError,
    StepResult,
    StepRunner,
    count_items,
)
from relaytrain_worker.pipeline.stage import CONNECT_FOR, StageRuntime
from relaytrain_worker.pipeline.transport import Frame, Link
from relaytrain_worker.replicas.group import LinkGroup, Membership
from relaytrain_worker.replicas.handover import STATE, load_state_frames, state_frame
from relaytrain_worker.replicas.links import (
    Peer,
    ReplicaLinks,
    exchange_hellos,
    fleet,
    given_up,
    peer_stages,
)
from relaytrain_worker.replicas.periodic import ANCHOR_PREFIX, PeriodicSync
from relaytrain_worker.state import checkpoint as ckpt
from relaytrain_worker.state.metrics import LinkCounters
from relaytrain_worker.state.progress import Progress, read_progress
from relaytrain_worker.state.store import ObjectNotFound, Store
from relaytrain_worker.stopping import LEAVE_WAIT_SECONDS

log = logging.getLogger("relaytrain.stage")

HISTORY_KEY = "__loss_history__"
"""The pending loss records a last stage sends a rejoining last stage with its state."""


def job_finished(progress: Progress | None, started: datetime, total_steps: int) -> bool:
    """Whether progress.json says the job is done for a stage that started at `started`:
    done, and written after the stage started or at the job's last step (a replacement
    started just as the others finished finds the job done before it began; a done record
    of fewer steps is another run's, e.g. before the job's steps were raised)."""
    if progress is None or not progress.done:
        return False
    fresh = progress.updated_at is not None and progress.updated_at >= started
    return fresh or progress.step == progress.total_steps == total_steps


class Replicated:
    """A stage of pipeline `replicas.pipeline` of R (`pipeline.replication.Replication`)."""

    def __init__(self, cfg: StageConfig, tls: LinkCredentials, store: Store) -> None:
        assert cfg.replicas is not None
        self.cfg = cfg
        self.spec = cfg.replicas
        self.pipeline = self.spec.pipeline
        self.name = f"p{self.pipeline}/s{cfg.stage.index}"
        self.metrics_pipeline: int | None = self.pipeline
        self.periodic = self.spec.sync.mode == "periodic"
        """Whether the pipelines average their weights every few steps (periodic.py) rather
        than reduce gradients every step."""
        self.writer = self.pipeline == 0
        """Whether this stage's pipeline writes for the step just trained: saves checkpoints
        (and, as the last stage, commits them and writes progress.json, the loss history and
        the output). The lowest pipeline training the step (`_plan`): pipeline 0 unless it
        is out."""
        self.store = store
        self.prefix = job_prefix(cfg)
        self.replicas = ReplicaLinks(cfg, tls, fleet(lambda: self._document(FLEET_FILE)))
        """The links to the other pipelines."""
        self.given_up = given_up(lambda: self._document(GIVEN_UP_FILE))
        """The pipelines the operator gave up (names.GIVEN_UP_FILE): linking skips them."""
        self.joining = threading.Event()
        """Set while this stage links and (re)joins rather than trains (`_exit_when_done`)."""
        self.admitted: tuple[int, Membership] | None = None
        """The step a rejoining pipeline was admitted at and its membership (stage 0 plans
        that step from it instead of agreeing again)."""
        self.group: LinkGroup | None = None
        """The step's exchange with the other pipelines (once linked)."""
        self._links: dict[Peer, Link] = {}
        """Replica links made and not yet handed to a group."""
        self._stop = threading.Event()
        """Stops the background relinking of this attempt's group."""
        self._outer: PeriodicSync | None = None
        self._trains: int | None = None
        """The micro-batches of a step this pipeline trained last (stage 0 says when that
        changes: a pipeline left, came back or was added)."""
        self.leaving = threading.Event()
        """Set by SIGTERM while training: leave at the next step boundary (`depart`)."""
        self._leave_by = float("inf")
        """When a stage asked to stop stops unless its stage 0 led the pipeline out first
        (time.monotonic(); LEAVE_WAIT_SECONDS after the SIGTERM)."""

    @property
    def writes(self) -> bool:
        return self.writer

    @property
    def unsure_writer(self) -> bool:
        # Always: a cut can fall in the middle of a step whose plan still had every
        # pipeline, and a side that waited on the other (TCP keepalive) wakes far behind.
        return True

    def _document(self, name: str) -> bytes | None:
        try:
            return self.store.get(f"{self.prefix}/{name}")
        except ObjectNotFound:
            return None

    # -- the process -------------------------------------------------------------------

    def open(self) -> None:
        self.replicas.open()

    def start(self, stage: StageRuntime) -> None:
        threading.Thread(
            target=self._exit_when_done, args=(stage,), name="done-watch", daemon=True
        ).start()

    def holders(self, source: int) -> list[int]:
        return peer_stages(self.replicas.all_peers, source) if source != self.pipeline else []

    def close(self) -> None:
        self.replicas.close()

    # -- linking, resuming, rejoining ------------------------------------------------------

    def link(self, connect: Callable[[], Peers]) -> Peers:
        """This stage's pipeline links and its links to the other pipelines but those the
        operator gave up."""
        if self.leaving.is_set():  # asked to stop, and its links broke before it could
            raise KeyboardInterrupt
        self.joining.set()
        self.group, self._links, self._stop = None, {}, threading.Event()
        self.replicas.follow()  # pipelines added since the stage's document was written
        peers, self._links = self.replicas.connect(CONNECT_FOR, connect, Peers.close, self.given_up)
        return peers

    def resume(self, stage: StageRuntime, peers: Peers, restored: int | None) -> int | None:
        """Rejoin the pipelines that are training, from their state; when none is, restore
        the step the leader's chain agreed on, as every pipeline does."""
        live = self._hello(stage.step)
        if live:  # other pipelines are training: rejoin them from their state
            self.group = self.replicas.group(self._links, members=live)
            self._links = {}
            self.writer = False  # until a step's plan makes it the lowest again
            self._rejoin(stage, peers, self.group)
        else:
            restored = stage.take_resume(self._agree(stage, peers, restored), restored)
            # Every pipeline starts from the commit; the leader writes first.
            self.writer = self.pipeline == self.replicas.leader
            self.group = self.replicas.group(self._links)
            self._links = {}
        self.replicas.relink(self.group, lambda: stage.step, self._stop)
        self.joining.clear()
        return restored

    def _hello(self, step: int) -> set[int]:
        """Tell every replica peer this stage is (re)joining; returns the pipelines whose
        stages answer that they are training (none: the job starts, or every pipeline
        failed, and restores the last commit)."""
        hellos = exchange_hellos(self._links, live=False, step=step)
        return {q for (q, _), hello in hellos.items() if hello.get("live")}

    def _agree(self, stage: StageRuntime, peers: Peers, mine: int | None) -> int | None:
        """The step every stage resumes from: the leader's chain (pipeline 0 unless it was
        given up) agrees on it (`StageRuntime.handshake`) and tells the other pipelines,
        which take it from their peers there."""
        if self.pipeline != self.replicas.leader:
            return self.replicas.recv_resume(self._links, CONNECT_FOR)
        agreed = stage.handshake(peers, mine)
        self.replicas.send_resume(self._links, agreed)
        return agreed

    def _rejoin(self, stage: StageRuntime, peers: Peers, group: LinkGroup) -> None:
        """Join the pipelines that are training at a step boundary. Readiness runs up this
        pipeline's chain (every stage has linked to its peers), then stage 0 asks to be
        admitted (`LinkGroup.join`) and sends the step down the chain; the state itself comes
        in `_plan` of that step, from the peers in the lowest pipeline that stayed."""
        if peers.next is not None:
            peers.next.recv("ready", -1)
        if peers.prev is not None:
            peers.prev.send(Frame("ready", -1, -1))
            step = int(peers.prev.recv("rejoin", -1).meta["step"])
        else:
            step, membership = group.join(CONNECT_FOR)
            self.admitted = (step, membership)
        if peers.next is not None:
            peers.next.send(Frame("rejoin", -1, -1, {}, {"step": step}))
        stage.step = step
        log.info("Stage %s rejoins the job at step %d", self.name, step)

    def _exit_when_done(self, stage: StageRuntime) -> None:
        """A stage of a pipeline that is still (re)joining when the others have finished the
        job has nothing left to join: it exits with 0 rather than wait for peers that are
        gone. Finished: progress.json says done, and was written after this process started
        or is at this job's last step (a replacement started just as the others finished
        finds the job done before it began)."""
        started = datetime.now(UTC).replace(microsecond=0)
        while True:
            time.sleep(2.0)
            if not self.joining.is_set():
                continue
            try:
                progress = read_progress(self.store, self.prefix)
            except Exception:  # a read that fails is tried again
                continue
            if job_finished(progress, started, stage.total_steps) and self.joining.is_set():
                log.info("Stage %s found the job finished while rejoining", self.name)
                logging.shutdown()
                os._exit(0)

    # -- the step loop -----------------------------------------------------------------

    def runner_options(self) -> RunnerOptions:
        return {"group": self.group, "pipeline": self.pipeline, "periodic": self.periodic}

    def begin_training(self, stage: StageRuntime, runner: StepRunner) -> None:
        self._outer = None
        if self.periodic:
            assert self.group is not None and self.spec.sync.every_steps
            self._outer = PeriodicSync.of(
                runner,
                self.group,
                every=self.spec.sync.every_steps,
                total=stage.total_steps,
                also=lambda step: stage.saves(step) or due(stage.cfg, step, stage.total_steps),
                code=self.spec.sync.outer_code,
                fold=stage.fold,
                exact=self._exact(stage),
            )

    def _exact(self, stage: StageRuntime) -> bool:
        """Whether outer steps merge LoRA exactly (`sync.loraMerge`)."""
        sync = self.spec.sync
        merge = lora_merge_of(stage.cfg.method.type, sync.lora_merge, sync.outer_code,
                              len(self.spec.shares))  # fmt: skip
        return merge == "exact"

    def train_step(self, stage: StageRuntime, peers: Peers, runner: StepRunner) -> StepResult:
        """This pipeline's micro-batches of the step, shared among the pipelines that train
        it (`_plan`), trained; the step trained again by those left when one left in the
        middle of it (`ShortStepError`: attempt 1, 2, ...), so that it loses none of its
        micro-batches."""
        assert self.group is not None
        with self.group.watching(peers.broken):  # star.py, "A broken pipeline"
            return self._train_step(stage, peers, runner)

    def _train_step(self, stage: StageRuntime, peers: Peers, runner: StepRunner) -> StepResult:
        assert self.group is not None
        attempt = 0
        while True:
            plan = self._plan(stage, peers, self.group, attempt)
            mine = plan.mine(self.pipeline, self.cfg.training.micro_batches)
            if peers.prev is None and len(mine) != self._trains:
                self._trains = len(mine)
                log.info("Stage %s trains %d of the step's %d micro-batches from step %d",
                         self.name, len(mine), self.cfg.training.micro_batches,
                         stage.step + 1)  # fmt: skip
            micros = stage.micros(mine)
            if micros is not None and not self.periodic:  # the whole step's normaliser
                self.group.set_items(stage.step, count_items(micros[0]))
            try:
                return runner.run(stage.step, micros[1] if micros else None, len(mine), attempt)
            except ShortStepError as exc:
                attempt += 1
                stage.metrics.steps_redone.inc()
                log.warning("Stage %s trains step %d again: %s", self.name, stage.step + 1, exc)

    def after_step(self, step: int, result: StepResult) -> None:
        if self._outer is not None:
            self._outer.after_step(step, result.share_tokens)

    def links(self) -> dict[str, LinkCounters]:
        """The replica links, `replica:p1/s0` for pipeline 1's stage 0."""
        if self.group is None:
            return {}
        return {
            f"replica:{peer}": link
            for peer, link in self.group.links().items()
            if isinstance(link, Link)
        }

    def _plan(
        self, stage: StageRuntime, peers: Peers, group: LinkGroup, attempt: int
    ) -> Membership:
        """The pipelines that train this step (its attempt `attempt`) and their shares:
        stage 0 agrees on them with the other pipelines' first stages and sends them down
        the chain. When
        pipelines rejoin with this step, the stages of the lowest pipeline that stayed send
        each of their peers there the state of the names it holds, and the rejoining stages
        take it (at a step's first attempt only: a redo admits nobody)."""
        step = stage.step
        if peers.prev is None and self.leaving.is_set():
            self._leave(stage, peers)
        if peers.prev is None:
            if self.admitted is not None and self.admitted[0] == step and attempt == 0:
                plan = self.admitted[1]
            else:
                plan = group.agree_members(step, attempt)
            self.admitted = None
            if self.pipeline not in plan.members:
                raise LinkBroken(f"pipeline {self.pipeline} was left out of step {step}")
        else:
            meta = peers.prev.recv("plan", step).meta
            if meta.get("leave"):
                self._leave(stage, peers)
            self._leave_alone()
            plan = Membership.of_meta(meta)
            if meta.get("attempt", 0) != attempt:
                raise LinkBroken(f"stage 0 planned attempt {meta.get('attempt', 0)} of step "
                                 f"{step}, not this stage's {attempt}")  # fmt: skip
        if peers.next is not None:
            peers.next.send(Frame("plan", step, -1, {}, {**plan.to_meta(), "attempt": attempt}))
        group.begin(step, plan.members, plan.joined, attempt)
        if plan.joined:
            self._hand_state(stage, group, plan.members, plan.joined)
        self._write_for(stage, plan.members)
        return plan

    def depart(self) -> bool:
        """SIGTERM while training: the pipeline leaves at the next step boundary, where its
        stage 0 would plan the step. A second SIGTERM, or one while linking or rejoining,
        stops the stage at once."""
        if self.joining.is_set() or self.leaving.is_set():
            return False
        self._leave_by = time.monotonic() + LEAVE_WAIT_SECONDS
        self.leaving.set()
        log.info("Stage %s was asked to stop: it leaves at the next step boundary", self.name)
        return True

    def _leave(self, stage: StageRuntime, peers: Peers) -> None:
        """Leave the job at this step boundary: stage 0 takes no part in agreeing on the
        step (its replica links close first, so the other pipelines plan it without this
        one) and tells its chain, stage after stage; each closes its links and ends."""
        if peers.next is not None:
            peers.next.send(Frame("plan", stage.step, -1, {}, {"leave": True}))
            peers.next.flush()
        self.close_links()
        log.info(
            "Stage %s left the job at step %d, as asked; the other pipelines train on",
            self.name, stage.step,
        )  # fmt: skip
        raise DepartedError(f"stage {self.name} left at step {stage.step}")

    def _leave_alone(self) -> None:
        """A stage asked to stop whose stage 0 has not led the pipeline out within
        LEAVE_WAIT_SECONDS (only its own pod is going) stops at a step boundary, as a crash
        would: its pipeline then rejoins."""
        if self.leaving.is_set() and time.monotonic() > self._leave_by:
            raise KeyboardInterrupt

    def _hand_state(
        self, stage: StageRuntime, group: LinkGroup, members: set[int], joined: set[int]
    ) -> None:
        """At the step the pipelines `joined` rejoin, the stages of the lowest pipeline that
        stayed send each peer there the state of the names it holds (and, from a last stage,
        its pending loss records), and the rejoining stages take it."""
        source = min(members - joined)
        last = stage.cfg.stage.is_last
        if self.pipeline == source:
            for q in sorted(joined):
                for peer in group.peers_in(q):
                    names = [n for n, _ in stage.trainable if group.holds(peer, n)]
                    frame = state_frame(
                        stage.step, stage.trainable, stage.optimizer, stage.scheduler, names
                    )
                    if self._outer is not None:
                        frame.tensors.update(self._outer.anchor_tensors(names))
                    if last:  # as bytes: the records may outgrow a header
                        pending = json.dumps(stage.history.pending).encode()
                        frame.tensors[HISTORY_KEY] = torch.frombuffer(
                            bytearray(pending), dtype=torch.uint8
                        )
                    group.send_to(peer, frame)
            log.info(
                "Stage %s sent its state to pipeline(s) %s rejoining at step %d",
                self.name, sorted(joined), stage.step,
            )  # fmt: skip
        elif self.pipeline in joined:
            frames = [group.recv_from(peer, STATE, stage.step) for peer in group.peers_in(source)]
            records = [f.tensors.pop(HISTORY_KEY) for f in frames if HISTORY_KEY in f.tensors]
            anchors = {
                n: t for f in frames for n, t in f.tensors.items() if n.startswith(ANCHOR_PREFIX)
            }
            for f in frames:
                for n in anchors:
                    f.tensors.pop(n, None)
            load_state_frames(frames, stage.trainable, stage.optimizer, stage.scheduler)
            if self._outer is not None:
                self._outer.take_anchor(anchors)
            if last and records:
                stage.history.take(json.loads(bytes(records[0].numpy())))
            stage.seed(stage.step)
            stage.metrics.step.set(stage.step)
            log.info(
                "Stage %s rejoined at step %d with the state of pipeline %d",
                self.name, stage.step, source,
            )  # fmt: skip

    def _write_for(self, stage: StageRuntime, members: set[int]) -> None:
        """This step's writer is the lowest pipeline training it. A pipeline that becomes it
        (pipeline 0 is out, or has rejoined) takes over: its last stage adopts the loss
        history and learns the newest commit from the store."""
        was, self.writer = self.writer, self.pipeline == min(members)
        if not self.writer or was:
            return
        log.info("Stage %s writes for the job from step %d", self.name, stage.step)
        if stage.cfg.stage.is_last:
            stage.history.adopt()
            stage.last_committed = ckpt.latest_committed(self.store, self.prefix)
            if stage.last_committed is not None:
                stage.metrics.last_committed_step.set(stage.last_committed)

    # -- checkpoints and the end -------------------------------------------------------

    def writes_checkpoint(self, stage: StageRuntime, step: int) -> bool:
        """The writer saves for every pipeline: they hold the same weights. A last stage of
        another pipeline forgets the loss records the writer has surely written."""
        if self.writer:
            return True
        if stage.cfg.stage.is_last:
            stage.history.forget_through(step - stage.cfg.checkpoint.every_steps)
        return False

    def save_failed(self, step: int, exc: Exception) -> None:
        """Another pipeline wrote this step: the two were cut apart and each took itself for
        the lowest left. The first commit wins; this pipeline leaves and rejoins."""
        why = f"pipeline {self.pipeline} lost the writing of step {step}: {exc}"
        raise LinkBroken(why) from exc

    def flush(self) -> None:
        if self.group is not None:
            self.group.flush()
        self._stop.set()

    def close_links(self) -> None:
        self._stop.set()
        if self.group is not None:
            self.group.close()  # it owns the replica links
        else:
            for link in self._links.values():
                link.close()
