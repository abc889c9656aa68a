"""From a parsed job and the cluster's nodes and pods to `status.plan` (pure).

The planner works on pools; this module chooses which nodes count (ready, carrying the
job's GPU label and extra node selector, in its allowed pools), takes away the GPUs
other pods hold (`pools.free_nodes`), calls the planner, and returns its result as
status.plan (`Plan.to_status()`, the shape the CRD declares). The plan is made once,
when the job starts; afterwards status.plan is the record every replacement pod is built
from, so a stage keeps its layers whatever happens to the cluster meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relaytrain_operator.planner import (
    Catalog,
    ModelShape,
    PlanError,
    PoolError,
    TrainingShape,
    plan,
    pools_from_nodes,
)
from relaytrain_operator.pools import free_nodes, node_pool
from relaytrain_operator.spec import FineTuneJob

JsonDict = dict[str, Any]

__all__ = ["PlanError", "eligible_nodes", "make_plan", "training_shape"]


def training_shape(job: FineTuneJob) -> TrainingShape:
    """The settings of `job` the planner prices."""
    spec = job.spec
    return TrainingShape(
        micro_batch_size=spec.training.micro_batch_size,
        micro_batches=spec.training.micro_batches,
        sequence_length=spec.dataset.sequence_length,
        method=spec.method.type,
        lora_rank=spec.method.rank,
        lora_targets=tuple(spec.method.target_modules),
        compression=spec.pipeline.compression,
        dtype=spec.model.dtype,
    )


def eligible_nodes(job: FineTuneJob, nodes: Iterable[JsonDict]) -> list[JsonDict]:
    """Nodes the job may use: in an allowed pool and carrying spec.placement.nodeSelector."""
    placement = job.spec.placement
    allowed = set(placement.pools)
    result = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        pool = node_pool(node, placement.gpu_label)
        if pool is None or (allowed and pool not in allowed):
            continue
        if any(labels.get(k) != v for k, v in placement.node_selector.items()):
            continue
        result.append(node)
    return result


def make_plan(
    job: FineTuneJob,
    model_config: JsonDict,
    nodes: Iterable[JsonDict],
    pods: Iterable[JsonDict],
    *,
    catalog: Catalog | None = None,
    default_link: tuple[float, float] | None = None,
) -> JsonDict:
    """Plan `job` onto the GPUs free now; status.plan. Raises PlanError when it cannot.

    A model config the planner cannot read and nodes it cannot make pools of are
    PlanErrors too: either way the job cannot be scheduled as written, and the message
    says why.
    """
    placement = job.spec.placement
    try:
        shape = ModelShape.from_hf_config(model_config)
    except ValueError as err:
        raise PlanError(f"The model's config.json cannot be planned: {err}") from err
    namespace, name = job.metadata.namespace, job.metadata.name
    free = free_nodes(eligible_nodes(job, nodes), pods, placement.gpu_label, (namespace, name))
    try:
        pools = pools_from_nodes(free, placement.gpu_label, default_link=default_link)
    except PoolError as err:
        raise PlanError(f"The GPU nodes cannot be grouped into pools: {err}") from err
    if not pools:
        where = f" in pools {', '.join(placement.pools)}" if placement.pools else ""
        raise PlanError(
            f"No free GPU{where}: no ready node with label {placement.gpu_label!r} has an "
            f"unallocated nvidia.com/gpu."
        )
    try:
        training = training_shape(job)
    except ValueError as err:
        raise PlanError(f"The training settings cannot be planned: {err}") from err
    stages = job.spec.pipeline.stages
    result = plan(
        shape,
        training,
        pools,
        catalog=catalog,
        stages=None if stages == "auto" else stages,
    )
    return result.to_status()
