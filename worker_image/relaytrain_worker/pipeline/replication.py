"""How a stage takes part in a job of several pipelines: the hooks `stage.StageRuntime` calls.

A stage's life is the same whether its pipeline trains alone or as one of several; what
several pipelines add (links to the other pipelines, agreeing on who trains each step, one
writer for all, rejoining with a live peer's state, periodic synchronisation) happens
behind this protocol, at the points the stage calls it. `Alone`, one pipeline, does nothing
at any of them; `replicas.membership.Replicated` is the multi-pipeline protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypedDict

from relaytrain_contract import StageConfig

from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.schedule import StepResult, StepRunner
from relaytrain_worker.pipeline.stats import ReplicaGroup
from relaytrain_worker.state.metrics import LinkCounters

if TYPE_CHECKING:
    from relaytrain_worker.pipeline.stage import StageRuntime


class DepartedError(Exception):
    """The stage left the job at a step boundary, as asked (SIGTERM: its node is being
    drained, reclaimed or scaled down); the other pipelines train on without a step lost."""


class RunnerOptions(TypedDict, total=False):
    """What the step runner (`schedule.StepRunner`) is given beyond its own pipeline."""

    group: ReplicaGroup | None
    pipeline: int
    periodic: bool


class Replication(Protocol):
    """The points where a stage meets the other pipelines of its job, in the order it
    reaches them."""

    pipeline: int
    """This stage's pipeline (0 when it trains alone)."""
    name: str
    """How logs name this stage (`1` alone, `p1/s0` as one of several pipelines)."""
    metrics_pipeline: int | None
    """The pipeline label of this stage's metrics (None alone)."""

    @property
    def writes(self) -> bool:
        """Whether this stage's pipeline writes for the job now: checkpoints, commits,
        progress.json, the loss history, held-out evaluation and the output."""
        ...

    @property
    def unsure_writer(self) -> bool:
        """Whether another pipeline may be writing too (several pipelines: two cut apart
        each take themselves for the writer), so progress.json is read before it is
        written and never moves back."""
        ...

    def open(self) -> None:
        """Bind what must listen from the start (with the stage's own listener)."""

    def start(self, stage: StageRuntime) -> None:
        """The stage process starts (before it restores anything)."""

    def holders(self, source: int) -> list[int]:
        """The stages of pipeline `source` whose files hold this stage's layers when that
        pipeline wrote a commit; empty: read every stage of the commit."""
        ...

    def link(self, connect: Callable[[], Peers]) -> Peers:
        """Link this stage: its pipeline links (`connect`) and whatever else it needs."""
        ...

    def resume(self, stage: StageRuntime, peers: Peers, restored: int | None) -> int | None:
        """Agree with the rest of the job on where training goes on, restore it, and
        return the committed step the stage now holds."""
        ...

    def runner_options(self) -> RunnerOptions:
        """The step runner's exchange with the other pipelines."""
        ...

    def begin_training(self, stage: StageRuntime, runner: StepRunner) -> None:
        """The step loop starts with `runner`."""

    def train_step(self, stage: StageRuntime, peers: Peers, runner: StepRunner) -> StepResult:
        """Forward and backward of this pipeline's share of step `stage.step` with `runner`
        (stage 0 reads the step's micro-batches: `stage.micros`); the optimizer step is the
        stage's."""
        ...

    def after_step(self, step: int, result: StepResult) -> None:
        """The optimizer step that completed `step` steps is done."""

    def links(self) -> Mapping[str, LinkCounters]:
        """Links to report in the stage's metrics besides its pipeline links, by name."""
        ...

    def writes_checkpoint(self, stage: StageRuntime, step: int) -> bool:
        """At checkpoint step `step`: whether this stage saves it (its pipeline writes)."""
        ...

    def save_failed(self, step: int, exc: Exception) -> None:
        """Saving `step` failed with `exc` (the stage raises it when this returns)."""

    def flush(self) -> None:
        """The stage trained to the end: hand every queued frame to the socket."""

    def close_links(self) -> None:
        """Close the links `link` made besides the pipeline links (the stage closes those)."""

    def close(self) -> None:
        """The process ends: release what `open` bound."""

    def depart(self) -> bool:
        """SIGTERM: True when the stage leaves at its next step boundary (raising
        `DepartedError` there) rather than stopping at once."""
        ...


class Alone:
    """A pipeline that trains alone: nothing to agree on with anyone else."""

    pipeline: int = 0
    metrics_pipeline: int | None = None

    def __init__(self, cfg: StageConfig) -> None:
        self.name = str(cfg.stage.index)
        self.micros = range(cfg.training.micro_batches)
        """Every micro-batch of a step."""

    @property
    def writes(self) -> bool:
        return True

    @property
    def unsure_writer(self) -> bool:
        return False

    def open(self) -> None:
        pass

    def start(self, stage: StageRuntime) -> None:
        pass

    def holders(self, source: int) -> list[int]:
        return []

    def link(self, connect: Callable[[], Peers]) -> Peers:
        return connect()

    def resume(self, stage: StageRuntime, peers: Peers, restored: int | None) -> int | None:
        return stage.take_resume(stage.handshake(peers, restored), restored)

    def runner_options(self) -> RunnerOptions:
        return {}

    def begin_training(self, stage: StageRuntime, runner: StepRunner) -> None:
        pass

    def train_step(self, stage: StageRuntime, peers: Peers, runner: StepRunner) -> StepResult:
        micros = stage.micros(self.micros)
        return runner.run(stage.step, micros[1] if micros else None, len(self.micros))

    def after_step(self, step: int, result: StepResult) -> None:
        pass

    def links(self) -> Mapping[str, LinkCounters]:
        return {}

    def writes_checkpoint(self, stage: StageRuntime, step: int) -> bool:
        return True

    def save_failed(self, step: int, exc: Exception) -> None:
        pass

    def flush(self) -> None:
        pass

    def close_links(self) -> None:
        pass

    def close(self) -> None:
        pass

    def depart(self) -> bool:
        return False  # nobody to hand the job to: the last commit is its state
