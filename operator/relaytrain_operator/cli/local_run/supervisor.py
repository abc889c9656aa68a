"""The supervisor of a local run: `LocalRun` starts the stage processes, watches them,
restarts one that dies by the operator's own rule (`recovery.after_failure` and
`recovery.backoff_left`) and stops them all on SIGINT or SIGTERM.

Each stage runs in its own process group, which `stop` signals whole (SIGTERM, then
SIGKILL after a grace period). A supervisor that cannot stop them (SIGKILL, a crash) takes
them along on Linux: each stage is started with PR_SET_PDEATHSIG (`die_with_supervisor`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from relaytrain_contract import FLEET_FILE, GIVEN_UP_FILE, Progress
from relaytrain_contract.exits import non_retryable

from relaytrain_operator.cli.local_run import report, storage
from relaytrain_operator.cli.local_run.forks import StageForks
from relaytrain_operator.cli.local_run.grow import add_pipeline, grow_one
from relaytrain_operator.cli.local_run.layout import Layout, local_layout
from relaytrain_operator.cli.local_run.stages import (
    Built,
    StageProc,
    build_stages,
    die_with_supervisor,
    end_stages,
    forks_stages,
    last_line,
    private_folder,
    signal_group,
    stage_env,
    stage_procs,
    write_link_folder,
)
from relaytrain_operator.domain.linkcerts import (
    advanced,
    link_state,
    mint_link_authority,
    renewal_step,
    renewed_files,
    stage_pem,
)
from relaytrain_operator.domain.recovery import after_failure, backoff_left
from relaytrain_operator.spec import FineTuneJob

POLL_SECONDS = 0.5
LOCAL_PROPAGATION = timedelta(seconds=5)
"""How far apart the phases of a link certificate renewal are in a local run: every
stage's folder changes at once, and a stage reads it before each link, so this only needs
to outlast a handshake."""
STOP_GRACE_SECONDS = 15.0


class LocalRun:
    """Starts, watches, restarts and stops the stage processes of one job.

    `prepare` reads what the run needs (the model's layer count, free ports) and mints the
    link credentials; `write_stage_files` writes the stage documents and each stage's
    credentials folder (after the caller holds the state directory's lock); `supervise` runs
    the stages and then removes the credentials (`remove_credentials`).
    """

    def __init__(
        self,
        job: FineTuneJob,
        workdir: Path,
        layout: Layout,
        built: Built,
    ) -> None:
        """`built`: the stages' documents, link credentials, endpoints and the run's CA."""
        self.job = job
        self.workdir = workdir.resolve()
        self.layout = layout
        self.documents = built.documents
        self.endpoints = built.endpoints
        self.env = stage_env(len(self.documents))
        self.stages = stage_procs(self.workdir, layout)
        self.forks = StageForks(
            forks_stages(os.environ, job.spec.method.type, self.stages), self.env, self.workdir,
            qlora=job.spec.method.type == "qlora",
        )  # fmt: skip
        """The prefork server the stages are forked from."""
        self._credentials = built.credentials
        self._ca = built.ca
        """The run's link CA (in memory only), which issues an added pipeline's certificates."""
        self._links = link_state(built.credentials, {})
        self.credentials_root: Path | None = None
        """The private folder holding every stage's credentials folder, while written."""
        ckpt = job.spec.checkpoint.uri
        self.job_dir = f"{ckpt.rstrip('/')}/{job.metadata.namespace}/{job.metadata.name}"
        self.output = self.documents[0]["output"]["uri"]
        self.stopping = False
        self.stop_signal: int | None = None
        self.out: set[int] = set()
        """Pipelines taken out of the run (SIGUSR1) and not brought back yet (SIGUSR2)."""
        self._asked: list[int] = []
        """SIGUSR1 and SIGUSR2 received and not acted on yet."""
        self.changes: list[dict[str, Any]] = []
        """Every pipeline that left, came back or was added: pipeline, change, the job's
        step then."""
        self.added: list[int] = []
        """The pipelines added while the run trains (SIGUSR2 with none out)."""

    @classmethod
    def prepare(
        cls,
        job: FineTuneJob,
        workdir: Path,
        stages: list[int] | None = None,
        *,
        replicas: int | None = None,
        shares: list[int] | None = None,
    ) -> LocalRun:
        """Split the model (`local_layout`), pick free loopback ports, build the stage
        documents and mint the link credentials (nothing is written)."""
        layout = local_layout(job, storage.model_layers(job), stages, replicas, shares)
        if stages is not None:
            # The command line chose the stage counts; the documents follow it.
            pipeline = job.spec.pipeline.model_copy(update={"stages": "auto"})
            spec = job.spec.model_copy(update={"pipeline": pipeline})
            job = job.model_copy(update={"spec": spec})
        return cls(job, workdir, layout, build_stages(job, layout))

    def write_stage_files(self) -> None:
        """Write each stage's link credentials into a private folder of its own
        (`private_folder`, outside the run's directory) and its document, which names that
        folder (`links.credentialsDir`) and never holds a key."""
        try:
            self.credentials_root = private_folder()
            for stage, doc in zip(self.stages, self.documents, strict=True):
                self._write_stage(stage, doc)
        except BaseException:
            self.remove_credentials()
            raise

    def _write_stage(self, stage: StageProc, doc: dict[str, Any]) -> None:
        assert self.credentials_root is not None
        stage.link_dir = self.credentials_root / stage.config_path.stem
        write_link_folder(stage.link_dir, stage_pem(self._credentials, stage.pipeline, stage.index))
        doc["links"]["credentialsDir"] = str(stage.link_dir)
        stage.config_path.parent.mkdir(parents=True, exist_ok=True)
        stage.config_path.write_text(json.dumps(doc, indent=2))

    def renew_links(self, now: datetime) -> str | None:
        """Take the step of a link certificate renewal that is due at `now` (the operator's
        phases, `linkcerts`, `LOCAL_PROPAGATION` apart: every stage's folder is rewritten at
        once), and say so when a renewal ends; None when nothing was due."""
        policy = self.job.spec.link_certificates
        renew_at = policy.renew_at_percent / 100
        lifetime = timedelta(seconds=policy.lifetime_seconds)
        step = renewal_step(self._links, now, renew_at, LOCAL_PROPAGATION)
        if step is None:
            return None
        minted = None
        if step in ("trust", "reissue"):
            meta, counts = self.job.metadata, [len(split) for split in self.layout.splits]
            minted, self._ca = mint_link_authority(
                meta.namespace, meta.name, counts, now=now, lifetime=lifetime,
                generation=self._links.generation + 1,
            )  # fmt: skip
        self._links = advanced(self._links, step, now, lifetime, self._credentials)
        self._credentials = renewed_files(step, self._credentials, minted)
        for stage in self.stages:
            if stage.link_dir is not None:
                write_link_folder(
                    stage.link_dir, stage_pem(self._credentials, stage.pipeline, stage.index)
                )
        if self._links.phase != "Current":
            return None
        until = self._links.not_after.strftime("%Y-%m-%d %H:%M:%S")
        generation = self._links.generation
        return f"link certificates renewed (generation {generation}), valid until {until} UTC"

    def remove_credentials(self) -> None:
        """Remove every stage's credentials folder (the private keys on this machine); a
        stage started after this could not link. Nothing to do when none is written."""
        root, self.credentials_root = self.credentials_root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        for stage in self.stages:
            stage.link_dir = None

    def start(self, stage: StageProc) -> None:
        """Start (or restart) `stage` as the leader of a process group of its own, which
        `stop` signals whole. Nothing starts once a stop has begun."""
        if self.stopping or self.stop_signal is not None:
            return
        argv = ["-m", "relaytrain_worker", "--config", str(stage.config_path)]
        with stage.log_path.open("ab") as log:
            forked = self.forks.spawn(argv, log.fileno(), stage.env(self.env))
            stage.proc = forked or subprocess.Popen(
                [sys.executable, *argv],
                env=stage.env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own group: a Ctrl-C in the terminal reaches only us, and stop() can
                # signal the stage and anything it started at once.
                start_new_session=True,
                # And it dies with us however we die (SIGKILL included), on Linux. The
                # function only calls prctl, getppid and at most kill, so the one other
                # thread we may run (tqdm's monitor) holds no lock it could wait for.
                preexec_fn=die_with_supervisor(os.getpid()),  # noqa: PLW1509
            )
        stage.pids.append(stage.proc.pid)
        stage.failed_at = None
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "stages": [
                {
                    "index": s.index,
                    "pipeline": s.pipeline,
                    "pid": s.proc.pid if s.proc else None,
                    "pids": s.pids,
                    "restarts": s.restarts,
                    "layers": list(self.layout.splits[s.pipeline][s.index]),
                }
                for s in self.stages
            ],
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))

    def read_json(self, name: str) -> Any:
        """`name` in the job's checkpoint directory, parsed (None: none yet, or unreadable
        this poll: the next one tries again)."""
        return storage.read_json(self.job, self.job_dir, name)

    def read_progress(self) -> Progress | None:
        """The job's progress.json (None: none yet, or unreadable this poll)."""
        return storage.read_progress(self.job, self.job_dir)

    def stop(self) -> None:
        """Stop every stage: SIGTERM to each stage's process group, SIGKILL to what is left
        after a grace period. No stage is (re)started afterwards."""
        self.stopping = True
        # Only stages not yet reaped: until it is waited for, a stage's PID (its group's
        # ID) cannot be reused by another process, so the signal cannot go astray.
        end_stages(
            [s.proc for s in self.stages if s.proc is not None and s.proc.returncode is None],
            STOP_GRACE_SECONDS,
        )

    def _change_membership(self, signum: int, progress: Progress | None) -> None:
        """SIGUSR1: the highest pipeline training leaves — SIGTERM to its stages, which leave
        at their next step boundary (docs/worker.md), and the store names it out, as the
        operator does for a pipeline whose node announced its end; the last one stays.
        SIGUSR2: the lowest pipeline out whose stages have all ended comes back — started
        afresh, its stages rejoin the others at a step boundary with their state; with none
        out, a pipeline is added (`_add_pipeline`)."""
        step = progress.step if progress is not None else 0
        pipelines = sorted({s.pipeline for s in self.stages})
        if signum == signal.SIGUSR1:
            training = [p for p in pipelines if p not in self.out]
            if len(training) < 2:  # one must stay to hold the job's state
                print("SIGUSR1: the last pipeline training stays (Ctrl-C stops the run)",
                      file=sys.stderr)  # fmt: skip
                return
            p = training[-1]
            self.out.add(p)
            self._tell_out()
            for stage in self.stages:
                if stage.pipeline == p and stage.proc is not None and stage.proc.poll() is None:
                    signal_group(stage.proc.pid, signal.SIGTERM)
            print(f"pipeline {p} leaves at its next step boundary (SIGUSR1; SIGUSR2 brings "
                  f"it back)", file=sys.stderr)  # fmt: skip
            self.changes.append({"pipeline": p, "change": "left", "step": step})
            return
        if not self.out:
            self._add_pipeline(step)
            return
        ended = [p for p in sorted(self.out)
                 if all(s.proc is None or s.proc.poll() is not None
                        for s in self.stages if s.pipeline == p)]  # fmt: skip
        if not ended:
            print("SIGUSR2: the pipelines out are still leaving", file=sys.stderr)
            return
        p = ended[0]
        self.out.discard(p)
        self._tell_out()
        for stage in self.stages:
            if stage.pipeline == p:
                self.start(stage)
        print(f"pipeline {p} comes back: its stages rejoin at a step boundary (SIGUSR2)",
              file=sys.stderr)  # fmt: skip
        self.changes.append({"pipeline": p, "change": "returned", "step": step})

    def _add_pipeline(self, step: int) -> None:
        """One more pipeline (`grow.add_pipeline`): names.FLEET_FILE first, so that the
        stages training link to it, then its stages start and join at a step boundary."""
        if self.stop_signal is not None:
            return
        if self._links.phase != "Current":
            print("SIGUSR2: no pipeline is added while the link certificates are renewed; "
                  "send it again in a few seconds", file=sys.stderr)  # fmt: skip
            return
        if len(self.layout.splits) < 2:
            self._grow_one(step)
            return
        try:
            added = add_pipeline(self.job, self.layout, self.endpoints, self._ca, self.added)
            self._tell_added(added.fleet)
        except (ValueError, OSError) as err:
            print(f"SIGUSR2: no pipeline is added: {err}", file=sys.stderr)
            return
        q = added.pipeline
        self.layout = added.layout
        self.endpoints.append(added.endpoints)
        self._credentials.update(added.credentials)
        self.added.append(q)
        stages = stage_procs(self.workdir, added.layout)[len(self.stages) :]
        for stage, doc in zip(stages, added.documents, strict=True):
            self._write_stage(stage, doc)
            self.stages.append(stage)
            self.documents.append(doc)
            self.start(stage)
        layers = ", ".join(f"{s}-{e - 1}" for s, e in added.layout.splits[q])
        print(f"pipeline {q} is added (stages of layers {layers}; shares now "
              f"{'+'.join(map(str, added.layout.shares))}): it joins at a step boundary "
              f"(SIGUSR2)", file=sys.stderr)  # fmt: skip
        self.changes.append({"pipeline": q, "change": "added", "step": step})

    def _grow_one(self, step: int) -> None:
        """A run of one pipeline grown to two (`grow.grow_one`): its stages stop and start
        again as pipeline 0's beside pipeline 1's, every stage restoring the last commit
        (no failure counted)."""
        try:
            grown = grow_one(self.job, self.layout, self.endpoints, self._ca)
            self._tell_out()
            self._tell_added(grown.fleet)
        except (ValueError, OSError) as err:
            print(f"SIGUSR2: no pipeline is added: {err}", file=sys.stderr)
            return
        before = self.stages
        end_stages(
            [s.proc for s in before if s.proc is not None and s.proc.returncode is None],
            STOP_GRACE_SECONDS,
        )
        self.layout, self.endpoints, self.documents = grown.layout, grown.endpoints, []
        self._credentials.update(grown.credentials)
        self.added.append(1)
        self.stages = stage_procs(self.workdir, grown.layout)
        for stage, was in zip(self.stages, before, strict=False):  # pipeline 0's come first
            stage.restarts = was.restarts
        for stage, doc in zip(self.stages, grown.documents, strict=True):
            self._write_stage(stage, doc)
            self.documents.append(doc)
            self.start(stage)
        print(f"pipeline 1 is added (shares now {'+'.join(map(str, grown.layout.shares))}): "
              f"every stage starts again from the last commit, the run's one pipeline as "
              f"pipeline 0 (SIGUSR2)", file=sys.stderr)  # fmt: skip
        self.changes.append({"pipeline": 1, "change": "added", "step": step})

    def _tell_added(self, fleet: dict[str, Any] | None = None) -> None:
        """The pipelines added (names.FLEET_FILE; none unless `fleet`), in the job's store:
        the stages training link to their stages."""
        storage.write_json(self.job, self.job_dir, FLEET_FILE, fleet or {"added": []})

    def _tell_out(self) -> None:
        """The pipelines out, in the job's store (names.GIVEN_UP_FILE): a stage linking
        again waits for none of them."""
        try:
            storage.write_json(self.job, self.job_dir, GIVEN_UP_FILE,
                               {"pipelines": sorted(self.out)})  # fmt: skip
        except OSError as err:  # the stages then wait for it as for a restarting one
            print(f"could not write {GIVEN_UP_FILE}: {err}", file=sys.stderr)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only a flag: raising here could land between a Popen and its bookkeeping and lose
        # track of a process. The loop notices within one poll.
        self.stop_signal = signum

    def _on_membership(self, signum: int, _frame: FrameType | None) -> None:
        self._asked.append(signum)  # acted on by the loop, as a stop is

    def supervise(self, show_progress: bool) -> int:
        """Run until every stage exits 0 (0), a stage fails more often than the failure
        policy allows (1), or SIGINT/SIGTERM stops the run (130/143). Every stage process is
        gone when this returns, and so are their link credentials (`remove_credentials`).
        With several pipelines, SIGUSR1 takes one out and SIGUSR2 brings it back
        (`_change_membership`)."""
        handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            handlers[sig] = signal.signal(sig, self._on_membership)
        bar = report.progress_bar(show_progress)
        try:
            return self._supervise(bar)
        finally:
            self.stop()  # after a success nothing is left; after anything else, no orphans
            self.forks.stop()
            self.remove_credentials()  # no stage is left to read them
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if bar is not None:
                bar.close()

    def _supervise(self, bar: Any) -> int:
        policy = self.job.spec.failure_policy
        backoff = timedelta(seconds=policy.backoff_seconds)
        # progress.json of an earlier run of the same job may say done; only this run's counts.
        started = datetime.now(UTC).replace(microsecond=0)
        if len(self.layout.splits) > 1:
            self._tell_out()  # an earlier run's pipelines out or added are not this one's
            try:
                self._tell_added()
            except OSError as err:  # none was added yet: a stage reading none is right
                print(f"could not write {FLEET_FILE}: {err}", file=sys.stderr)
        for stage in self.stages:
            self.start(stage)
        while self.stop_signal is None:
            time.sleep(POLL_SECONDS)
            if self.stop_signal is not None:
                break
            progress = self.read_progress()
            if bar is not None and progress is not None:
                report.show_progress(bar, progress)
            finished = 0
            now = datetime.now(UTC)
            renewed = self.renew_links(now)
            if renewed is not None:
                print(renewed, file=sys.stderr)
            while self._asked:
                self._change_membership(self._asked.pop(0), progress)
            for stage in self.stages:
                assert stage.proc is not None
                code = stage.proc.poll()
                if code is None or stage.pipeline in self.out:
                    continue  # a stage of a pipeline taken out is neither counted nor started
                done_at = progress.updated_at if progress is not None and progress.done else None
                if code == 0 or (done_at is not None and done_at >= started):
                    # A stage that dies after the job finished (its output written) is
                    # not restarted: its peers are gone and nothing is left to do.
                    finished += 1
                    continue
                reason = non_retryable(code)
                if reason is not None:  # the stage's own word: a restart would say it again
                    print(
                        f"{stage.name} stopped ({reason}, exit {code}), not to be restarted: "
                        f"{last_line(stage.log_path)}",
                        file=sys.stderr,
                    )
                    return 1
                if stage.failed_at is None:
                    counted = after_failure(stage.restarts, policy.max_stage_restarts)
                    if counted is None:
                        print(
                            f"{stage.name} failed (exit {code}) after {stage.restarts} "
                            f"restarts: {last_line(stage.log_path)} (log: {stage.log_path})",
                            file=sys.stderr,
                        )
                        return 1
                    stage.restarts = counted
                    stage.failed_at = now
                    print(
                        f"{stage.name} exited with {code}; restarting it "
                        f"({stage.restarts}/{policy.max_stage_restarts})",
                        file=sys.stderr,
                    )
                    self._write_state()
                if not backoff_left(stage.restarts, stage.failed_at, now, backoff):
                    self.start(stage)
            if finished == len([s for s in self.stages if s.pipeline not in self.out]):
                return 0
        print("\nstopping every stage…", file=sys.stderr)
        return 128 + self.stop_signal
