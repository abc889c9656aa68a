"""A stage process: links, the step loop, checkpoints, progress, metrics and recovery.

Life of a stage:
1. Load its slice of the base model once (and, on stage 0, the tokenizer and data).
2. Restore the latest committed checkpoint from the store, if any (a replacement pod
   starts here).
3. Connect: accept the previous stage, connect to the next; then a handshake down and
   up the chain agrees on the step to resume from (the newest committed step any
   stage saw); a stage that holds another step restores the agreed one.
4. Train step after step. Every `everySteps` (and after the last step) each stage saves
   its trainable weights, optimizer/schedule/RNG state and data position; a "saved"
   token runs down the chain and the last stage, which then knows every stage has
   saved, writes the commit manifest and prunes old steps.
5. When a link breaks, the stage closes its other link (so the break reaches every
   stage), restores the latest committed step from the store — weights, optimizer,
   RNG and data position only; the process and the base model stay — and goes back
   to 3.
6. After the last step the last stage merges every stage's part of the final commit
   into the output (PEFT adapter or full weights) and marks progress.json done.

With several pipelines (the document's `replicas` section) the stage also holds a link to
each stage of the other pipelines that shares its layers (`replicas.ReplicaLinks`), opened
with its pipeline links in 3; stage 0 of pipeline p trains its share of every step's
micro-batches; the step's token count, gradients, loss and token rate are reduced over
every pipeline (`dataparallel`). One pipeline writes for all — saves checkpoints, commits,
and writes progress.json and the output: every pipeline holds the same weights. The writer
of a step is the lowest pipeline training it, so pipeline 0 unless it is out, when the next
takes over (its files under `step-N/p<w>/`, its split in the manifest) and gives the
writing back when pipeline 0 has rejoined. In 3 the other pipelines take the resume step
pipeline 0 (the lowest not given up) agreed from their peers there; a stage restores a
commit another pipeline wrote by parameter name from that pipeline's stages that hold its
layers (their split may differ). A failed stage takes only its pipeline out
(docs/worker.md, "Several pipelines as processes"): a broken pipeline link makes the stage
close every link and rejoin, a broken replica link is a peer's pipeline leaving, and the
others train on. At every step the
first stages agree on the pipelines that train it (`LinkGroup.agree_members`) and send the
plan down their chains; the step's micro-batches are shared among those (`live_shares`).
A stage (re)starting finds, by the hello on its replica links, whether any pipeline is
training: if so it rejoins at a step boundary with a live peer's state, by parameter name
(`_rejoin`); only when none is does it restore the last commit as in 2-3.

With `replicas.sync.mode: periodic` only the loss and the counts are reduced each step:
every pipeline steps on its own share, and an outer step (`periodic.PeriodicSync`) averages
the weights every `everySteps` steps, after the last, and before every checkpoint and
evaluation, so that what the writer saves and evaluates is every replica's weights.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import safetensors.torch
import torch
from relaytrain_contract import GIVEN_UP_FILE, StageConfig

from relaytrain_worker import checkpoint as ckpt
from relaytrain_worker.data import DataReport, read_report, write_report
from relaytrain_worker.dataparallel import LinkGroup, live_shares, micro_ranges
from relaytrain_worker.evaluation import due, evaluate, load_eval_batches
from relaytrain_worker.export import TRAINABLE_FILE, export_output
from relaytrain_worker.history import LossHistory
from relaytrain_worker.linkauth import AuthError, LinkBroken, LinkCredentials
from relaytrain_worker.methods import TIED_NAME, init_lora, lora_config, setup_method
from relaytrain_worker.metrics import MetricsServer, StageMetrics, serve
from relaytrain_worker.model_slice import SliceSpec, build_stage_model
from relaytrain_worker.modelfiles import resolve_model_dir
from relaytrain_worker.peers import Peers
from relaytrain_worker.periodic import PeriodicSync
from relaytrain_worker.progress import Progress, read_progress, write_progress
from relaytrain_worker.replicas import (
    STATE,
    GivenUp,
    Peer,
    ReplicaLinks,
    exchange_hellos,
    load_state_frames,
    peer_stages,
    state_frame,
)
from relaytrain_worker.schedule import StepRunner, count_items
from relaytrain_worker.store import ObjectNotFound, Store, open_job_store
from relaytrain_worker.training import (
    load_merged_state,
    load_state_bytes,
    make_optimizer,
    optimizer_step,
    state_bytes,
)
from relaytrain_worker.transport import Frame, Link, Listener, connect, listen

log = logging.getLogger("relaytrain.stage")

STATE_FILE = "state.pt"
META_FILE = "meta.json"
HISTORY_KEY = "__loss_history__"
"""The pending loss records a last stage sends a rejoining last stage with its state."""
CONNECT_FOR = 600.0
"""How long a stage keeps trying to reach its next stage (a replacement pod takes time)."""


def link_credentials(cfg: StageConfig, environ: Mapping[str, str] = os.environ) -> LinkCredentials:
    """This stage's link credentials from the environment variables its config names.

    AuthError, before any model is loaded, when they are missing, do not load, expired, or
    name another stage than the config says (a Secret wired to the wrong pod).
    """
    links = cfg.links
    tls = LinkCredentials.from_env(links.certEnv, links.keyEnv, links.caEnv, environ)
    if tls.identity != links.identity:
        raise AuthError(
            f"the link certificate in {links.certEnv} is {tls.identity}, but this stage is "
            f"{links.identity}"
        )
    tls.check_valid()
    return tls


def job_finished(progress: Progress | None, started: datetime, total_steps: int) -> bool:
    """Whether progress.json says the job is done for a stage that started at `started`:
    done, and written after the stage started or at the job's last step (a replacement
    started just as the others finished finds the job done before it began; a done record
    of fewer steps is another run's, e.g. before the job's steps were raised)."""
    if progress is None or not progress.done:
        return False
    fresh = progress.updatedAt is not None and progress.updatedAt >= started
    return fresh or progress.step == progress.totalSteps == total_steps


class StageRuntime:
    """One stage process."""

    def __init__(self, cfg: StageConfig) -> None:
        self.cfg = cfg
        self.k = cfg.stage.index
        self.count = cfg.stage.count
        self.pipeline = cfg.replicas.pipeline if cfg.replicas is not None else 0
        """This stage's pipeline (0 when the job has one)."""
        self.name = str(self.k) if cfg.replicas is None else f"p{self.pipeline}/s{self.k}"
        """How logs name this stage: `1`, or `p1/s0` with several pipelines."""
        self.periodic = cfg.replicas is not None and cfg.replicas.sync.mode == "periodic"
        """Whether the pipelines average their weights every few steps (periodic.py) rather
        than reduce gradients every step."""
        self.writer = self.pipeline == 0
        """Whether this stage's pipeline writes for the step just trained: saves checkpoints
        (and, as the last stage, commits them and writes progress.json, the loss history and
        the output). The lowest pipeline training the step (`_plan`): pipeline 0 unless it
        is out."""
        self.tls = link_credentials(cfg)
        self.replicas = ReplicaLinks(cfg, self.tls) if cfg.replicas is not None else None
        """The links to the other pipelines (None: this pipeline trains alone)."""
        self.prefix = f"{cfg.job.namespace}/{cfg.job.name}"
        self.store = self._open(cfg.checkpoint.uri)
        self.given_up = GivenUp(self._given_up_document)
        """The pipelines the operator gave up (names.GIVEN_UP_FILE): linking skips them."""
        self.model_dir = resolve_model_dir(cfg, self._open)
        spec = SliceSpec(
            cfg.stage.layerStart, cfg.stage.layerEnd, cfg.stage.is_first, cfg.stage.is_last
        )
        self.stage = build_stage_model(self.model_dir, spec, cfg.model.dtype)
        self.lora = (
            None
            if cfg.method.type == "full"
            else lora_config(
                cfg.method.rank, cfg.method.alpha, cfg.method.dropout, cfg.method.targetModules
            )
        )
        self.trainable = setup_method(self.stage, cfg.method.type, self.lora, cfg.training.seed)
        # With `epochs` every stage reads the dataset to derive the same step count.
        need_data = cfg.stage.is_first or cfg.training.steps is None
        self.data = self._load_data() if need_data else None
        self._report_due = cfg.stage.is_first and self.data is not None
        """Stage 0 writes its example counts once, after its links are up (a stage that
        never links, e.g. one holding another job's certificate, writes nothing); the last
        stage reports them in progress.json (`_publish`). Every pipeline's stage 0 writes
        the same counts (the same data), so a pipeline given up before it linked leaves
        them written."""
        self.eval_batches = (
            self._load_data(load_eval_batches)
            if cfg.stage.is_first and cfg.dataset.validation is not None
            else None
        )
        """The held-out micro-batches (every stage 0: the writer's pipeline evaluates;
        evaluation.py)."""
        self.data_report: DataReport | None = None
        """Stage 0's example counts, as the last stage read them for progress.json."""
        steps = cfg.training.steps
        if steps is None:
            assert self.data is not None and cfg.training.epochs is not None
            steps = self.data.steps_for_epochs(cfg.training.epochs)
        self.training = cfg.training.model_copy(update={"steps": steps, "epochs": None})
        self.total_steps = steps
        self.optimizer, self.scheduler = make_optimizer(self.trainable, self.training)
        self.metrics = StageMetrics(
            cfg.job.name, self.k, self.pipeline if cfg.replicas is not None else None
        )
        self.metrics.total_steps.set(self.total_steps)
        self.server: MetricsServer | None = None
        self.listener: Listener | None = None
        self.history = LossHistory(self.store, self.prefix)
        """The loss records (last stage only): appended per step, written per commit."""
        self.step_seconds: float | None = None
        self.last_committed: int | None = None
        self.step = 0
        self.kept: tuple[int, dict[str, bytes]] | None = None
        """(step, files) of this stage's last save, to roll back without a download."""
        self.micros = range(cfg.training.microBatches)
        """The micro-batches of each step this pipeline trains (all of them without replicas)."""
        if cfg.replicas is not None:
            self.micros = micro_ranges(cfg.replicas.shares)[self.pipeline]
        self.joining = threading.Event()
        """Set while this stage links and (re)joins rather than trains (`_exit_when_done`)."""
        self.admitted: tuple[int, set[int], set[int]] | None = None
        """(step, members, joined) of the step a rejoining pipeline was admitted at (stage 0
        plans that step from it instead of agreeing again)."""

    # -- setup -----------------------------------------------------------------------

    def open_endpoints(self) -> None:
        """Serve /metrics and /healthz and listen for the previous stage (once)."""
        cfg = self.cfg
        if self.server is None:
            self.server = serve(self.metrics, cfg.observability.port)
        if self.listener is None and cfg.links.listen is not None:
            assert cfg.links.prevIdentity is not None  # the config checks both are set
            self.listener = listen(
                cfg.links.listen, credentials=self.tls, expect=cfg.links.prevIdentity
            )
        if self.replicas is not None:
            self.replicas.open()

    def _open(self, uri: str) -> Store:
        return open_job_store(uri, self.cfg.checkpoint)

    def _load_data(self, held_out: Any = None) -> Any:
        """The training data, or with `held_out` (evaluation.load_eval_batches) that."""
        from transformers import AutoTokenizer

        from relaytrain_worker.data import load_step_data

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        t = self.cfg.training
        max_pos = getattr(self.stage.config, "max_position_embeddings", None)
        if held_out is not None:
            return held_out(
                self.cfg.dataset, tokenizer, max_positions=max_pos,
                micro_batch_size=t.microBatchSize, seed=t.seed, opener=self._open,
            )  # fmt: skip
        return load_step_data(
            self.cfg.dataset,
            tokenizer,
            max_positions=max_pos,
            micro_batch_size=t.microBatchSize,
            micro_batches=t.microBatches,
            seed=t.seed,
            opener=self._open,
        )

    # -- checkpoint state ------------------------------------------------------------

    def _files(self, step: int) -> dict[str, bytes]:
        tensors = {name: p.detach().contiguous() for name, p in self.trainable}
        meta = {
            "step": step, "dataStep": step, "stage": self.k,
            "layerStart": self.cfg.stage.layerStart, "layerEnd": self.cfg.stage.layerEnd,
        }  # fmt: skip
        return {
            TRAINABLE_FILE: safetensors.torch.save(tensors),
            STATE_FILE: state_bytes(self.optimizer, self.scheduler, self._names()),
            META_FILE: json.dumps(meta).encode(),
        }

    def _names(self) -> list[str]:
        """Global names of the trainable parameters, in the optimizer's order: its state is
        saved under them, not by position (DESIGN.md: any split restores any checkpoint)."""
        return [name for name, _ in self.trainable]

    def restore(self, step: int | None) -> int:
        """Roll this stage back to committed `step` (None: the initial state); returns it.

        Raises CorruptCheckpoint when this stage's files of `step` do not verify.
        """
        self.metrics.restores.inc()
        if step is None:
            self._reset()
            return 0
        source, stages = ckpt.committed_by(self.store, self.prefix, step)
        if source != self.pipeline or stages != self.count:
            return self._restore_by_name(step, source, stages)
        files = self._committed_files(step)
        tensors = safetensors.torch.load(files[TRAINABLE_FILE])
        with torch.no_grad():
            for name, param in self.trainable:
                param.copy_(tensors[name])
        load_state_bytes(files[STATE_FILE], self.optimizer, self.scheduler, self._names())
        self.optimizer.zero_grad(set_to_none=True)
        self.last_committed = step
        log.info("Stage %s restored committed step %d", self.name, step)
        return step

    def _restore_by_name(self, step: int, source: int, stages: int) -> int:
        """Restore committed `step`, which pipeline `source` wrote in `stages` stages, from
        the stages that hold this stage's layers, by parameter name (the splits may differ):
        the peers in `source`, or every stage of it when they are not known. The RNG, which
        was another stage's, is seeded from (seed, step, pipeline, stage)."""
        holders = (
            peer_stages(self.cfg.replicas.peers, source)
            if self.cfg.replicas is not None and source != self.pipeline
            else []
        )
        parts = [
            ckpt.load_stage(self.store, self.prefix, step, j) for j in holders or range(stages)
        ]
        tensors: dict[str, torch.Tensor] = {}
        for files in parts:
            tensors.update(safetensors.torch.load(files[TRAINABLE_FILE]))
        missing = [name for name in self._names() if name not in tensors]
        if missing:
            raise ckpt.CorruptCheckpoint(
                f"step {step} holds no {missing[0]} (and {len(missing) - 1} more) in the "
                f"pipeline-{source} stages that should hold this stage's layers"
            )
        with torch.no_grad():
            for name, param in self.trainable:
                param.copy_(tensors[name])
        load_merged_state([f[STATE_FILE] for f in parts], self.optimizer, self.scheduler,
                          self._names())  # fmt: skip
        self.optimizer.zero_grad(set_to_none=True)
        self._seed(step)
        self.last_committed = step
        log.info("Stage %s restored committed step %d by name", self.name, step)
        return step

    def _seed(self, step: int) -> None:
        """This stage's RNG (dropout) from the seed, its place and `step`: pipeline 0's stages
        start as a lone pipeline's do; the others differ (their micro-batches differ)."""
        seed = self.cfg.training.seed
        torch.manual_seed(seed * 131 + self.k + 7919 * self.pipeline + 104729 * step)

    def _nothing_left(self, restored: int | None) -> bool:
        """Whether this (re)started stage restored the job's final commit with every file
        of every stage intact: nothing is left to train, and the stages that finished it
        may have exited, so it waits for no peer (the output writer exports again; a stage
        killed between the final commit and the output would otherwise wait forever)."""
        return (
            restored == self.total_steps
            and ckpt.latest_committed(self.store, self.prefix, verify_files=True, at_most=restored)
            == restored
        )

    def restore_newest(self) -> int | None:
        """Restore the newest committed step whose files of this stage verify; returns it.

        A commit with a corrupt or missing file of this stage is skipped (and logged) for
        the one before it; the handshake then makes every stage agree on a step whose
        files all verify (see `_handshake`).
        """
        for step in reversed(ckpt.committed_steps(self.store, self.prefix)):
            try:
                return self.restore(step)
            except ckpt.CorruptCheckpoint as exc:
                log.warning("Stage %s skipped checkpoint step %d: %s", self.name, step, exc)
        self.restore(None)
        return None

    def _committed_files(self, step: int) -> dict[str, bytes]:
        """A surviving stage's own copy when it is what `step` committed, else the store's."""
        kept = self.kept
        if (
            kept is not None
            and kept[0] == step
            and ckpt.matches_commit(
                self.store, self.prefix, step, self.k, kept[1], pipeline=self.pipeline
            )
        ):
            log.info("Stage %s rolls back from its own copy of step %d", self.name, step)
            return kept[1]
        return ckpt.load_stage(self.store, self.prefix, step, self.k)

    def _reset(self) -> None:
        """The state before step 0: fresh adapter (or base weights), optimizer and RNG."""
        if self.cfg.method.type == "full":
            fresh = build_stage_model(self.model_dir, self.stage.spec, self.cfg.model.dtype)
            fresh_params = dict(fresh.model.named_parameters())
            with torch.no_grad():
                for name, param in self.stage.model.named_parameters():
                    param.copy_(fresh_params[name])
        else:
            init_lora(self.stage.model, self.cfg.training.seed)
        self.optimizer, self.scheduler = make_optimizer(self.trainable, self.training)
        self._seed(0)

    # -- links -----------------------------------------------------------------------

    def _connect(self) -> Peers:
        prev: Link | None = None
        nxt: Link | None = None
        try:
            links = self.cfg.links
            if links.next is not None:
                assert links.nextIdentity is not None  # the config checks both are set
                nxt = connect(
                    links.next, credentials=self.tls, expect=links.nextIdentity,
                    retry_for=CONNECT_FOR,
                )  # fmt: skip
            if self.listener is not None:
                prev = self.listener.accept(timeout=CONNECT_FOR)
        except BaseException:
            for link in (prev, nxt):
                if link is not None:
                    link.close()
            raise
        return Peers(prev, nxt)

    def _given_up_document(self) -> bytes | None:
        try:
            return self.store.get(f"{self.prefix}/{GIVEN_UP_FILE}")
        except ObjectNotFound:
            return None

    def _links(self) -> tuple[Peers, dict[Peer, Link]]:
        """This stage's pipeline links and (with replicas) its links to the other pipelines
        but those the operator gave up."""
        if self.replicas is None:
            return self._connect(), {}
        return self.replicas.connect(CONNECT_FOR, self._connect, Peers.close, self.given_up)

    def _agree(self, peers: Peers, replica_links: dict[Peer, Link], mine: int | None) -> int | None:
        """The step every stage resumes from: the leader's chain (pipeline 0 unless it was
        given up) agrees on it (`_handshake`) and tells the other pipelines, which take it
        from their peers there."""
        if self.replicas is None:
            return self._handshake(peers, mine)
        if self.pipeline != self.replicas.leader:
            return self.replicas.recv_resume(replica_links, CONNECT_FOR)
        agreed = self._handshake(peers, mine)
        self.replicas.send_resume(replica_links, agreed)
        return agreed

    def _handshake(self, peers: Peers, mine: int | None) -> int | None:
        """Agree on the resume step: the newest committed step any stage saw."""
        agreed = mine
        if peers.prev is not None:
            seen = peers.prev.recv("hello", -1).meta["resume"]
            agreed = _newest(agreed, seen)
        if peers.next is not None:
            peers.next.send(Frame("hello", -1, -1, {}, {"resume": agreed}))
            agreed = peers.next.recv("resume", -1).meta["resume"]
        else:
            # Each stage checked only its own files. The coordinator re-reads every stage's
            # files of the agreed step (once per start or recovery) and falls back to the
            # newest commit that is intact throughout, so no stage restores a corrupt file.
            if agreed is not None:
                agreed = ckpt.latest_committed(
                    self.store, self.prefix, verify_files=True, at_most=agreed
                )
            # It drops anything newer (partial saves, corrupt commits) so reruns can write it.
            ckpt.discard_after(self.store, self.prefix, agreed)
            self.history.discard_after(agreed)
        if peers.prev is not None:
            peers.prev.send(Frame("resume", -1, -1, {}, {"resume": agreed}))
        return agreed

    # -- the loop --------------------------------------------------------------------

    def run(self) -> int:
        """Train to the end, recovering from broken links; returns the exit code."""
        self.open_endpoints()
        if self.replicas is not None:
            threading.Thread(target=self._exit_when_done, name="done-watch", daemon=True).start()
        restored = self.restore_newest()
        self.step = restored or 0
        if self._nothing_left(restored):
            log.info("Stage %s restored the job's final commit: nothing left to train", self.name)
            assert restored is not None
            wrote = ckpt.committed_by(self.store, self.prefix, restored)[0] == self.pipeline
            if self.cfg.stage.is_last and wrote:
                self._finish()
            self.metrics.set_health("done", step=self.step)
            return 0
        attempt = 0
        # A stage that restored the final step of a commit with a bad file joins one
        # handshake: every stage redoes the end from the newest intact commit.
        while True:
            peers: Peers | None = None
            replica_links: dict[Peer, Link] = {}
            group: LinkGroup | None = None
            stop = threading.Event()
            self.joining.set()
            try:
                self.metrics.set_health("ready", step=self.step)
                peers, replica_links = self._links()
                live = self._hello(replica_links)
                if live:  # other pipelines are training: rejoin them from their state
                    assert self.replicas is not None
                    group = self.replicas.group(replica_links, members=live)
                    replica_links = {}
                    self.writer = False  # until a step's plan makes it the lowest again
                    self._rejoin(peers, group)
                else:
                    agreed = self._agree(peers, replica_links, restored)
                    if agreed != restored:
                        restored = agreed
                        self.step = self.restore(agreed)
                    # Every pipeline starts from the commit; the leader writes first.
                    self.writer = self.replicas is None or self.pipeline == self.replicas.leader
                    if self.cfg.stage.is_last:
                        self.history.resume(restored)
                    if self.replicas is not None:
                        group = self.replicas.group(replica_links)
                        replica_links = {}
                if group is not None:
                    assert self.replicas is not None
                    self.replicas.relink(group, lambda: self.step, stop)
                self.metrics.set_health("training", step=self.step)
                self.joining.clear()
                if self._report_due and self.data is not None:
                    write_report(self.store, self.prefix, self.data.report)
                    self._report_due = False
                self._train(peers, group)
                for link in (peers.prev, peers.next):
                    if link is not None:
                        link.flush()
                if group is not None:
                    group.flush()
                stop.set()
                break
            except (LinkBroken, TimeoutError) as exc:
                attempt += 1
                stop.set()
                self.metrics.set_health("recovering", reason=str(exc))
                log.warning("Stage %s lost a link at step %d: %s", self.name, self.step, exc)
                _close(peers, replica_links, group)
                time.sleep(min(2.0 * attempt, 10.0))
                restored = self.restore_newest()
                self.step = restored or 0
            except AuthError:
                stop.set()
                _close(peers, replica_links, group)
                raise
        if self.cfg.stage.is_last and self.writer:
            self._finish()
        _close(peers, replica_links, group)
        self.metrics.set_health("done", step=self.step)
        return 0

    def _train(self, peers: Peers, group: LinkGroup | None) -> None:
        t = self.training
        runner = StepRunner(
            self.stage,
            index=self.k,
            count=self.count,
            peers=peers,
            trainable=self.trainable,
            compression=self.cfg.pipeline.compression,
            max_grad_norm=t.maxGradNorm,
            tied_name=self._tied_name(),
            group=group,
            pipeline=self.pipeline,
            periodic=self.periodic,
        )
        outer = None
        if self.periodic and group is not None:
            assert self.cfg.replicas is not None and self.cfg.replicas.sync.everySteps
            outer = PeriodicSync.of(
                runner,
                group,
                every=self.cfg.replicas.sync.everySteps,
                total=self.total_steps,
                also=lambda step: self._saves(step) or due(self.cfg, step, self.total_steps),
            )
        # tokens/s: non-padding input tokens per second of wall time, measured from one
        # step's end to the next, so optimizer steps and checkpoint saves count too. With
        # replicas the last stage counts every pipeline's tokens (the whole job's rate).
        if self.step == 0 and self.writer and due(self.cfg, 0, self.total_steps):
            self._evaluate(peers)  # the base model's held-out loss
        mark = time.monotonic()
        while self.step < self.total_steps:
            mine = self.micros
            if group is not None:
                assert self.cfg.replicas is not None
                members = self._plan(peers, group)
                shares = live_shares(self.cfg.replicas.shares, members)
                mine = micro_ranges(shares)[self.pipeline]
            micros = None
            if self.cfg.stage.is_first:
                assert self.data is not None
                step_micros = self.data.step(self.step)
                if group is not None and not self.periodic:  # the whole step's normaliser
                    group.set_items(self.step, count_items(step_micros))
                micros = [step_micros[i] for i in mine]
            result = runner.run(self.step, micros, len(mine))
            optimizer_step(self.optimizer, self.scheduler)
            self.step += 1
            if outer is not None:
                outer.after_step(self.step, result.share_tokens)
            now = time.monotonic()
            seconds = max(now - mark, 1e-9)
            rate = result.step_input_tokens / seconds
            mark = now
            self._report(peers, result.loss, rate, seconds, group)
            if self.writer and due(self.cfg, self.step, self.total_steps):
                self._evaluate(peers)  # before the commit, whose history carries it
            if self._saves(self.step):
                self._checkpoint(peers, self.step)

    def _saves(self, step: int) -> bool:
        """Whether the boundary after `step` steps is a checkpoint."""
        return step % self.cfg.checkpoint.everySteps == 0 or step == self.total_steps

    # -- several pipelines: who trains, rejoining --------------------------------------

    def _hello(self, replica_links: dict[Peer, Link]) -> set[int]:
        """Tell every replica peer this stage is (re)joining; returns the pipelines whose
        stages answer that they are training (none: the job starts, or every pipeline
        failed, and restores the last commit)."""
        if self.replicas is None:
            return set()
        hellos = exchange_hellos(replica_links, live=False, step=self.step)
        return {q for (q, _), hello in hellos.items() if hello.get("live")}

    def _rejoin(self, peers: Peers, group: LinkGroup) -> None:
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
            step, members, joined = group.join(CONNECT_FOR)
            self.admitted = (step, members, joined)
        if peers.next is not None:
            peers.next.send(Frame("rejoin", -1, -1, {}, {"step": step}))
        self.step = step
        log.info("Stage %s rejoins the job at step %d", self.name, step)

    def _exit_when_done(self) -> None:
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
            if job_finished(progress, started, self.total_steps) and self.joining.is_set():
                log.info("Stage %s found the job finished while rejoining", self.name)
                logging.shutdown()
                os._exit(0)

    def _plan(self, peers: Peers, group: LinkGroup) -> set[int]:
        """The pipelines that train this step: stage 0 agrees on them with the other
        pipelines' first stages and sends them down the chain. When pipelines rejoin with
        this step, the stages of the lowest pipeline that stayed send each of their peers
        there the state of the names it holds, and the rejoining stages take it."""
        if peers.prev is None:
            if self.admitted is not None and self.admitted[0] == self.step:
                _, members, joined = self.admitted
            else:
                members, joined = group.agree_members(self.step)
            self.admitted = None
            if self.pipeline not in members:
                raise LinkBroken(f"pipeline {self.pipeline} was left out of step {self.step}")
        else:
            meta = peers.prev.recv("plan", self.step).meta
            members, joined = set(meta["members"]), set(meta["joined"])
        if peers.next is not None:
            plan = {"members": sorted(members), "joined": sorted(joined)}
            peers.next.send(Frame("plan", self.step, -1, {}, plan))
        group.begin(self.step, members, joined)
        if joined:
            self._hand_state(group, members, joined)
        self._write_for(members)
        return members

    def _hand_state(self, group: LinkGroup, members: set[int], joined: set[int]) -> None:
        """At the step the pipelines `joined` rejoin, the stages of the lowest pipeline that
        stayed send each peer there the state of the names it holds (and, from a last stage,
        its pending loss records), and the rejoining stages take it."""
        source = min(members - joined)
        if self.pipeline == source:
            for q in sorted(joined):
                for peer in group.peers_in(q):
                    names = [n for n, _ in self.trainable if group.holds(peer, n)]
                    frame = state_frame(
                        self.step, self.trainable, self.optimizer, self.scheduler, names
                    )
                    if self.cfg.stage.is_last:  # as bytes: the records may outgrow a header
                        pending = json.dumps(self.history.pending).encode()
                        frame.tensors[HISTORY_KEY] = torch.frombuffer(
                            bytearray(pending), dtype=torch.uint8
                        )
                    group.send_to(peer, frame)
            log.info(
                "Stage %s sent its state to pipeline(s) %s rejoining at step %d",
                self.name, sorted(joined), self.step,
            )  # fmt: skip
        elif self.pipeline in joined:
            frames = [group.recv_from(peer, STATE, self.step) for peer in group.peers_in(source)]
            records = [f.tensors.pop(HISTORY_KEY) for f in frames if HISTORY_KEY in f.tensors]
            load_state_frames(frames, self.trainable, self.optimizer, self.scheduler)
            if self.cfg.stage.is_last and records:
                self.history.take(json.loads(bytes(records[0].numpy())))
            self._seed(self.step)
            self.metrics.step.set(self.step)
            log.info(
                "Stage %s rejoined at step %d with the state of pipeline %d",
                self.name, self.step, source,
            )  # fmt: skip

    def _write_for(self, members: set[int]) -> None:
        """This step's writer is the lowest pipeline training it. A pipeline that becomes it
        (pipeline 0 is out, or has rejoined) takes over: its last stage adopts the loss
        history and learns the newest commit from the store."""
        was, self.writer = self.writer, self.pipeline == min(members)
        if not self.writer or was:
            return
        log.info("Stage %s writes for the job from step %d", self.name, self.step)
        if self.cfg.stage.is_last:
            self.history.adopt()
            self.last_committed = ckpt.latest_committed(self.store, self.prefix)
            if self.last_committed is not None:
                self.metrics.last_committed_step.set(self.last_committed)

    def _tied_name(self) -> str | None:
        tied = bool(getattr(self.stage.config, "tie_word_embeddings", False))
        return TIED_NAME if self.cfg.method.type == "full" and tied else None

    def _report(
        self,
        peers: Peers,
        loss: float | None,
        rate: float,
        seconds: float,
        group: LinkGroup | None = None,
    ) -> None:
        self.metrics.step.set(self.step)
        self.metrics.tokens_per_second.set(rate)
        for name, link in (("prev", peers.prev), ("next", peers.next)):
            if link is not None:
                self.metrics.update_link(name, link.link)  # type: ignore[arg-type]
        if group is not None:  # the replica links, `replica:p1/s0` for pipeline 1's stage 0
            for peer, replica in group.links().items():
                if isinstance(replica, Link):
                    self.metrics.update_link(f"replica:{peer}", replica)
        if loss is None:
            return
        self.metrics.loss.set(loss)
        self.history.append(self.step, loss, rate)  # every last stage: a writer-to-be
        self.step_seconds = seconds
        if self.writer:
            self._publish()

    def _evaluate(self, peers: Peers) -> None:
        """The held-out loss at this step through this pipeline (evaluation.py); the last
        stage reports it (gauge, loss history, progress.json)."""
        stage = self.cfg.stage
        loss = evaluate(self.stage, peers, self.step, self.eval_batches, first=stage.is_first,
                        last=stage.is_last, compression=self.cfg.pipeline.compression)  # fmt: skip
        if loss is None:
            return
        log.info("Stage %s evaluated held-out loss %.4f at step %d", self.name, loss, self.step)
        self.metrics.eval_loss.set(loss)
        self.metrics.eval_step.set(self.step)
        self.history.append_eval(self.step, loss)
        self._publish()

    def _publish(self, *, done: bool = False) -> None:
        """Write progress.json (the last stage's only writer of it): this step, the newest
        loss record, the newest commit, and when done the output."""
        last = self.history.last or {"loss": None, "tokensPerSecond": 0.0}
        if self.data_report is None:
            self.data_report = read_report(self.store, self.prefix)
        report = self.data_report
        held = self.history.last_eval
        write_progress(
            self.store,
            self.prefix,
            Progress(
                step=self.step,
                totalSteps=self.total_steps,
                loss=last["loss"],
                tokensPerSecond=float(last["tokensPerSecond"] or 0.0),
                lastCommittedStep=self.last_committed,
                stepSeconds=self.step_seconds,
                done=done,
                output=self.cfg.output.uri if done else None,
                examples=report.examples if report else None,
                examplesTruncated=report.truncated if report else None,
                examplesDropped=report.dropped if report else None,
                evalLoss=held["evalLoss"] if held else None,
                evalStep=held["step"] if held else None,
            ),
        )

    def _checkpoint(self, peers: Peers, step: int) -> None:
        if not self.writer:  # the writer saves for every pipeline: they hold the same weights
            if self.cfg.stage.is_last:
                self.history.forget_through(step - self.cfg.checkpoint.everySteps)
            return
        started = time.monotonic()
        files = self._files(step)
        try:
            ckpt.save_stage(self.store, self.prefix, step, self.k, files, pipeline=self.pipeline)
        except ckpt.CheckpointError as exc:
            if self.replicas is None:
                raise
            # Another pipeline wrote this step: the two were cut apart and each took itself
            # for the lowest left. The first commit wins; this pipeline leaves and rejoins.
            why = f"pipeline {self.pipeline} lost the writing of step {step}: {exc}"
            raise LinkBroken(why) from exc
        # Adapters are small: keep the copy for a rollback. Full weights are not kept twice.
        self.kept = (step, files) if self.cfg.method.type != "full" else None
        self.metrics.checkpoint_seconds.observe(time.monotonic() - started)
        if peers.prev is not None:
            peers.prev.recv("saved", step)
        if peers.next is not None:
            peers.next.send(Frame("saved", step, -1))
            return
        # The loss records of the steps up to this one go first: every committed step's
        # record is then in the store.
        self.history.write(step)
        if ckpt.try_commit(self.store, self.prefix, step, self.count, pipeline=self.pipeline):
            self.last_committed = step
            self.metrics.last_committed_step.set(step)
            ckpt.prune(self.store, self.prefix, self.cfg.checkpoint.keep)
            self._publish()

    def _finish(self) -> None:
        """Export the final commit and mark the job done (last stage only)."""
        out = self._open(self.cfg.output.uri)
        export_output(
            self.cfg,
            self.store,
            self.prefix,
            step=self.total_steps,
            out=out,
            model_dir=self.model_dir,
        )
        self.history.finish()
        self.step = self.last_committed = self.total_steps
        self._publish(done=True)
        log.info("Stage %s wrote the output to %s", self.name, self.cfg.output.uri)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.listener is not None:
            self.listener.close()
        if self.replicas is not None:
            self.replicas.close()


def _close(peers: Peers | None, replica_links: dict[Peer, Link], group: LinkGroup | None) -> None:
    """Close every link of a stage: the break reaches its neighbours in every pipeline."""
    if peers is not None:
        peers.close()
    if group is not None:
        group.close()  # it owns the replica links
    else:
        for link in replica_links.values():
            link.close()


def _newest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)
