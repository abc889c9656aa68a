"""Creating stage pods: a job's first, a resumed job's, and a failed stage's replacement.

A replacement waits spec.failurePolicy.backoffSeconds from its stage's failure, then goes
where `placement.place_replacements` puts it (its own pool while that has room, another
eligible pool whose memory fits, or its own pool to wait on, saying why), except under
Kueue, where it stays on the pool it was admitted on. One waiting moves as soon as another
pool has a GPU for it (`rehome_waiting`, waiting.py). It restores the newest committed
checkpoint, unless another pipeline trains on: then it rejoins from a live peer's state.
Every pod is built from the recorded plan (builders/pod.py), with the Service and the link
Secret the stages need.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from relaytrain_contract.fence import plan_document

from relaytrain_operator.domain.builders.labels import StageKey
from relaytrain_operator.domain.builders.pod import (
    CredentialsRef,
    StagePodInputs,
    build_stage_pod,
    stage_image,
)
from relaytrain_operator.domain.builders.service import build_service
from relaytrain_operator.domain.placement import Choice, place_replacements, pool_selector
from relaytrain_operator.domain.recovery import (
    INCARNATION_ANNOTATION,
    REPLACING,
    StageDecision,
    backoff_left,
)
from relaytrain_operator.domain.resplit import split_of
from relaytrain_operator.domain.stage_config import build_pipeline_configs, job_pod_endpoints
from relaytrain_operator.domain.status import parse_time, rfc3339, stage_name
from relaytrain_operator.loop.actions import Create, CreateLinkSecret, PutPlan
from relaytrain_operator.loop.decide.admission import flavor_placement
from relaytrain_operator.loop.decide.context import (
    WAITING_ANNOTATION,
    JsonDict,
    Pass,
    stage_memory,
)
from relaytrain_operator.loop.decide.waiting import waiting_moves
from relaytrain_operator.spec import FineTuneJob, PlanStatus, StageStatus, is_s3


def create_stages(
    ctx: Pass,
    spec: FineTuneJob,
    stages: list[StageKey],
    entries: dict[StageKey, StageStatus],
    waiting: dict[StageKey, str],
) -> None:
    """Create the pods of `stages` (and the Service and link Secret they need).

    A replacement waits spec.failurePolicy.backoffSeconds from its stage's failure,
    `lastFailureTime` in status.stages (kept in the cluster). A stage whose failure time
    is unknown (a status written before the field existed) starts its wait now, and the
    time is recorded so that the next pass counts from it.
    """
    due = _due(ctx, spec, stages, entries)
    if not due:
        return
    plan = ctx.status.plan
    nodes = list(ctx.observed.nodes.values())
    cluster_pods = ctx.observed.cluster_pods
    assert plan is not None and cluster_pods is not None
    splits = plan.splits()
    counts = tuple(len(split) for split in splits)
    lifetime = timedelta(seconds=spec.spec.link_certificates.lifetime_seconds)
    ctx.actions.append(CreateLinkSecret(counts, lifetime))
    ctx.actions.append(Create(build_service(ctx.job)))
    shares = (
        [p.micro_batches for p in plan.pipelines]
        if plan.pipelines
        else [spec.spec.training.micro_batches]
    )
    # A renewal's phase reaches every pod within one propagation delay: a link refused on
    # its certificate chain while one end has the newer files is tried again that long.
    grace = 2 * ctx.settings.secret_propagation_seconds
    epoch = ctx.status.plan_epoch or 0
    configs = build_pipeline_configs(
        spec, splits, job_pod_endpoints(ctx.name, ctx.namespace, counts), shares,
        renewal_grace=grace, compression=plan.compression,
        forwards_ahead=plan.forwards_ahead, plan_epoch=epoch,
    )  # fmt: skip
    if epoch and is_s3(spec.spec.checkpoint.uri):  # a replaced plan's stages write no more
        ctx.actions.append(PutPlan(plan_document(spec.metadata.uid or "", epoch)))
    replacing = {
        key: (_pool(plan, entries[key], key), stage_memory(plan, key))
        for key in due
        if entries[key].restarts
    }
    choices: dict[StageKey, Choice] = {}
    if replacing:
        choices = place_replacements(spec, replacing, nodes, cluster_pods, ctx.settings.catalog)
    if ctx.queue is not None:
        # Under Kueue a replacement stays on the pool it was admitted on (another pool would
        # use quota Kueue did not grant), and waits there while none of its GPUs is free:
        # marked waiting, it is re-split or retired in time, as without a queue.
        choices = {k: _admitted_pool(c, replacing[k][0]) for k, c in choices.items()}
    # A replacement restores the newest commit unless another pipeline trains on: then
    # it rejoins from a live peer's state (docs/worker.md).
    live = {key[0] for key in entries} - {
        key[0] for key, s in entries.items() if s.phase != "Running"
    }
    committed = committed_step(ctx)
    for key in due:
        entries[key] = _create_stage(
            ctx,
            spec,
            plan,
            key,
            entries[key],
            choice=choices.get(key),
            config=configs[key[0]][key[1]],
            restore=committed if not live - {key[0]} else None,
            waiting=waiting,
        )


def rehome_waiting(
    ctx: Pass,
    spec: FineTuneJob,
    plan: PlanStatus,
    entries: dict[StageKey, StageStatus],
    verdicts: dict[StageKey, StageDecision],
) -> None:
    """A replacement waiting for a GPU on its pool moves to another of the job's pools once
    one has a GPU free that fits it (waiting.py): its unscheduled pod is deleted, no
    failure counted, and the next pass creates it where the GPU is. Its status entry says
    REPLACING before the pod goes (written first: an operator restarted in between creates
    the pod, counting nothing)."""
    moving = {
        key: pools
        for key, pools in waiting_moves(ctx, spec, plan).items()
        if key in verdicts and verdicts[key].action == "keep"
    }
    if not moving:
        return
    for key in moving:
        entries[key] = entries[key].model_copy(update={"phase": REPLACING})
        verdicts[key] = StageDecision("delete")
    ctx.update(stages=[entries[key] for key in sorted(entries)])
    ctx.patch()
    for key, (waits_on, room) in sorted(moving.items()):
        name = ctx.observed.pods[key]["metadata"]["name"]
        ctx.event(
            "Normal",
            "StageMoving",
            f"Stage {stage_name(entries[key])} pod {name} waited for a GPU on pool "
            f"{waits_on}; pool {room} has one free: moving it there, not counted as a "
            "restart.",
        )


def _admitted_pool(choice: Choice, pool: str) -> Choice:
    """`choice` kept to `pool`, the pool Kueue admitted the stage on."""
    if choice.pool == pool:
        return choice
    return Choice(pool, False, "none of its GPUs is free, and Kueue admitted the stage there")


def _due(
    ctx: Pass, spec: FineTuneJob, stages: list[StageKey], entries: dict[StageKey, StageStatus]
) -> list[StageKey]:
    """Those of `stages` whose back-off is over; the pass asks to be woken when the first
    of the others is."""
    backoff = timedelta(seconds=spec.spec.failure_policy.backoff_seconds)
    due: list[StageKey] = []
    waits: list[timedelta] = []
    for key in stages:
        entry = entries[key]
        failed_at = parse_time(entry.last_failure_time)
        if failed_at is None and entry.restarts:
            failed_at = ctx.now
            entries[key] = entry.model_copy(update={"last_failure_time": rfc3339(ctx.now)})
        left = backoff_left(entry.restarts, failed_at, ctx.now, backoff)
        if left:
            waits.append(left)
        else:
            due.append(key)
    if waits:
        ctx.wake_within(min(waits).total_seconds())
    return due


def _pool(plan: PlanStatus, entry: StageStatus, key: StageKey) -> str:
    """The stage's pool: where status last put it, else where it was planned."""
    return entry.pool or plan.splits()[key[0]][key[1]].pool


def _create_stage(
    ctx: Pass,
    spec: FineTuneJob,
    plan: PlanStatus,
    key: StageKey,
    entry: StageStatus,
    *,
    choice: Choice | None,
    config: JsonDict,
    restore: int | None,
    waiting: dict[StageKey, str],
) -> StageStatus:
    """Create the stage's pod (on `choice`'s pool, for a replacement placed) and return its
    status entry; a replacement with no free GPU says why it waits, in `waiting` too.
    `restore`: the committed step a replacement restores, if it restores one."""
    p, k = key
    pool = _pool(plan, entry, key)
    annotations = {INCARNATION_ANNOTATION: str(entry.restarts)}
    if choice is not None:
        pool = choice.pool
        if not choice.free:
            why = f"Stage {stage_name(entry)} waits for a GPU on pool {pool}: {choice.why}."
            annotations[WAITING_ANNOTATION] = why
            waiting[key] = why
    flavor_labels, flavor_tolerations = flavor_placement(ctx, p, pool)
    placement = spec.spec.placement
    selector = {
        **pool_selector(pool, list(ctx.observed.nodes.values()), placement.gpu_label),
        **placement.node_selector,
        **flavor_labels,
    }
    pod = build_stage_pod(
        ctx.job,
        pod_inputs(
            ctx,
            spec,
            (p if plan.several() else None, k),
            pool=pool,
            selector=selector,
            need=stage_memory(plan, key),
            config=config,
            tolerations=flavor_tolerations,
            split=split_of(plan.splits()[p]),
        ),
    )
    pod["metadata"]["annotations"].update(annotations)
    ctx.actions.append(Create(pod))
    update: dict[str, Any] = {
        "pool": pool,
        "phase": "Pending",
        "pod": pod["metadata"]["name"],
        "ready": False,
        "node": None,
    }
    if entry.restarts and restore is not None:
        update["restored_from_step"] = restore
    return entry.model_copy(update=update)


def committed_step(ctx: Pass) -> int | None:
    """The newest committed checkpoint: a replacement restores it. The store's
    progress.json, read this pass, can be newer than what status last folded in."""
    fresh = ctx.observed.progress
    if fresh is not None and "lastCommittedStep" in fresh.status:
        return int(fresh.status["lastCommittedStep"])
    progress = ctx.status.progress
    return progress.last_committed_step if progress is not None else None


def pod_inputs(
    ctx: Pass,
    spec: FineTuneJob,
    key: tuple[int | None, int],
    *,
    pool: str,
    selector: dict[str, str],
    need: int,
    config: JsonDict,
    tolerations: Sequence[JsonDict] = (),
    split: str | None = None,
) -> StagePodInputs:
    """`tolerations`: the assigned Kueue flavour's, added to the job's own; `split`: the
    pipeline's, recorded on the pod (a pod of another split is replaced)."""
    ref = spec.spec.checkpoint.credentials_secret
    placement = spec.spec.placement
    return StagePodInputs(
        index=key[1],
        pipeline=key[0],
        pool=pool,
        node_selector=selector,
        memory_bytes=need,
        stage_config=config,
        image=stage_image(ctx.observed.pods.values(), spec.spec.image, ctx.settings.worker_image),
        device=ctx.settings.worker_device,
        credentials=CredentialsRef(ref.name, ref.access_key_key, ref.secret_key_key)
        if ref is not None
        else None,
        tolerations=_merged(
            [t.model_dump(mode="json", exclude_none=True) for t in placement.tolerations],
            tolerations,
        ),
        priority_class_name=placement.priority_class_name,
        runtime_class_name=placement.runtime_class_name,
        split=split,
    )


def _merged(own: list[JsonDict], more: Sequence[JsonDict]) -> list[JsonDict]:
    return own + [t for t in more if t not in own]
