"""The planner: split a model into pipeline stages sized to each GPU (pure Python, no I/O).

Public API (stable; the operator and `relaytrain plan` call it)::

    from relaytrain_operator.planner import ModelShape, Pool, TrainingShape, plan

    p = plan(ModelShape.from_hf_config(config), TrainingShape(4, 8, 1024), pools)
    p.stages, p.tokens_per_second, p.bottleneck, p.to_status()

See docs/planner.md for the cost model, the search and the ``status.plan`` shape.
"""

from relaytrain_operator.planner.api import assess, plan
from relaytrain_operator.planner.catalog import (
    BUILTIN_GPUS,
    DEFAULT_CATALOG,
    Catalog,
    GpuSpec,
    UnknownGpuError,
)
from relaytrain_operator.planner.cost import CostSettings
from relaytrain_operator.planner.model_shape import ModelShape, ModelShapeError
from relaytrain_operator.planner.pools import Pool, PoolError, pools_from_file, pools_from_nodes
from relaytrain_operator.planner.result import Bottleneck, Plan, PlanError, StagePlan
from relaytrain_operator.planner.training import TrainingShape

__all__ = [
    "BUILTIN_GPUS",
    "DEFAULT_CATALOG",
    "Bottleneck",
    "Catalog",
    "CostSettings",
    "GpuSpec",
    "ModelShape",
    "ModelShapeError",
    "Plan",
    "PlanError",
    "Pool",
    "PoolError",
    "StagePlan",
    "TrainingShape",
    "UnknownGpuError",
    "assess",
    "plan",
    "pools_from_file",
    "pools_from_nodes",
]
