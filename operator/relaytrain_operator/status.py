"""The job's status, computed (pure): phase, conditions, stages, and what changed.

The operator builds the whole status it wants, validates it against the status model of
`relaytrain_operator.spec.status` (so every field it writes is one the CRD declares), and
patches only the top-level fields that differ from what is stored — no write when nothing
changed, so a quiet job costs the API server nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from relaytrain_operator.recovery import REPLACING
from relaytrain_operator.spec import FineTuneJobStatus, status_patch

JsonDict = dict[str, Any]

READY = "Ready"
PROGRESSING = "Progressing"

# Phases after which nothing more happens to the job (except an InvalidSpec "Failed",
# which a corrected spec clears: see `is_terminal`).
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


def condition(status: JsonDict, kind: str) -> JsonDict | None:
    """The stored condition of type `kind`, if any."""
    for entry in status.get("conditions") or []:
        if entry.get("type") == kind:
            return dict(entry)
    return None


def is_terminal(status: JsonDict) -> bool:
    """Succeeded, or Failed for good (restarts exhausted): the job is over."""
    ready = condition(status, READY) or {}
    return status.get("phase") in ("Succeeded", "Failed") and ready.get("reason") in (
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
    conditions: list[JsonDict],
    kind: str,
    value: bool,
    *,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[JsonDict]:
    """Conditions with `kind` set; lastTransitionTime moves only when the status flips."""
    status = "True" if value else "False"
    old = next((c for c in conditions if c.get("type") == kind), None)
    moved = old is None or old.get("status") != status
    entry: JsonDict = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": rfc3339(now) if moved else old["lastTransitionTime"],  # type: ignore[index]
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    return [c for c in conditions if c.get("type") != kind] + [entry]


def with_verdict(
    status: JsonDict, verdict: Verdict, now: datetime, generation: int | None
) -> JsonDict:
    """`status` with phase, both conditions and observedGeneration from `verdict`."""
    conditions = list(status.get("conditions") or [])
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
    result = dict(status)
    result["phase"] = verdict.phase
    result["conditions"] = sorted(conditions, key=lambda c: str(c["type"]))
    if generation is not None:
        result["observedGeneration"] = generation
    if verdict.phase in ("Succeeded", "Failed") and verdict.reason in TERMINAL_REASONS:
        result.setdefault("completionTime", rfc3339(now))
    return result


def stage_entry(
    index: int,
    pod: JsonDict | None,
    *,
    pool: str | None,
    restarts: int,
    phase: str | None = None,
    last_failure: str | None = None,
    restored_from_step: int | None = None,
) -> JsonDict:
    """One status.stages entry from the stage's pod as seen (or about to be created)."""
    entry: JsonDict = {"index": index, "restarts": restarts, "pool": pool, "ready": False}
    if pod is not None:
        meta = pod.get("metadata") or {}
        pod_status = pod.get("status") or {}
        entry["pod"] = meta.get("name")
        entry["node"] = (pod.get("spec") or {}).get("nodeName")
        entry["phase"] = pod_status.get("phase")
        entry["ready"] = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in pod_status.get("conditions") or []
        )
    if phase is not None:
        entry["phase"] = phase
    if last_failure is not None:
        entry["lastFailure"] = last_failure
    if restored_from_step is not None:
        entry["restoredFromStep"] = restored_from_step
    return {key: value for key, value in entry.items() if value is not None}


def running_verdict(stages: list[JsonDict]) -> Verdict:
    """Phase and conditions of a started job from its stage entries."""
    total = len(stages)
    running = [s for s in stages if s.get("phase") == "Running"]
    recovering = [s for s in stages if s.get("restarts", 0) > 0 and s.get("phase") != "Running"] + [
        s for s in stages if s.get("phase") == REPLACING
    ]
    if recovering:
        which = sorted({int(s["index"]) for s in recovering})
        return Verdict(
            "Recovering",
            False,
            True,
            "StageRestarting",
            f"Replacing stage {', '.join(map(str, which))}; the pipeline resumes from the "
            f"last committed checkpoint.",
        )
    if total and len(running) == total:
        return Verdict("Running", True, True, "StagesRunning", f"All {total} stages are running.")
    return Verdict(
        "Pending", False, True, "StagesStarting", f"{len(running)}/{total} stages are running."
    )


def ready_stages(stages: list[JsonDict]) -> str:
    """`ready/total` for the printer column."""
    return f"{sum(1 for s in stages if s.get('ready'))}/{len(stages)}"


def finalize(status: JsonDict) -> JsonDict:
    """Validate against the CRD's status model and normalise (camelCase, no nulls)."""
    stages = status.get("stages") or []
    status = {**status, "restarts": sum(int(s.get("restarts", 0)) for s in stages)}
    if stages:
        status["readyStages"] = ready_stages(stages)
    return status_patch(FineTuneJobStatus.model_validate(status))


def changes(old: JsonDict, new: JsonDict) -> JsonDict:
    """The top-level fields of `new` that differ from `old`; removed ones map to None
    (a JSON merge patch deletes them)."""
    patch: JsonDict = {key: value for key, value in new.items() if old.get(key) != value}
    for key in old:
        if key not in new and key != "kopf":
            patch[key] = None
    return patch
