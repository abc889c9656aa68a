"""The job's status, computed (pure): phase, conditions, stages, and what changed.

The operator reads the stored status into the typed model of
`relaytrain_operator.spec.status` (the CRD's status schema, so every field it writes is one
the CRD declares), computes the whole status it wants as that model, and patches only the
top-level fields that differ from what is stored — no write when nothing changed, so a
quiet job costs the API server nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

from relaytrain_contract.exits import NON_RETRYABLE

from relaytrain_operator.domain.recovery import REPLACING
from relaytrain_operator.spec import (
    Condition,
    FineTuneJobStatus,
    PipelineStatus,
    PlanStatus,
    StageStatus,
    status_patch,
)

JsonDict = dict[str, Any]

READY = "Ready"
PROGRESSING = "Progressing"
RECONCILING = "Reconciling"
"""kstatus's abnormal-true condition: True while the operator is still bringing the job to
what it asks for (planning, starting, recovering, waiting for GPUs, a pipeline out)."""
STALLED = "Stalled"
"""kstatus's abnormal-true condition: True when nothing more happens without the user
(an invalid spec, a model that cannot be read, restarts used up)."""
WORKER_REASONS = tuple(NON_RETRYABLE.values())
"""Why a job failed at once on a stage's own word (relaytrain_contract.exits): InvalidInput,
InvalidStageConfig, StoreAccessDenied."""
STALLED_REASONS = (
    "InvalidSpec",
    "ModelUnavailable",
    "DatasetUnavailable",
    "CredentialsUnavailable",
    "BackoffLimitExceeded",
    *WORKER_REASONS,
)
DEGRADED = "Degraded"
PipelinePhase = Literal["Pending", "Running", "Recovering", "Succeeded", "Failed", "Left"]
OUT_PHASES = ("Failed", "Left")
"""The phases of a pipeline out of the job: given up, or gone with its nodes."""
LIFE_FIELDS = (
    "added_at_step", "left_at_step", "left_time", "left_reason", "returns", "returned_at_step",
    "held_out", "retired",
)  # fmt: skip
"""What status.pipelines[] keeps of a pipeline's life from pass to pass."""
"""Condition of a job that trains several pipelines: True while one of them is out
(recovering or given up) and the others train on."""

# Reasons after which nothing more happens to the job (an InvalidSpec "Failed" is not
# one: a corrected spec clears it).
TERMINAL_REASONS = ("Succeeded", "BackoffLimitExceeded", *WORKER_REASONS)


def rfc3339(moment: datetime) -> str:
    """A UTC timestamp the way Kubernetes writes them."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    """Inverse of rfc3339 (None for None or garbage)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def load_status(stored: Mapping[str, Any] | None) -> FineTuneJobStatus:
    """The stored status as the typed model (kopf's own `status.kopf`, if any, left out).
    Raises pydantic's ValidationError (a ValueError) for fields the model does not know."""
    return FineTuneJobStatus.model_validate(
        {key: value for key, value in (stored or {}).items() if key != "kopf"}
    )


def to_manifest(status: FineTuneJobStatus) -> JsonDict:
    """The status as stored: camelCase, unset fields dropped."""
    return status_patch(status)


def condition(status: FineTuneJobStatus, kind: str) -> Condition | None:
    """The condition of type `kind`, if any."""
    return next((c for c in status.conditions if c.type == kind), None)


def is_terminal(status: FineTuneJobStatus) -> bool:
    """Succeeded, or Failed for good (restarts exhausted): the job is over."""
    ready = condition(status, READY)
    return (
        status.phase in ("Succeeded", "Failed")
        and ready is not None
        and ready.reason in TERMINAL_REASONS
    )


def is_finished(stored: Mapping[str, Any] | None) -> bool:
    """`is_terminal` on the stored status as kopf hands it to a filter (a mapping)."""
    stored = stored or {}
    conditions = stored.get("conditions") or []
    ready: Mapping[str, Any] = next((c for c in conditions if c.get("type") == READY), {})
    return stored.get("phase") in ("Succeeded", "Failed") and ready.get("reason") in (
        TERMINAL_REASONS
    )


@dataclass(frozen=True)
class Verdict:
    """The job-level outcome of one reconciliation, in the words the conditions use."""

    phase: str
    """Pending, Planning, Running, Recovering, Succeeded, Failed or Suspended."""
    ready: bool
    """Ready condition status."""
    progressing: bool
    """Progressing condition status."""
    reason: str
    """CamelCase reason for both conditions."""
    message: str
    """Human message for both conditions."""
    degraded: bool | None = None
    """The Degraded condition (several pipelines): None leaves it as it is, or False if the
    job has one."""


def set_condition(
    conditions: list[Condition],
    kind: str,
    value: bool,
    *,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """Conditions with `kind` set; lastTransitionTime moves only when the status flips."""
    status: Literal["True", "False"] = "True" if value else "False"
    old = next((c for c in conditions if c.type == kind), None)
    kept = old is not None and old.status == status
    entry = Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=old.last_transition_time if kept and old else rfc3339(now),
        observed_generation=generation,
    )
    return [c for c in conditions if c.type != kind] + [entry]


def with_verdict(
    status: FineTuneJobStatus, verdict: Verdict, now: datetime, generation: int | None
) -> FineTuneJobStatus:
    """`status` with phase, its conditions and observedGeneration from `verdict`: Ready and
    Progressing, kstatus's Reconciling and Stalled, and Degraded for several pipelines."""
    conditions = list(status.conditions)
    # kstatus (sigs.k8s.io/cli-utils): Stalled=True reads as Failed, Reconciling=True as
    # InProgress, neither as Current — with observedGeneration equal to the generation.
    stalled = verdict.reason in STALLED_REASONS
    # A pipeline out is being reconciled while it is replaced; once given up (its phase
    # Failed, the others Running) the job trains on as it now is: Ready, not Reconciling.
    replacing = not status.pipelines or any(
        p.phase not in ("Running", *OUT_PHASES) for p in status.pipelines
    )
    reconciling = not stalled and (
        verdict.phase in ("Pending", "Planning", "Recovering")
        or (bool(verdict.degraded) and replacing)
    )
    for kind, value in (
        (READY, verdict.ready),
        (PROGRESSING, verdict.progressing),
        (RECONCILING, reconciling),
        (STALLED, stalled),
    ):
        conditions = set_condition(
            conditions,
            kind,
            value,
            reason=verdict.reason,
            message=verdict.message,
            now=now,
            generation=generation,
        )
    if verdict.degraded is not None or condition(status, DEGRADED) is not None:
        degraded = bool(verdict.degraded)
        conditions = set_condition(
            conditions,
            DEGRADED,
            degraded,
            reason=verdict.reason if degraded else "AllPipelinesTraining",
            message=verdict.message if degraded else "No pipeline is out.",
            now=now,
            generation=generation,
        )
    update: dict[str, Any] = {
        "phase": verdict.phase,
        "conditions": sorted(conditions, key=lambda c: c.type),
    }
    if generation is not None:
        update["observed_generation"] = generation
    if (
        verdict.phase in ("Succeeded", "Failed")
        and verdict.reason in TERMINAL_REASONS
        and status.completion_time is None
    ):
        update["completion_time"] = rfc3339(now)
    return status.model_copy(update=update)


def observed_stage(entry: StageStatus, pod: Mapping[str, Any], pool: str | None) -> StageStatus:
    """`entry` with what its (kept) pod shows: name, node, phase, readiness, pool."""
    meta = pod.get("metadata") or {}
    pod_status = pod.get("status") or {}
    seen = {
        "pod": meta.get("name"),
        "node": (pod.get("spec") or {}).get("nodeName"),
        "phase": pod_status.get("phase"),
        "pool": pool,
    }
    update: dict[str, Any] = {key: value for key, value in seen.items() if value is not None}
    update["ready"] = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod_status.get("conditions") or []
    )
    return entry.model_copy(update=update)


def idle_stage(entry: StageStatus) -> StageStatus:
    """A stage entry with no pod (suspended, finished or failed job)."""
    return StageStatus(
        index=entry.index,
        pipeline=entry.pipeline,
        pool=entry.pool,
        restarts=entry.restarts,
        last_failure=entry.last_failure,
        last_failure_time=entry.last_failure_time,
        restored_from_step=entry.restored_from_step,
    )


def stage_name(entry: StageStatus) -> str:
    """A stage as messages name it: `2`, or `p1/s2` when the job trains several pipelines."""
    return str(entry.index) if entry.pipeline is None else f"p{entry.pipeline}/s{entry.index}"


def running_verdict(
    stages: list[StageStatus],
    waiting: Mapping[tuple[int, int], str] | None = None,
    *,
    stuck: Mapping[tuple[int, int], tuple[str, str]] | None = None,
) -> Verdict:
    """Phase and conditions of a started job from its stage entries. `waiting`: stages
    (pipeline, stage) whose pod waits on a full pool because no eligible node had a free
    GPU, and why. `stuck`: stages whose container waits on what it will not get by itself
    (a missing Secret, an image that cannot be pulled), with the reason and message."""
    total = len(stages)
    running = [s for s in stages if s.phase == "Running"]
    phase = "Recovering" if any(s.restarts for s in stages) else "Pending"
    if waiting:
        first = min(waiting)
        return Verdict(phase, False, False, "Unschedulable", waiting[first])
    if stuck:
        reason, message = stuck[min(stuck)]
        return Verdict(phase, False, False, reason, message)
    recovering = [
        stage_name(s)
        for s in stages
        if s.phase == REPLACING or (s.restarts and s.phase != "Running")
    ]
    if recovering:
        return Verdict(
            "Recovering",
            False,
            True,
            "StageRestarting",
            f"Replacing stage {', '.join(recovering)}; the pipeline resumes from the "
            f"last committed checkpoint.",
        )
    if total and len(running) == total:
        return Verdict("Running", True, True, "StagesRunning", f"All {total} stages are running.")
    return Verdict(
        "Pending", False, True, "StagesStarting", f"{len(running)}/{total} stages are running."
    )


def _recovering(stage: StageStatus) -> bool:
    return stage.phase == REPLACING or bool(stage.restarts and stage.phase != "Running")


def short_of(plan: PlanStatus, out: int, wanted: int) -> bool:
    """Whether a job of a fixed count of `wanted` pipelines trains fewer than that with `out`
    of its planned pipelines out of the job."""
    return len(plan.splits()) - out < wanted


def pipeline_statuses(
    plan: PlanStatus,
    stages: list[StageStatus],
    out: set[int],
    previous: Sequence[PipelineStatus] | None = None,
) -> list[PipelineStatus] | None:
    """status.pipelines of a job that trains several (None for one): each pipeline's
    phase, ready stages, restarts and planned share, and its life as `previous` recorded it
    (left and returned). A pipeline `out` is Left when `previous` says so, else Failed."""
    if not plan.pipelines:
        return None
    before = {p.index: p for p in previous or ()}
    result = []
    for planned in plan.pipelines:
        mine = [s for s in stages if s.pipeline == planned.index]
        old = before.get(planned.index)
        phase: PipelinePhase
        if planned.index in out:
            phase = "Left" if old is not None and old.phase == "Left" else "Failed"
        elif mine and all(s.phase == "Running" for s in mine):
            phase = "Running"
        elif mine and all(s.phase == "Succeeded" for s in mine):
            phase = "Succeeded"
        elif any(_recovering(s) for s in mine):
            phase = "Recovering"
        else:
            phase = "Pending"
        life = old.model_dump(include=set(LIFE_FIELDS)) if old is not None else {}
        result.append(
            PipelineStatus(
                index=planned.index,
                phase=phase,
                ready_stages=f"{sum(1 for s in mine if s.ready)}/{len(planned.stages)}",
                restarts=sum(s.restarts for s in mine),
                micro_batches=planned.micro_batches,
                **life,
            )
        )
    return result


def fleet_verdict(
    stages: list[StageStatus],
    pipelines: list[PipelineStatus] | None,
    waiting: Mapping[tuple[int, int], str] | None = None,
    *,
    stuck: Mapping[tuple[int, int], tuple[str, str]] | None = None,
) -> Verdict:
    """Phase and conditions of a started job: `running_verdict` for one pipeline. With
    several, the job is Running while any pipeline trains, Degraded while another is out
    (recovering, or given up; a stage that cannot start its container says why); with
    none training, the live pipelines' stages decide as for one pipeline. A pipeline
    retired (left for good, another added in its place) is no longer the job's: it neither
    degrades it nor counts, unless every pipeline is."""
    if not pipelines:
        return running_verdict(stages, waiting, stuck=stuck)
    stages, pipelines = _current(stages, pipelines)
    failed = {p.index for p in pipelines if p.phase in OUT_PHASES}
    training = [p for p in pipelines if p.phase == "Running"]
    out = [p for p in pipelines if p.phase != "Running"]
    if len(failed) == len(pipelines):  # only when the last left with its nodes
        return Verdict(
            "Suspended",
            False,
            False,
            "FleetGone",
            "Every pipeline left (" + "; ".join(_out_why(p) for p in pipelines) + "): the job "
            "waits with its last commit and resumes from it when its stages fit on free GPUs.",
            degraded=True,
        )
    if not training:
        live = [s for s in stages if s.pipeline not in failed]
        waits = {k: why for k, why in (waiting or {}).items() if k[0] not in failed}
        blocked = {k: why for k, why in (stuck or {}).items() if k[0] not in failed}
        return replace(running_verdict(live, waits, stuck=blocked), degraded=bool(failed))
    total = len(pipelines)
    if not out:
        return Verdict(
            "Running",
            True,
            True,
            "StagesRunning",
            f"All {total} pipelines ({len(stages)} stages) are training.",
            degraded=False,
        )
    why = "; ".join(_out_why(p) for p in out)
    if stuck:  # the first stage that cannot start says why its pipeline waits
        why += f": {stuck[min(stuck)][1]}"
    return Verdict(
        "Running",
        True,
        True,
        "PipelinesDegraded",
        f"{len(training)}/{total} pipelines are training ({why}); the others train on "
        f"with the step's micro-batches shared among them.",
        degraded=True,
    )


def _out_why(p: PipelineStatus) -> str:
    """Why pipeline `p` does not train, in a few words."""
    if p.phase == "Left":
        return f"pipeline {p.index} left" + (f": {p.left_reason}" if p.left_reason else "")
    return f"pipeline {p.index} is {'given up' if p.phase == 'Failed' else p.phase.lower()}"


def _current(
    stages: list[StageStatus], pipelines: list[PipelineStatus]
) -> tuple[list[StageStatus], list[PipelineStatus]]:
    """The stages and pipelines that are still the job's: all but those of the pipelines
    retired, unless every pipeline is."""
    retired = {p.index for p in pipelines if p.retired}
    if len(retired) == len(pipelines):
        return stages, pipelines
    return (
        [s for s in stages if s.pipeline not in retired],
        [p for p in pipelines if p.index not in retired],
    )


def finalize(status: FineTuneJobStatus) -> FineTuneJobStatus:
    """The printer fields derived from the stages: restarts (every stage's, those of a
    retired pipeline included), readyStages and, with several pipelines, readyPipelines
    (of those still the job's: `_current`)."""
    stages = status.stages
    update: dict[str, Any] = {"restarts": sum(s.restarts for s in stages)}
    pipelines = status.pipelines or []
    if pipelines:
        stages, pipelines = _current(stages, pipelines)
        training = sum(1 for p in pipelines if p.phase == "Running")
        update["ready_pipelines"] = f"{training}/{len(pipelines)}"
    if stages:
        update["ready_stages"] = f"{sum(1 for s in stages if s.ready)}/{len(stages)}"
    return status.model_copy(update=update)


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> JsonDict:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: the fields of `new` that
    differ, an object in both diffed the same way (a merge keeps the fields a patch leaves
    out, so a nested field removed must be named), and removed fields mapped to None (the
    merge deletes them). Lists are replaced whole, as a merge does."""
    patch: JsonDict = {}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(before, Mapping) and isinstance(value, Mapping):
            patch[key] = changes(before, value)
        else:
            patch[key] = value
    for key in old:
        if key not in new and key != "kopf":
            patch[key] = None
    return patch
