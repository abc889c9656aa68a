"""Pipelines added to a running job on GPUs that joined (docs/operator.md, "Adding a
pipeline"): the planner's `plan_growth`, fed from the job's record and the cluster.

The pipelines training are priced where their stages run now, each with its planned share
(no survivor moves); the GPUs free for the job are the eligible nodes' free GPUs less
those its own stages hold (placement counts a job's own pods as free, for a plan made
again). The planner adds the pipelines that shorten the step most, and only when they pay
(`GROWTH_MARGIN`, and the time they save over the steps left against what a join costs:
planner/growth.py). The result is the job's plan grown: the added pipelines appended to
status.plan.pipelines with their stages and every pipeline's share planned again (the
stages training take theirs from names.FLEET_FILE: the membership they agree on each step
shares the step's micro-batches by all of them, docs/worker.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from relaytrain_operator.domain.membership import assess_layout
from relaytrain_operator.domain.placement import job_pools
from relaytrain_operator.domain.planner import (
    Catalog,
    Growth,
    ModelShape,
    Plan,
    Pool,
    TrainingShape,
    plan_growth,
)
from relaytrain_operator.domain.planning import job_sync, training_shape
from relaytrain_operator.spec import FineTuneJob, PlanPipeline, PlanStatus

JsonDict = dict[str, Any]
StageKey = tuple[int, int]


@dataclass(frozen=True)
class Grown:
    """What adding pipelines to a running job would do (`grow`)."""

    growth: Growth
    """The planner's verdict: what it adds, the prediction before and after, and why."""
    plan: PlanStatus | None
    """The job's plan with the added pipelines (None when none is added: `growth.pays` is
    false or nothing would shorten the step)."""
    free: tuple[Pool, ...]
    """The GPUs free for the job that the planner was offered."""

    @property
    def added(self) -> list[int]:
        """The indices of the added pipelines."""
        if self.plan is None or not self.plan.pipelines:
            return []
        return [p.index for p in self.plan.pipelines[-len(self.growth.added) :]]


def grow(
    job: FineTuneJob,
    plan: PlanStatus,
    model_config: Mapping[str, Any],
    *,
    held: Mapping[StageKey, str],
    nodes: Iterable[JsonDict],
    cluster_pods: Iterable[JsonDict],
    steps_left: int,
    catalog: Catalog | None = None,
    default_link: tuple[float, float] | None = None,
    join_seconds: float,
    out: Collection[int] = (),
    max_pipelines: int | None = None,
) -> Grown:
    """The pipelines to add to `job` (planned as `plan`, several pipelines), its stages
    training on the pools `held` says ((pipeline, stage) -> pool; the plan's where it lacks
    one), on the GPUs of `nodes` that `cluster_pods` leave free. The pipelines `out` are not
    priced (they train nothing) and keep their planned share, as the weight they come back
    with; the others' shares and the added ones' fill the step. At most `max_pipelines`
    train then (None: one per micro-batch). Raises planner.PlanError or
    PoolError (or ValueError) where the job cannot be priced: then nothing is added."""
    assert plan.pipelines, "a job of one pipeline has no replicas to grow"
    nodes = list(nodes)
    model = ModelShape.from_hf_config(dict(model_config))
    training = training_shape(job, plan.compression, plan.forwards_ahead)
    everything = job_pools(job, nodes, [], default_link=default_link, require_ready=False)
    training_now = [p for p in plan.pipelines if p.index not in out]
    running = [_priced(model, training, everything, catalog, p, held=held) for p in training_now]
    free = _free(job_pools(job, nodes, list(cluster_pods), default_link=default_link),
                 Counter(held.values()))  # fmt: skip
    stages = job.spec.pipeline.stages
    growth = plan_growth(
        model, training, running, everything, free,
        steps_left=steps_left, catalog=catalog, sync=job_sync(job),
        stages=None if stages == "auto" else stages, join_seconds=join_seconds,
        max_pipelines=max_pipelines or job.spec.training.micro_batches,
    )  # fmt: skip
    if not growth.pays or not growth.added:
        return Grown(growth, None, tuple(free))
    n = len(plan.pipelines)
    shares = {p.index: m for p, m in zip(training_now, growth.shares, strict=False)}
    kept = [
        p.model_copy(update={"micro_batches": shares.get(p.index, p.micro_batches)})
        for p in plan.pipelines
    ]
    added = [
        PlanPipeline.model_validate({"index": n + i, "microBatches": a.micro_batches,
                                     **a.to_status()})
        for i, a in enumerate(growth.added)
    ]  # fmt: skip
    grown = plan.model_copy(
        update={
            "pipelines": [*kept, *added],
            "predicted_step_seconds": round(growth.step_seconds_after, 6),
            "predicted_tokens_per_second": round(growth.tokens_per_second_after, 6),
        }
    )
    return Grown(growth, grown, tuple(free))


def as_fleet(plan: PlanStatus, micro_batches: int) -> PlanStatus:
    """The plan of a job of one pipeline in the form of several: that pipeline is pipeline
    0, with every micro-batch of the step (what a job of one pipeline grows from)."""
    if plan.pipelines:
        return plan
    only = PlanPipeline(
        index=0, micro_batches=micro_batches, stages=plan.stages,
        predicted_step_seconds=plan.predicted_step_seconds,
        predicted_tokens_per_second=plan.predicted_tokens_per_second,
        bubble_fraction=plan.bubble_fraction, bottleneck=plan.bottleneck,
    )  # fmt: skip
    return plan.model_copy(
        update={"pipelines": [only], "stages": [], "bubble_fraction": None, "bottleneck": None}
    )


def _priced(
    model: ModelShape,
    training: TrainingShape,
    pools: list[Pool],
    catalog: Catalog | None,
    planned: PlanPipeline,
    *,
    held: Mapping[StageKey, str],
) -> Plan:
    """Pipeline `planned` priced on the pools its stages hold, with its planned share."""
    stages = [
        (held.get((planned.index, s.index)) or s.pool, s.layer_end - s.layer_start)
        for s in planned.stages
    ]
    return assess_layout(model, training, pools, (planned.micro_batches, stages), catalog)


def _free(pools: list[Pool], held: Counter[str]) -> list[Pool]:
    """`pools` (free GPUs, the job's own counted as free) less the GPUs its stages hold."""
    return [replace(p, gpus=p.gpus - held[p.name]) for p in pools if p.gpus > held[p.name]]
