"""What the fleet planner returns: one or several pipelines, their shares, and the sync price."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from relaytrain_operator.domain.planner.result import Plan, _round
from relaytrain_operator.domain.planner.sync import SyncPrice


@dataclass(frozen=True)
class FleetPlan:
    """R pipelines (R = 1 is today's single pipeline) training on one global batch per step."""

    pipelines: tuple[Plan, ...]
    """Each pipeline's plan; its ``micro_batches`` is its share of the step's."""
    micro_batches: int
    """Micro-batches per optimizer step, all pipelines together (M)."""
    tokens_per_micro_batch: int
    sync: SyncPrice
    """What keeping the pipelines' weights equal costs."""
    single: Plan
    """The best single pipeline (what ``plan()`` returns), for comparison."""
    usable_gpus: int
    """GPUs of the pools that can run the job."""
    search: Literal["single", "exhaustive", "heuristic"]
    """How the set of pipelines was chosen: ``single`` (``replicas=1``), ``exhaustive``
    (every set of candidate pipelines that could win was priced) or ``heuristic`` (greedy,
    then a bounded exhaustive search that ran out of its budget)."""
    candidates: int = 0
    """Candidate pipelines (GPU multisets with their best split) the sets were made of."""
    sets_evaluated: int = 0
    """Sets of pipelines priced."""
    notes: tuple[str, ...] = field(default=())

    @property
    def pipeline_seconds(self) -> float:
        """The slowest pipeline's 1F1B time for its share of the step."""
        return max(p.step_seconds for p in self.pipelines)

    @property
    def step_seconds(self) -> float:
        """Predicted optimizer step: the slowest pipeline, then its share of the sync."""
        return self.pipeline_seconds + self.sync.per_step_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.micro_batches * self.tokens_per_micro_batch / self.step_seconds

    @property
    def gpus(self) -> int:
        """GPUs the plan uses (one per stage)."""
        return sum(len(p.stages) for p in self.pipelines)

    @property
    def speedup(self) -> float:
        """Predicted tokens/s over the best single pipeline's."""
        return self.tokens_per_second / self.single.tokens_per_second

    def to_status(self) -> dict[str, Any]:
        """The FineTuneJob's ``status.plan``: with one pipeline exactly :meth:`Plan.to_status`;
        with several, each pipeline's own under ``pipelines[]`` with its share, and the whole
        job's predictions (sync included)."""
        if len(self.pipelines) == 1:
            return self.pipelines[0].to_status()
        return {
            "pipelines": [
                {"index": i, "microBatches": p.micro_batches, **p.to_status()}
                for i, p in enumerate(self.pipelines)
            ],
            "predictedStepSeconds": _round(self.step_seconds),
            "predictedTokensPerSecond": _round(self.tokens_per_second),
            "predictedSyncSeconds": _round(self.sync.per_step_seconds),
        }

    def to_dict(self) -> dict[str, Any]:
        """``relaytrain plan --json``: with one pipeline exactly :meth:`Plan.to_dict`."""
        if len(self.pipelines) == 1:
            return self.pipelines[0].to_dict()
        pipelines = []
        for i, p in enumerate(self.pipelines):
            doc = p.to_dict()
            del doc["notes"]
            pipelines.append({"index": i, **doc})
        s = self.sync
        return {
            "pipelineCount": len(self.pipelines),
            "gpuCount": self.gpus,
            "usableGpuCount": self.usable_gpus,
            "microBatches": self.micro_batches,
            "tokensPerMicroBatch": self.tokens_per_micro_batch,
            "predictedStepSeconds": _round(self.step_seconds),
            "predictedPipelineSeconds": _round(self.pipeline_seconds),
            "predictedTokensPerSecond": _round(self.tokens_per_second),
            "sync": {
                "mode": s.sync.mode,
                "everySteps": s.sync.every,
                "outerCode": s.sync.code,
                "collective": s.collective,
                "trained": s.gradients.what,
                "exchanged": s.gradients.kind,
                "gradientDtype": s.gradients.dtype,
                "gradientBytes": round(s.gradient_bytes),
                "predictedSeconds": _round(s.seconds),
                "predictedBandwidthSeconds": _round(s.bandwidth_seconds),
                "predictedLatencySeconds": _round(s.latency_seconds),
                "predictedSecondsPerStep": _round(s.per_step_seconds),
            },
            "singlePipeline": {
                "stageCount": len(self.single.stages),
                "predictedStepSeconds": _round(self.single.step_seconds),
                "predictedTokensPerSecond": _round(self.single.tokens_per_second),
            },
            "speedupOverSinglePipeline": _round(self.speedup),
            "pipelines": pipelines,
            "search": self.search,
            "candidatePipelines": self.candidates,
            "setsEvaluated": self.sets_evaluated,
            "notes": list(self.notes),
        }
