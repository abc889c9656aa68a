"""From a parsed job and the cluster's nodes and pods to `status.plan` (pure).

The planner works on pools; `placement.job_pools` says which of them the job may use and
what is free there (the same rules as a replacement and `relaytrain plan`). This module
calls the planner — `plan_fleet`, which plans `spec.pipeline.replicas` pipelines (`auto`:
the best number, one included) — and returns its result as status.plan
(`FleetPlan.to_status()`, the shape the CRD declares: today's fields with one pipeline,
`pipelines[]` with several). The plan is made once, when the job starts; afterwards status.plan is
the record every replacement pod is built from, so a stage keeps its layers whatever
happens to the cluster meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from relaytrain_operator.domain.placement import job_pools
from relaytrain_operator.domain.planner import (
    AUTO,
    AUTO_ORDER,
    Catalog,
    FleetPlan,
    LoraTargetError,
    ModelShape,
    Plan,
    PlanError,
    PoolError,
    Sync,
    TrainingShape,
    choose_compression,
    plan,
    plan_fleet,
    plan_forwards_ahead,
)
from relaytrain_operator.spec import FineTuneJob

JsonDict = dict[str, Any]

__all__ = ["LoraTargetError", "ModelConfigError", "PlanError", "make_plan", "training_shape"]


def job_sync(job: FineTuneJob) -> Sync:
    """How the job's pipelines synchronise, as the planner prices it: `spec.pipeline.sync`'s
    mode, interval and outer code, and a LoRA job's explicit exact merge (which gathers
    float64 weights; `auto` merges exactly only where that costs what a sum does)."""
    sync = job.spec.pipeline.sync
    exact = job.spec.method.type == "lora" and sync.lora_merge == "exact"
    return Sync(sync.mode, sync.every_steps or 1, sync.outer_code, exact)


def training_shape(
    job: FineTuneJob, chosen: str | None = None, ahead: int | None = None
) -> TrainingShape:
    """The settings of `job` the planner prices (with `compression: auto`, the code the plan
    `chosen` — status.plan.compression — or, before a plan, the first code the planner
    tries: `choose_compression` tries them all; with `forwardsAhead: auto`, the plan's
    `ahead` — status.plan.forwardsAhead — or, before a plan, none: the plan is searched
    without, and `choose_forwards_ahead` plays its step with each)."""
    spec = job.spec
    compression: str = spec.pipeline.compression
    if compression == AUTO:
        compression = chosen or AUTO_ORDER[0]
    given = spec.pipeline.forwards_ahead
    forwards_ahead = (ahead or 0) if given == AUTO else int(given)
    return TrainingShape(
        micro_batch_size=spec.training.micro_batch_size,
        micro_batches=spec.training.micro_batches,
        sequence_length=spec.dataset.sequence_length,
        method=spec.method.type,
        lora_rank=spec.method.rank,
        lora_targets=tuple(spec.method.target_modules),
        lora_dropout=spec.method.dropout,
        compression=compression,  # type: ignore[arg-type]  # TrainingShape checks it
        dtype=spec.model.dtype,
        forwards_ahead=forwards_ahead,
        forwards_ahead_chosen=given == AUTO,
        gradient_tokens=spec.pipeline.gradient_tokens,
        gradient_bits=spec.pipeline.gradient_bits,
        gradient_fill=spec.pipeline.gradient_fill == "activations",
        epochs=spec.training.epochs,
        activation_bits=int(spec.pipeline.activation_error.removeprefix("int")),
        activation_basis=spec.pipeline.activation_basis,
    )


class ModelConfigError(PlanError):
    """The model at spec.model.uri is one the planner cannot plan (its family unsupported,
    its config.json missing a field): the spec must name another, whatever GPUs there are."""


def make_plan(
    job: FineTuneJob,
    model_config: JsonDict,
    nodes: Iterable[JsonDict],
    pods: Iterable[JsonDict],
    *,
    catalog: Catalog | None = None,
    default_link: tuple[float, float] | None = None,
    max_stages: int | None = None,
) -> JsonDict:
    """Plan `job` onto the GPUs free now; status.plan. Raises PlanError when it cannot.
    `max_stages`: one pipeline of at most that many stages (a re-split, domain/resplit.py:
    the job's link certificates were minted per stage), whatever `spec.pipeline.replicas`.

    A model config the planner cannot read (`ModelConfigError`: an unsupported family, a
    missing field — no fleet will change that) and nodes it cannot make pools of are
    PlanErrors too: either way the job cannot be scheduled as written, and the message
    says why.
    """
    placement = job.spec.placement
    try:
        shape = ModelShape.from_hf_config(model_config)
    except ValueError as err:
        raise ModelConfigError(f"The model's config.json cannot be planned: {err}") from err
    try:
        pools = job_pools(job, nodes, pods, default_link=default_link)
    except PoolError as err:
        raise PlanError(f"The GPU nodes cannot be grouped into pools: {err}") from err
    if not pools:
        where = f" in pools {', '.join(placement.pools)}" if placement.pools else ""
        if placement.node_selector:
            labels = ",".join(f"{k}={v}" for k, v in sorted(placement.node_selector.items()))
            where += f" on nodes labelled {labels}"
        raise PlanError(
            f"No free GPU{where}: no ready node with label {placement.gpu_label!r} has an "
            f"unallocated nvidia.com/gpu."
        )
    try:
        training = training_shape(job)
    except ValueError as err:
        raise PlanError(f"The training settings cannot be planned: {err}") from err
    pipeline = job.spec.pipeline
    stages = None if pipeline.stages == "auto" else pipeline.stages
    replicas = None if pipeline.replicas == "auto" else pipeline.replicas
    sync = job_sync(job)
    # A job that does not fit is planned again on every pass, and its diagnosis re-plans
    # each suggestion (seconds on a large fleet): the same inputs give the same refusal.
    key = repr((shape, training, pools, id(catalog), stages, replicas, sync, max_stages))
    refused = _REFUSED.get(key)
    if refused is not None:
        raise refused.with_traceback(None)

    def plan_with(shape_of: TrainingShape) -> FleetPlan | Plan:
        if max_stages is not None:
            return plan(shape, shape_of, pools, catalog, stages=stages, max_stages=max_stages,
                        suggest=False)  # fmt: skip
        return plan_fleet(
            shape, shape_of, pools, catalog=catalog, stages=stages, replicas=replicas, sync=sync
        )

    try:
        if pipeline.compression == AUTO:
            compression, result = choose_compression(plan_with, training)
        else:
            compression, result = training.compression, plan_with(training)
        ahead = training.forwards_ahead
        if pipeline.forwards_ahead == AUTO:
            chosen = replace(training, compression=compression)
            ahead, result = plan_forwards_ahead(plan_with, chosen, result)
    except PlanError as err:
        if len(_REFUSED) >= _REFUSED_KEPT:
            _REFUSED.pop(next(iter(_REFUSED)))
        _REFUSED[key] = err
        raise
    return {**result.to_status(), "compression": compression, "forwardsAhead": ahead}


_REFUSED: dict[str, PlanError] = {}
"""The latest refusals by their whole input (model, training, free pools, bounds), oldest
first: a memo, so the decision stays a function of its inputs."""
_REFUSED_KEPT = 64
