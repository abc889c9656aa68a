"""A stage process: links, the step loop, checkpoints, progress, metrics and recovery.

Life of a stage:
1. Load its slice of the base model once (and, on stage 0, the tokenizer and data):
   `loading.load_stage`, before the runtime is built (building it does no I/O).
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

A stage of one of several pipelines (the document's `replicas` section) lives the same
life. What the other pipelines add — links to them in 3, agreeing with them where to
resume or rejoining them, the share of each step this pipeline trains, the exchange of each
step, which pipeline writes — happens behind `self.replication` at the points it is called
(`replication.Replication`; the multi-pipeline protocol is replicas/membership.py). A
pipeline alone (`replication.Alone`) does nothing at any of them.
"""

from __future__ import annotations

import logging
import time

import torch
from relaytrain_contract import StageConfig

from relaytrain_worker.model.lora_merge import Fold
from relaytrain_worker.model.methods import TIED_NAME
from relaytrain_worker.model.training import make_optimizer, optimizer_step
from relaytrain_worker.pipeline.evaluation import due, evaluate
from relaytrain_worker.pipeline.linkauth import AuthError, LinkBroken
from relaytrain_worker.pipeline.loading import Loaded, job_prefix, opener
from relaytrain_worker.pipeline.peers import Peers, link_chain
from relaytrain_worker.pipeline.replication import Replication
from relaytrain_worker.pipeline.rollback import (
    load_by_name,
    load_files,
    reset_weights,
    rng_seed,
    stage_files,
)
from relaytrain_worker.pipeline.schedule import StepRunner
from relaytrain_worker.pipeline.transport import Frame, Listener, listen
from relaytrain_worker.state import checkpoint as ckpt
from relaytrain_worker.state.data import DataReport, MicroBatch, read_report, write_report
from relaytrain_worker.state.export import export_output
from relaytrain_worker.state.fence import check_writer
from relaytrain_worker.state.history import LossHistory
from relaytrain_worker.state.metrics import MetricsServer, StageMetrics, serve
from relaytrain_worker.state.progress import Progress, write_progress
from relaytrain_worker.state.store import Store

log = logging.getLogger("relaytrain.stage")

CONNECT_FOR = 600.0
"""How long a stage keeps trying to reach its next stage (a replacement pod takes time)."""


class StageRuntime:
    """One stage process, from what `loading.load_stage` read. Building it does no I/O:
    `open_endpoints` (called by `run`) binds its ports."""

    def __init__(self, cfg: StageConfig, loaded: Loaded, replication: Replication) -> None:
        self.cfg = cfg
        self.k = cfg.stage.index
        self.count = cfg.stage.count
        self.replication = replication
        """How this stage takes part in a job of several pipelines (`replication.Alone`: it
        trains alone)."""
        self.pipeline = replication.pipeline
        """This stage's pipeline (0 when the job has one)."""
        self.name = replication.name
        """How logs name this stage: `1`, or `p1/s0` with several pipelines."""
        self.tls = loaded.tls
        self.prefix = job_prefix(cfg)
        self.store = loaded.store
        self.model_dir = loaded.model_dir
        self.stage = loaded.stage
        self.trainable = loaded.trainable
        self.fold = Fold(self.stage.model)
        """What the exact LoRA merge folded into the frozen weights (periodic sync)."""
        self.data = loaded.data
        self._report_due = cfg.stage.is_first and self.data is not None
        """Stage 0 writes its example counts once, after its links are up (a stage that
        never links, e.g. one holding another job's certificate, writes nothing); the last
        stage reports them in progress.json (`_publish`). Every pipeline's stage 0 writes
        the same counts (the same data), so a pipeline given up before it linked leaves
        them written."""
        self.eval_batches = loaded.eval_batches
        """The held-out micro-batches (every stage 0: the writer's pipeline evaluates;
        evaluation.py)."""
        self.data_report: DataReport | None = None
        """Stage 0's example counts, as the last stage read them for progress.json."""
        self.training = loaded.training
        self.total_steps = loaded.total_steps
        self.optimizer, self.scheduler = make_optimizer(self.trainable, self.training)
        self.metrics = StageMetrics(cfg.job.name, self.k, replication.metrics_pipeline)
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

    # -- setup -----------------------------------------------------------------------

    def open_endpoints(self) -> None:
        """Serve /metrics and /healthz and listen for the previous stage (once)."""
        cfg = self.cfg
        if self.server is None:
            self.server = serve(self.metrics, cfg.observability.port)
        if self.listener is None and cfg.links.listen is not None:
            assert cfg.links.prev_identity is not None  # the config checks both are set
            self.listener = listen(
                cfg.links.listen, credentials=self.tls, expect=cfg.links.prev_identity
            )
        self.replication.open()

    def _open(self, uri: str) -> Store:
        return opener(self.cfg)(uri)

    # -- checkpoint state ------------------------------------------------------------

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
        load_files(files, self.trainable, self.optimizer, self.scheduler, self.fold)
        self.last_committed = step
        log.info("Stage %s restored committed step %d", self.name, step)
        return step

    def _restore_by_name(self, step: int, source: int, stages: int) -> int:
        """Restore committed `step`, which pipeline `source` wrote in `stages` stages, from
        the stages that hold this stage's layers, by parameter name (the splits may differ):
        the peers in `source`, or every stage of it when they are not known. The RNG, which
        was another stage's, is seeded from (seed, step, pipeline, stage)."""
        holders = self.replication.holders(source)
        parts = [
            ckpt.load_stage(self.store, self.prefix, step, j) for j in holders or range(stages)
        ]
        load_by_name(parts, self.trainable, self.optimizer, self.scheduler, step=step,
                     source=source, fold=self.fold)  # fmt: skip
        self.seed(step)
        self.last_committed = step
        log.info("Stage %s restored committed step %d by name", self.name, step)
        return step

    def seed(self, step: int) -> None:
        """This stage's RNG (dropout) from the seed, its place and `step`: pipeline 0's stages
        start as a lone pipeline's do; the others differ (their micro-batches differ)."""
        torch.manual_seed(rng_seed(self.cfg, self.pipeline, step))

    def _done(self, restored: int) -> int:
        """Exit 0 with the final commit restored (see `_nothing_left`)."""
        log.info("Stage %s restored the job's final commit: nothing left to train", self.name)
        if self.cfg.stage.is_last and ckpt.committed_by(self.store, self.prefix, restored)[0] == self.pipeline:  # fmt: skip  # noqa: E501
            self._finish()
        self.metrics.set_health("done", step=self.step)
        return 0

    def _nothing_left(self, restored: int | None) -> bool:
        """Whether this (re)started or recovering stage restored the job's final commit with
        every file intact: nothing is left, it waits for no peer (they may have exited: one
        killed before the output, or cut off while they finished, waited forever)."""
        return (
            restored == self.total_steps
            and ckpt.latest_committed(self.store, self.prefix, verify_files=True, at_most=restored)
            == restored
        )

    def restore_newest(self) -> int | None:
        """Restore the newest committed step whose files of this stage verify; returns it.

        A commit with a corrupt or missing file of this stage is skipped (and logged) for
        the one before it; the handshake then makes every stage agree on a step whose
        files all verify (see `handshake`).
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
        reset_weights(self.cfg, self.model_dir, self.stage, self.fold)
        self.optimizer, self.scheduler = make_optimizer(self.trainable, self.training)
        self.seed(0)

    # -- links -----------------------------------------------------------------------

    def _connect(self) -> Peers:
        return link_chain(self.cfg, self.tls, self.listener, CONNECT_FOR)

    def handshake(self, peers: Peers, mine: int | None) -> int | None:
        """Agree on the resume step: the newest committed step any stage saw."""
        agreed = mine
        if peers.prev is not None:
            seen = peers.prev.recv("hello", -1).meta["resume"]
            agreed = max((x for x in (agreed, seen) if x is not None), default=None)
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
        self.replication.start(self)
        restored = self.restore_newest()
        self.step = restored or 0
        if restored is not None and self._nothing_left(restored):
            return self._done(restored)
        attempt = 0
        # A stage that restored the final step of a commit with a bad file joins one
        # handshake: every stage redoes the end from the newest intact commit.
        while True:
            peers: Peers | None = None
            try:
                self.metrics.set_health("ready", step=self.step)
                peers = self.replication.link(self._connect)
                restored = self.replication.resume(self, peers, restored)
                self.metrics.set_health("training", step=self.step)
                if self._report_due and self.data is not None:
                    write_report(self.store, self.prefix, self.data.report)
                    self._report_due = False
                self._train(peers)
                peers.flush()
                self.replication.flush()
                break
            except (LinkBroken, TimeoutError) as exc:
                # Failures in a row back off longer; one after training went on is a new one.
                attempt = attempt + 1 if self.step <= (restored or 0) else 1
                self.metrics.set_health("recovering", reason=str(exc))
                log.warning("Stage %s lost a link at step %d: %s", self.name, self.step, exc)
                self._close(peers)
                time.sleep(min(2.0 * attempt, 10.0))
                restored = self.restore_newest()
                self.step = restored or 0
                if restored is not None and self._nothing_left(restored):  # finished meanwhile
                    return self._done(restored)
            except AuthError:
                self._close(peers)
                raise
        if self.cfg.stage.is_last and self.replication.writes:
            self._finish()
        self._close(peers)
        self.metrics.set_health("done", step=self.step)
        return 0

    def take_resume(self, agreed: int | None, restored: int | None) -> int | None:
        """Go on from committed step `agreed` (None: the start), the step the job agreed on,
        having restored `restored`; returns the step this stage now holds."""
        if agreed != restored:
            restored = agreed
            self.step = self.restore(agreed)
        if self.cfg.stage.is_last:
            self.history.resume(restored)
        return restored

    def _train(self, peers: Peers) -> None:
        t = self.training
        runner = StepRunner(
            self.stage,
            index=self.k,
            count=self.count,
            peers=peers,
            trainable=self.trainable,
            compression=self.cfg.pipeline.compression,
            ahead=self.cfg.pipeline.forwards_ahead,
            gradient_tokens=self.cfg.pipeline.gradient_tokens,
            gradient_fill=self.cfg.pipeline.gradient_fill == "activations",
            seed=t.seed,
            max_grad_norm=t.max_grad_norm,
            tied_name=self._tied_name(),
            ordered_terms=self.cfg.method.type != "full",
            **self.replication.runner_options(),
        )
        self.replication.begin_training(self, runner)
        # tokens/s: non-padding input tokens per second of wall time, measured from one
        # step's end to the next, so optimizer steps and checkpoint saves count too. With
        # replicas the last stage counts every pipeline's tokens (the whole job's rate).
        if self.step == 0 and self.replication.writes and due(self.cfg, 0, self.total_steps):
            self._evaluate(peers)  # the base model's held-out loss
        mark = time.monotonic()
        while self.step < self.total_steps:
            result = self.replication.train_step(self, peers, runner)
            optimizer_step(self.optimizer, self.scheduler)
            self.step += 1
            self.replication.after_step(self.step, result)
            now = time.monotonic()
            seconds = max(now - mark, 1e-9)
            rate = result.step_input_tokens / seconds
            mark = now
            self._report(peers, result.loss, rate, seconds)
            if self.replication.writes and due(self.cfg, self.step, self.total_steps):
                self._evaluate(peers)  # before the commit, whose history carries it
            if self.saves(self.step):
                self._checkpoint(peers, self.step)

    def micros(self, mine: range) -> tuple[list[MicroBatch], list[MicroBatch]] | None:
        """Stage 0: the whole step's micro-batches and those of them this pipeline trains
        (`mine`); None on the other stages (their micro-batches arrive as activations)."""
        if not self.cfg.stage.is_first:
            return None
        assert self.data is not None
        every = self.data.step(self.step)
        return every, [every[i] for i in mine]

    def saves(self, step: int) -> bool:
        """Whether the boundary after `step` steps is a checkpoint."""
        return step % self.cfg.checkpoint.every_steps == 0 or step == self.total_steps

    def _tied_name(self) -> str | None:
        tied = bool(getattr(self.stage.config, "tie_word_embeddings", False))
        return TIED_NAME if self.cfg.method.type == "full" and tied else None

    def _report(self, peers: Peers, loss: float | None, rate: float, seconds: float) -> None:
        self.metrics.step.set(self.step)
        self.metrics.tokens_per_second.set(rate)
        for name, link in (("prev", peers.prev), ("next", peers.next)):
            if link is not None:
                self.metrics.update_link(name, link.link)  # type: ignore[arg-type]
        for name, counters in self.replication.links().items():  # e.g. `replica:p1/s0`
            self.metrics.update_link(name, counters)
        if loss is None:
            return
        log.debug("Step %d loss %r", self.step, loss)  # every bit: re-splits are compared
        self.metrics.loss.set(loss)
        self.history.append(self.step, loss, rate)  # every last stage: a writer-to-be
        self.step_seconds = seconds
        if self.replication.writes:
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
        t = self.cfg.training
        seen = (
            report.seen(self.step, t.micro_batch_size * t.micro_batches, t.seed) if report else None
        )
        if seen is not None:
            self.metrics.set_seen(seen.epoch, seen.examples, seen.tokens, seen.trained)
        held = self.history.last_eval
        progress = Progress(
            step=self.step,
            total_steps=self.total_steps,
            loss=last["loss"],
            tokens_per_second=float(last["tokensPerSecond"] or 0.0),
            last_committed_step=self.last_committed,
            step_seconds=self.step_seconds,
            done=done,
            output=self.cfg.output.uri if done else None,
            examples=report.examples if report else None,
            examples_truncated=report.truncated if report else None,
            examples_dropped=report.dropped if report else None,
            epoch=seen.epoch if seen else None,
            examples_seen=seen.examples if seen else None,
            tokens_seen=seen.tokens if seen else None,
            tokens_trained=seen.trained if seen else None,
            eval_loss=held["evalLoss"] if held else None,
            eval_step=held["step"] if held else None,
        )
        write_progress(
            self.store, self.prefix, progress, unless_behind=self.replication.unsure_writer
        )

    def _checkpoint(self, peers: Peers, step: int) -> None:
        if not self.replication.writes_checkpoint(self, step):
            return
        started = time.monotonic()
        check_writer(self.store, self.prefix, self.cfg, step)  # a replaced plan writes not
        files = stage_files(
            self.cfg, step, self.trainable, self.optimizer, self.scheduler, fold=self.fold
        )
        try:
            ckpt.save_stage(self.store, self.prefix, step, self.k, files, pipeline=self.pipeline)
        except ckpt.CheckpointError as exc:
            self.replication.save_failed(step, exc)
            raise
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
        self.replication.close()

    def _close(self, peers: Peers | None) -> None:
        """Close every link of this stage: the break reaches its neighbours (in every
        pipeline)."""
        if peers is not None:
            peers.close()
        self.replication.close_links()
