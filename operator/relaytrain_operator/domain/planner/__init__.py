"""The planner: split a model into pipeline stages sized to each GPU (pure Python, no I/O).

Public API (stable; the operator and `relaytrain plan` call it)::

    from relaytrain_operator.domain.planner import ModelShape, Pool, TrainingShape, plan

    p = plan(ModelShape.from_hf_config(config), TrainingShape(4, 8, 1024), pools)
    p.stages, p.tokens_per_second, p.bottleneck, p.to_status()

    fleet = plan_fleet(model, training, pools, sync=Sync("periodic", every=8))
    fleet.pipelines, fleet.tokens_per_second, fleet.speedup, fleet.to_dict()

    growth = plan_growth(model, training, fleet.pipelines, pools, free, steps_left=500)
    growth.added, growth.shares, growth.pays, growth.reason

See docs/planner.md for the cost model, the search and the ``status.plan`` shape.
"""

from relaytrain_operator.domain.planner.api import assess, plan
from relaytrain_operator.domain.planner.catalog import (
    BUILTIN_GPUS,
    DEFAULT_CATALOG,
    Catalog,
    GpuSpec,
    UnknownGpuError,
)
from relaytrain_operator.domain.planner.choose import (
    AUTO,
    AUTO_ORDER,
    choose_compression,
    choose_forwards_ahead,
    plan_forwards_ahead,
)
from relaytrain_operator.domain.planner.cost import CostSettings
from relaytrain_operator.domain.planner.fleet import plan_fleet
from relaytrain_operator.domain.planner.fleet_result import FleetPlan
from relaytrain_operator.domain.planner.growth import Growth, plan_growth
from relaytrain_operator.domain.planner.model_shape import ModelShape, ModelShapeError
from relaytrain_operator.domain.planner.pools import (
    Pool,
    PoolError,
    pools_from_file,
    pools_from_nodes,
)
from relaytrain_operator.domain.planner.result import Bottleneck, Plan, PlanError, StagePlan
from relaytrain_operator.domain.planner.shares import Lane, split_micro_batches
from relaytrain_operator.domain.planner.sync import OUTER_CODES, SYNC_MODES, Sync, SyncPrice
from relaytrain_operator.domain.planner.targets import LoraTargetError
from relaytrain_operator.domain.planner.training import TrainingShape

__all__ = [
    "AUTO",
    "AUTO_ORDER",
    "BUILTIN_GPUS",
    "DEFAULT_CATALOG",
    "OUTER_CODES",
    "SYNC_MODES",
    "Bottleneck",
    "Catalog",
    "CostSettings",
    "FleetPlan",
    "GpuSpec",
    "Growth",
    "Lane",
    "LoraTargetError",
    "ModelShape",
    "ModelShapeError",
    "Plan",
    "PlanError",
    "Pool",
    "PoolError",
    "StagePlan",
    "Sync",
    "SyncPrice",
    "TrainingShape",
    "UnknownGpuError",
    "assess",
    "choose_compression",
    "choose_forwards_ahead",
    "plan",
    "plan_fleet",
    "plan_forwards_ahead",
    "plan_growth",
    "pools_from_file",
    "pools_from_nodes",
    "split_micro_batches",
]
