"""The job's status, computed (pure): phase, conditions, stages, and what changed.

The operator reads the stored status into the typed model of
`relaytrain_operator.spec.status` (the CRD's status schema, so every field it writes is one
the CRD declares), computes the whole status it wants as that model, and patches only the
top-level fields that differ from what is stored — no write when nothing changed, so a
quiet job costs the API server nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from relaytrain_operator.recovery import REPLACING
from relaytrain_operator.spec import Condition, FineTuneJobStatus, StageStatus, status_patch

JsonDict = dict[str, Any]

READY = "Ready"
PROGRESSING = "Progressing"

# Reasons after which nothing more happens to the job (an InvalidSpec "Failed" is not
# one: a corrected spec clears it).
TERMINAL_REASONS = ("Succeeded", "BackoffLimitExceeded")


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
    """`status` with phase, both conditions and observedGeneration from `verdict`."""
    conditions = list(status.conditions)
    for kind, value in ((READY, verdict.ready), (PROGRESSING, verdict.progressing)):
        conditions = set_condition(
            conditions,
            kind,
            value,
            reason=verdict.reason,
            message=verdict.message,
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
        pool=entry.pool,
        restarts=entry.restarts,
        last_failure=entry.last_failure,
        restored_from_step=entry.restored_from_step,
    )


def running_verdict(stages: list[StageStatus], waiting: Mapping[int, str] | None = None) -> Verdict:
    """Phase and conditions of a started job from its stage entries. `waiting`: stages
    whose pod waits on a full pool because no eligible node had a free GPU, and why."""
    total = len(stages)
    running = [s for s in stages if s.phase == "Running"]
    if waiting:
        first = min(waiting)
        return Verdict(
            "Recovering" if any(s.restarts for s in stages) else "Pending",
            False,
            False,
            "Unschedulable",
            waiting[first],
        )
    recovering = sorted(
        {s.index for s in stages if s.phase == REPLACING or (s.restarts and s.phase != "Running")}
    )
    if recovering:
        return Verdict(
            "Recovering",
            False,
            True,
            "StageRestarting",
            f"Replacing stage {', '.join(map(str, recovering))}; the pipeline resumes from the "
            f"last committed checkpoint.",
        )
    if total and len(running) == total:
        return Verdict("Running", True, True, "StagesRunning", f"All {total} stages are running.")
    return Verdict(
        "Pending", False, True, "StagesStarting", f"{len(running)}/{total} stages are running."
    )


def finalize(status: FineTuneJobStatus) -> FineTuneJobStatus:
    """The printer fields derived from the stages: restarts and readyStages."""
    stages = status.stages
    update: dict[str, Any] = {"restarts": sum(s.restarts for s in stages)}
    if stages:
        update["ready_stages"] = f"{sum(1 for s in stages if s.ready)}/{len(stages)}"
    return status.model_copy(update=update)


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> JsonDict:
    """The top-level fields of `new` that differ from `old`; removed ones map to None
    (a JSON merge patch deletes them)."""
    patch: JsonDict = {key: value for key, value in new.items() if old.get(key) != value}
    for key in old:
        if key not in new and key != "kopf":
            patch[key] = None
    return patch
