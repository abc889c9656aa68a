"""A job of one pipeline whose replacement finds no GPU is planned again for the GPUs it can
have (pure; docs/operator.md, "A replacement that cannot fit").

Today's placement moves a replacement to another eligible pool whose memory fits; this is
for when none does — the stage's pool is full and every other is full or too small — so
the successor would wait, and the whole pipeline with it, for as long as the fleet says.

**The rule (ski rental).** A re-split costs every stage a restart: its pod created again, its
slice loaded, the last commit restored by parameter name under the new split — about what
a pipeline's join costs (`--join-seconds`, 120 s by default). Waiting costs the whole job's
progress for as long as no GPU frees up, which nobody can know in advance. So the successor
waits that long first (`resplit_wait`) and then the job is re-split onto what is free. Like
renting skis until the rent paid equals the price, this never costs more than twice what
the best choice in hindsight would: a GPU that frees up soon is waited for, one that does
not costs at most one join's worth of waiting. No step is lost to it: a pipeline that lost a
stage restores its last commit either way.

**The new plan** (`resplit_plan`) is the planner's on the GPUs free now together with those
the job's own pods hold (they are freed for it), under the job's own bounds: a fixed
`spec.pipeline.stages` keeps its count; with `auto` the count may shrink but not grow
beyond the plan's, since the job's link certificates were minted per stage. A plan that puts
every stage where it already is changes nothing and is not made (the waiting pod will be
scheduled).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from relaytrain_operator.domain.planner import Catalog
from relaytrain_operator.domain.planning import make_plan
from relaytrain_operator.spec import FineTuneJob

JsonDict = dict[str, Any]


def resplit_wait(waiting_since: datetime, now: datetime, cost_seconds: float) -> timedelta:
    """How much longer a replacement waiting for a GPU since `waiting_since` waits before its
    pipeline is re-split (zero: now): as long as a re-split costs, `cost_seconds`."""
    return max(timedelta(0), timedelta(seconds=cost_seconds) - (now - waiting_since))


def resplit_plan(
    job: FineTuneJob,
    model_config: JsonDict,
    nodes: Iterable[JsonDict],
    others: Iterable[JsonDict],
    *,
    stages_now: int,
    catalog: Catalog | None = None,
    default_link: tuple[float, float] | None = None,
) -> JsonDict:
    """status.plan of `job` (one pipeline of `stages_now` stages) re-planned on `nodes`, the
    GPUs that `others` (every active pod but the job's own) leave free: one pipeline of at
    most `stages_now` stages (exactly `spec.pipeline.stages` when the job fixes it). Raises
    PlanError when none fits."""
    return make_plan(
        job,
        model_config,
        nodes,
        others,
        catalog=catalog,
        default_link=default_link,
        max_stages=stages_now,
    )


def split_of(stages: Iterable[Any]) -> str:
    """A pipeline's split as a stage pod's annotation records it: each stage's decoder layers,
    `start-end` in order (e.g. `0-15,15-30`)."""
    return ",".join(f"{s.layer_start}-{s.layer_end}" for s in stages)


def same_places(before: Iterable[Any], after: Iterable[Any]) -> bool:
    """Whether two splits put the same layers on the same pools, stage by stage."""
    return [(s.pool, s.layer_start, s.layer_end) for s in before] == [
        (s.pool, s.layer_start, s.layer_end) for s in after
    ]
