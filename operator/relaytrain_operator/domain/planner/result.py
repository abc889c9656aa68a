"""What the planner returns: the stages, their predicted cost, and the bottleneck."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from relaytrain_operator.domain.planner.steptime import StepShape, planned_step_seconds

Resource = Literal["compute", "memory", "link"]


class PlanError(ValueError):
    """The job cannot be planned on these pools; the message says why and what would help."""

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        self.reason = message
        self.suggestions = list(suggestions or [])
        text = message
        if self.suggestions:
            text += " It would fit with: " + "; or ".join(self.suggestions) + "."
        super().__init__(text)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: where it runs, which layers, and its predicted cost."""

    index: int
    """Stage number, 0 first."""
    pool: str
    """Pool whose GPU runs the stage."""
    gpu_product: str
    """GPU product label of that pool."""
    layer_start: int
    """First decoder layer (global index, inclusive)."""
    layer_end: int
    """One past the last decoder layer (exclusive)."""
    compute_seconds: float
    """Forward + backward compute per micro-batch (layers, and the head on the last stage)."""
    link_seconds: float
    """Time to send this stage's boundary tensors per micro-batch, one after the other,
    latencies included: what it would pay if nothing overlapped."""
    side_seconds: float
    """The busiest of what runs beside its compute per micro-batch: its sends' link
    directions, each a frame's bytes over its rate, and its encoder
    (`link_cost.LinkCost.side_seconds`)."""
    memory_bytes: int
    """Predicted peak memory."""
    memory_available_bytes: int
    """Memory the plan may use on that GPU (after margin and reserve)."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once under 1F1B."""
    encode_seconds: float = 0.0
    """Of what runs beside its compute, its encoder's time per micro-batch (``delta``'s codes,
    with a share of each fitted basis: `link_cost.LinkCost.encode_seconds`)."""

    @property
    def seconds(self) -> float:
        """Predicted busy time per micro-batch: compute plus sends, in turn."""
        return self.compute_seconds + self.link_seconds

    @property
    def beat_seconds(self) -> float:
        """Predicted time per micro-batch once the pipeline is full: its compute or, where
        busier, a send's link direction or its encoder (the worker overlaps them)."""
        return max(self.compute_seconds, self.side_seconds)

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class Bottleneck:
    """The stage that sets the pace, and what makes it slow."""

    stage: int
    """Index of the slowest stage."""
    resource: Resource
    """``compute`` or ``link`` (what dominates its time), or ``memory`` when memory limits
    elsewhere forced extra layers onto it (without them the plan would be faster)."""
    detail: str
    """One sentence for people."""


@dataclass(frozen=True)
class Plan:
    """An ordered pipeline with predicted throughput."""

    stages: tuple[StagePlan, ...]
    micro_batches: int
    """Micro-batches per optimizer step (M)."""
    tokens_per_micro_batch: int
    bottleneck: Bottleneck
    search: Literal["exhaustive", "heuristic", "fixed"]
    """How the sequence of pools was chosen."""
    sequences_evaluated: int
    notes: tuple[str, ...] = field(default=())
    """Things the user should know (pools left out, and why)."""
    timeline: StepShape | None = None
    """The step as `steptime` plays it, event by event over the plan's own links, with the
    job's forwards ahead (None: not priced so; `step_seconds` is then 1F1B's M + P - 1
    beats). What ``step_seconds`` is, and what ``pipeline.forwardsAhead: auto`` chooses by
    (`choose.choose_forwards_ahead`)."""
    most_ahead: int = 0
    """The most forwards ahead whose activations every stage holds (its memory)."""

    def step_seconds_ahead(self, ahead: int) -> float:
        """The step's seconds with ``ahead`` forwards ahead, played out (`timeline`)."""
        if self.timeline is None:
            raise ValueError("this plan has no timeline to play")
        return planned_step_seconds(replace(self.timeline, ahead=ahead))

    @property
    def fits(self) -> bool:
        """Whether every stage fits its GPU's memory (always true for planned results)."""
        return all(s.memory_bytes <= s.memory_available_bytes for s in self.stages)

    @property
    def micro_batch_seconds(self) -> float:
        """The slowest stage's beat: the pipeline's, once full."""
        return max(s.beat_seconds for s in self.stages)

    @property
    def step_seconds(self) -> float:
        """Predicted optimizer step: 1F1B played out over the plan's links (`timeline`),
        fill, drain and round trips counted."""
        if self.timeline is None:
            return (self.micro_batches + len(self.stages) - 1) * self.micro_batch_seconds
        return planned_step_seconds(self.timeline)

    @property
    def tokens_per_second(self) -> float:
        return self.micro_batches * self.tokens_per_micro_batch / self.step_seconds

    @property
    def bubble_fraction(self) -> float:
        """Share of the step a stage idles in fill and drain: (P - 1) / (M + P - 1)."""
        p = len(self.stages)
        return (p - 1) / (self.micro_batches + p - 1)

    def to_status(self) -> dict[str, Any]:
        """The plan as the FineTuneJob's ``status.plan`` (camelCase; see docs/planner.md).

        Exactly the fields the CRD declares (the API server prunes others). A stage's
        ``predictedStepSeconds`` is its busy time per optimizer step: M micro-batches of
        compute plus sends; the plan's is the whole 1F1B step played out, bubble included.
        """
        m = self.micro_batches
        return {
            "stages": [
                {
                    "index": s.index,
                    "pool": s.pool,
                    "layerStart": s.layer_start,
                    "layerEnd": s.layer_end,
                    "predictedStepSeconds": _round(m * s.seconds),
                    "predictedMemoryBytes": s.memory_bytes,
                    "availableMemoryBytes": s.memory_available_bytes,
                }
                for s in self.stages
            ],
            "predictedStepSeconds": _round(self.step_seconds),
            "predictedTokensPerSecond": _round(self.tokens_per_second),
            "bubbleFraction": _round(self.bubble_fraction),
            "bottleneck": {"stage": self.bottleneck.stage, "resource": self.bottleneck.resource},
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything the plan says, camelCase, for ``relaytrain plan --json`` and scripts."""
        status = self.to_status()
        for stage, s in zip(status["stages"], self.stages, strict=True):
            stage.update(
                gpuProduct=s.gpu_product,
                layers=s.layers,
                microBatchesInFlight=s.in_flight,
                predictedMicroBatchSeconds=_round(s.beat_seconds),
                predictedComputeSeconds=_round(s.compute_seconds),
                predictedLinkSeconds=_round(s.link_seconds),
                predictedBusiestLinkSeconds=_round(s.side_seconds),
            )
        status["bottleneck"]["detail"] = self.bottleneck.detail
        status.update(
            stageCount=len(self.stages),
            microBatches=self.micro_batches,
            tokensPerMicroBatch=self.tokens_per_micro_batch,
            predictedMicroBatchSeconds=_round(self.micro_batch_seconds),
            search=self.search,
            sequencesEvaluated=self.sequences_evaluated,
            notes=list(self.notes),
        )
        return status


def _round(value: float) -> float:
    """Four significant digits: predictions are not more precise, and status stays readable."""
    return float(f"{value:.4g}")
