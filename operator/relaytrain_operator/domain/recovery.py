"""What to do with each stage's pod: keep it, create it, or replace it (pure).

The decision reads only what the cluster holds, so a restarted operator decides the same:
the stage pods (with the `relaytrain.io/incarnation` annotation each carries), their
nodes, and `status.stages` (restart counts and whether a successor is due).

Incarnations make restart counting exact across operator restarts. A stage's pod is
created with incarnation = the stage's restart count at that moment. When a pod of the
current incarnation fails, the failure is new: count it (restarts + 1, which also makes
the failed pod a past incarnation), then delete the pod. A pod of a past incarnation was
already counted and is only deleted. So a crash between counting and deleting can
neither count twice nor lose the failure.

A pod that is missing (or terminating) is either not created yet (its stage status says
`Replacing`, or has no phase: never started, or suspended) or was deleted by someone else
(its stage status shows it was seen alive), which counts as a failure of its own.

The failure policy itself (how many restarts `failurePolicy.maxStageRestarts` allows, and
when `failurePolicy.backoffSeconds` lets a successor start) is two small functions,
`after_failure` and `backoff_left`, shared by the operator (`decide`) and the local
supervisor of `relaytrain run --local` (`local_run`), so both apply the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from relaytrain_contract.exits import non_retryable

INCARNATION_ANNOTATION = "relaytrain.io/incarnation"
REPLACING = "Replacing"
"""Stage phase while its successor pod is due (the failure is counted)."""

JsonDict = dict[str, Any]
Action = Literal["keep", "create", "delete", "wait"]


@dataclass(frozen=True)
class StageRecord:
    """What status.stages says of one stage."""

    index: int
    restarts: int = 0
    phase: str | None = None
    pool: str | None = None


@dataclass(frozen=True)
class StageDecision:
    """The verdict for one stage."""

    action: Action
    """keep: leave the pod; create: create its (successor) pod; delete: delete the pod
    (an old incarnation or a failed one); wait: the pod is terminating, do nothing yet."""
    failure: str | None = None
    """Set when a new failure of this stage was seen: why (Failed, Evicted, Deleted,
    NodeLost). The caller counts it (or fails the job when the policy allows no more)."""
    force: bool = False
    """Delete without grace: the pod's node is gone or not ready, no kubelet will confirm."""
    fatal: str | None = None
    """Set with `failure` when the stage exited with a code no restart can help
    (relaytrain_contract.exits.NON_RETRYABLE): the job condition's reason. The caller fails
    the job at once instead of counting a restart."""
    message: str = ""
    """The stage's termination message (its own words on why it stopped), if it left one."""


def after_failure(restarts: int, max_restarts: int) -> int | None:
    """A stage failed (again) after `restarts` restarts: its restart count once this failure
    is counted, or None when `failurePolicy.maxStageRestarts` (`max_restarts`) allows no more
    and the job fails."""
    if restarts >= max_restarts:
        return None
    return restarts + 1


def backoff_left(
    restarts: int, failed_at: datetime | None, now: datetime, backoff: timedelta
) -> timedelta:
    """How long a stage's successor must still wait (zero: start it now).

    The first start of a stage (`restarts` 0) never waits; a successor waits `backoff`
    (`failurePolicy.backoffSeconds`) from `failed_at`, when the failure was counted. An
    unknown failure time with a back-off waits the whole back-off."""
    if restarts == 0 or not backoff:
        return timedelta(0)
    if failed_at is None:
        return backoff
    return max(timedelta(0), backoff - (now - failed_at))


def incarnation(pod: JsonDict) -> int:
    """The restart count a pod was created at (0 for a pod without the annotation)."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(INCARNATION_ANNOTATION, "0")
    try:
        return int(raw)
    except ValueError:
        return 0


def node_lost(node: JsonDict | None, now: datetime, grace: timedelta) -> bool:
    """The node is gone, or has not been Ready for `grace` (a short blip is no loss:
    replacing a stage costs a checkpoint restore)."""
    if node is None:
        return True
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") != "Ready":
            continue
        if condition.get("status") == "True":
            return False
        raw = condition.get("lastTransitionTime")
        try:
            since = datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
        except ValueError:
            return True
        return now - since >= grace
    return False


def stage_exit(pod: JsonDict) -> tuple[int | None, str]:
    """How the stage's container ended, from the pod's status: its exit code (None while it
    has not ended) and its termination message, stripped ("" when it left none)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            code = terminated.get("exitCode")
            message = str(terminated.get("message") or "").strip()
            return (code if isinstance(code, int) else None), message
    return None, ""


STUCK_REASONS = {
    "CreateContainerConfigError": "CreateContainerConfigError",
    "CreateContainerError": "CreateContainerError",
    "InvalidImageName": "InvalidImageName",
    "ErrImagePull": "ImagePullBackOff",
    "ImagePullBackOff": "ImagePullBackOff",
    "ErrImageNeverPull": "ImagePullBackOff",
}
"""The kubelet's reasons for a container that waits and will not start by itself (a
missing Secret, an image it cannot pull), and the job condition's reason for each: a pull's
two alternating reasons are one, so the condition does not flip on every back-off."""


def stuck(pod: JsonDict) -> tuple[str, str] | None:
    """(reason, what the kubelet says) when the pod's container waits on something it will
    not get by itself (`STUCK_REASONS`); None otherwise. A pull names the image: the
    registry's answer varies from try to try and is in the pod's Events."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        reason = STUCK_REASONS.get(str(waiting.get("reason")))
        if reason == "ImagePullBackOff":
            return reason, (
                f"the kubelet cannot pull image {status.get('image')!r} (its Events on the "
                "pod say why; a private registry needs imagePullSecrets)"
            )
        if reason is not None:
            return reason, str(waiting.get("message") or "").strip()
    return None


def pod_failure(
    pod: JsonDict, node: JsonDict | None, now: datetime, grace: timedelta
) -> str | None:
    """Why a live (not terminating) pod counts as failed, or None if it is fine."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return str(status.get("reason") or "Failed")
    node_name = (pod.get("spec") or {}).get("nodeName")
    if node_name and node_lost(node, now, grace):
        return "NodeLost"
    return None


def decide(
    record: StageRecord,
    pod: JsonDict | None,
    node: JsonDict | None,
    *,
    now: datetime,
    node_grace: timedelta = timedelta(0),
) -> StageDecision:
    """Decide what to do with one stage, given its pod (None if absent) and that pod's node
    (None if the pod is unscheduled or its node is gone). A node NotReady for
    `node_grace` counts as lost."""
    seen_alive = record.phase not in (None, REPLACING)
    if pod is None:
        return StageDecision("create", failure="Deleted" if seen_alive else None)
    current = incarnation(pod) >= record.restarts
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        # Someone (a drain, the eviction API, a person) is deleting the current pod: a
        # failure; we wait for it to go before its successor may start.
        # On a lost node no kubelet will finish the deletion: force it.
        lost = pod_failure(pod, node, now, node_grace) == "NodeLost"
        action: Action = "delete" if lost else "wait"
        if current and seen_alive:
            return StageDecision(action, failure="NodeLost" if lost else "Deleted", force=lost)
        return StageDecision(action, force=lost)
    failure = pod_failure(pod, node, now, node_grace)
    if failure is None:
        if current:
            return StageDecision("keep")
        # A past incarnation that still runs cannot happen unless the count moved on
        # without it (a failure recorded, then the pod recovered): replace it anyway, it
        # was already counted.
        return StageDecision("delete")
    force = failure == "NodeLost"
    if current:
        code, message = stage_exit(pod)
        fatal = non_retryable(code)
        return StageDecision("delete", failure=failure, force=force, fatal=fatal, message=message)
    return StageDecision("delete", force=force)
