"""Replacements waiting for a GPU, and which of them a pool with one free can take now.

A replacement that finds no free GPU is created on its own pool to wait there, marked so
(`WAITING_ANNOTATION`; create.py). While it waits, a GPU may free up on another of the
job's pools: a node joins, another job ends, or the node was one this operator had not
seen yet when it placed the replacement. Moving it there (create.rehome_waiting) restarts
that stage alone, so it comes before what a longer wait leads to, which restarts more: a
re-split of the job's one pipeline (resplit.py) or its pipeline leaving (membership.py).
Not under Kueue, where a replacement stays on the pool Kueue admitted it on.
"""

from __future__ import annotations

from relaytrain_operator.domain.builders.labels import POOL_ANNOTATION, StageKey
from relaytrain_operator.domain.placement import place_replacements
from relaytrain_operator.loop.decide.context import (
    WAITING_ANNOTATION,
    JsonDict,
    Pass,
    planned_keys,
    stage_memory,
)
from relaytrain_operator.spec import FineTuneJob, PlanStatus


def unbound_waiting(pod: JsonDict) -> bool:
    """The pod was created to wait for a GPU, is not bound to a node and is not going."""
    meta = pod.get("metadata") or {}
    return (
        WAITING_ANNOTATION in (meta.get("annotations") or {})
        and not (pod.get("spec") or {}).get("nodeName")
        and not meta.get("deletionTimestamp")
    )


def waiting_moves(
    ctx: Pass, spec: FineTuneJob, plan: PlanStatus
) -> dict[StageKey, tuple[str, str]]:
    """The planned stages whose replacement waits unscheduled and that another of the job's
    pools has a GPU free for now, that fits it: (the pool it waits on, the pool with room),
    for the pipelines whose every waiting stage has one. Empty under Kueue, and before the
    pass has read the cluster's pods (`needs` asks for them while a replacement waits). Two
    replacements do not count one free GPU twice."""
    pods = ctx.observed.cluster_pods
    if ctx.queue is not None or pods is None:
        return {}
    planned, keys = plan.splits(), set(planned_keys(plan))
    waiting = {
        key: ((pod["metadata"].get("annotations") or {}).get(POOL_ANNOTATION)
              or planned[key[0]][key[1]].pool)
        for key, pod in ctx.observed.pods.items()
        if key in keys and unbound_waiting(pod)
    }  # fmt: skip
    if not waiting:
        return {}
    stages = {key: (pool, stage_memory(plan, key)) for key, pool in waiting.items()}
    nodes = list(ctx.observed.nodes.values())
    choices = place_replacements(spec, stages, nodes, pods, ctx.settings.catalog)
    moves = {
        key: (waiting[key], choice.pool)
        for key, choice in choices.items()
        if choice.free and choice.pool != waiting[key]
    }
    # A pipeline trains only with every stage: one whose waiting stages cannot all move
    # keeps waiting for what a longer wait brings (a re-split, or leaving), moving none.
    stuck = {key[0] for key in waiting if key not in moves}
    return {key: pools for key, pools in moves.items() if key[0] not in stuck}
