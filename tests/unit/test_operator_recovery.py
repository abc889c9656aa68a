"""Which stage pods to keep, create or replace, and where a replacement goes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from relaytrain_operator.domain import recovery
from relaytrain_operator.domain.placement import PoolRoom, choose_pool, free_nodes, pool_rooms
from relaytrain_operator.domain.recovery import (
    INCARNATION_ANNOTATION,
    REPLACING,
    StageDecision,
    StageRecord,
)

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
READY_NODE = {
    "metadata": {"name": "n1"},
    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
}
NOT_READY = {
    "metadata": {"name": "n1"},
    "status": {
        "conditions": [
            {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-22T09:59:00Z"}
        ]
    },
}


def decide(
    record: StageRecord,
    pod: dict[str, Any] | None,
    node: dict[str, Any] | None,
    grace: float = 30,
) -> StageDecision:
    return recovery.decide(record, pod, node, now=NOW, node_grace=timedelta(seconds=grace))


def pod(
    phase: str = "Running",
    incarnation: int = 0,
    node: str | None = "n1",
    deleting: bool = False,
    reason: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": "j-stage-0",
        "uid": "u",
        "annotations": {INCARNATION_ANNOTATION: str(incarnation)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T00:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if reason:
        status["reason"] = reason
    return {"metadata": meta, "spec": {"nodeName": node}, "status": status}


def test_a_healthy_pod_is_kept() -> None:
    assert decide(StageRecord(0, phase="Running"), pod(), READY_NODE) == StageDecision("keep")


def test_a_stage_never_started_is_created_without_counting_a_failure() -> None:
    assert decide(StageRecord(0), None, None) == StageDecision("create")
    assert decide(StageRecord(0, restarts=1, phase=REPLACING), None, None) == StageDecision(
        "create"
    )


def test_a_pod_deleted_by_someone_else_counts_as_a_failure() -> None:
    assert decide(StageRecord(0, phase="Running"), None, None) == StageDecision(
        "create", failure="Deleted"
    )


@pytest.mark.parametrize("reason", [None, "Evicted", "OOMKilled"])
def test_a_failed_pod_of_the_current_incarnation_is_counted_and_deleted(reason: str | None) -> None:
    decision = decide(StageRecord(0, phase="Running"), pod("Failed", reason=reason), READY_NODE)
    assert decision == StageDecision("delete", failure=reason or "Failed")


def test_a_failed_pod_already_counted_is_deleted_without_counting_again() -> None:
    # The count moved to 1 (restart recorded) before the delete; the operator died between.
    record = StageRecord(0, restarts=1, phase=REPLACING)
    assert decide(record, pod("Failed", incarnation=0), READY_NODE) == StageDecision("delete")


def test_a_successor_that_fails_before_it_was_seen_is_still_counted() -> None:
    record = StageRecord(0, restarts=1, phase=REPLACING)
    decision = decide(record, pod("Failed", incarnation=1), READY_NODE)
    assert decision.failure == "Failed"


def test_a_pod_whose_node_is_gone_or_not_ready_is_force_deleted() -> None:
    for node in (None, NOT_READY):
        decision = decide(StageRecord(0, phase="Running"), pod(), node)
        assert decision == StageDecision("delete", failure="NodeLost", force=True)


def test_a_short_not_ready_blip_is_no_node_loss() -> None:
    # NotReady for 60 s; with a grace of 5 minutes the stage keeps its pod.
    assert decide(StageRecord(0, phase="Running"), pod(), NOT_READY, grace=300) == (
        StageDecision("keep")
    )
    cordoned = {**READY_NODE, "spec": {"unschedulable": True}}
    assert decide(StageRecord(0, phase="Running"), pod(), cordoned) == StageDecision("keep")


def test_a_terminating_pod_is_waited_for_and_counted_once() -> None:
    first = decide(StageRecord(0, phase="Running"), pod(deleting=True), READY_NODE)
    assert first == StageDecision("wait", failure="Deleted")
    again = decide(StageRecord(0, restarts=1, phase=REPLACING), pod(deleting=True), READY_NODE)
    assert again == StageDecision("wait")
    # A pod still terminating from before a suspension is no failure.
    assert decide(StageRecord(0), pod(deleting=True), READY_NODE) == StageDecision("wait")


def node(name: str, pool: str, gpus: int, memory: int, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"nvidia.com/gpu.product": pool, "nvidia.com/gpu.memory": str(memory)},
        },
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def gpu_pod(
    node_name: str | None, job: str = "other", pool: str | None = None, phase: str = "Running"
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ns", "labels": {"relaytrain.io/job": job}}
    if pool:
        meta["annotations"] = {"relaytrain.io/pool": pool}
    return {
        "metadata": meta,
        "status": {"phase": phase},
        "spec": {
            "nodeName": node_name,
            "containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
        },
    }


def test_free_gpus_exclude_what_other_pods_hold() -> None:
    nodes = [
        node("a", "A100", 2, 40960),
        node("b", "A100", 1, 40960),
        node("c", "H100", 1, 81559, ready=False),
    ]
    pods = [
        gpu_pod("a"),
        gpu_pod("b", job="mine"),
        gpu_pod("a", phase="Succeeded"),
        gpu_pod(None, pool="A100"),
    ]
    free = free_nodes(nodes, pods, "nvidia.com/gpu.product", exclude_job=("ns", "mine"))
    # a: 2 - 1 bound; b: 1 (its pod is the job's own); the unbound pod pinned to A100
    # takes one more; c is not ready.
    rooms = pool_rooms(free, "nvidia.com/gpu.product")
    assert rooms == {"A100": PoolRoom(free_gpus=1, memory_mib=40960)}


def test_a_replacement_stays_on_its_pool_when_it_has_room() -> None:
    rooms = {"A100": PoolRoom(1, 40960), "H100": PoolRoom(4, 81559)}
    assert choose_pool("A100", 30000, rooms) == "A100"


def test_a_replacement_moves_to_the_smallest_pool_whose_memory_fits() -> None:
    rooms = {
        "A100": PoolRoom(0, 40960),
        "RTX4090": PoolRoom(3, 24564),
        "L40": PoolRoom(1, 46068),
        "H100": PoolRoom(2, 81559),
    }
    assert choose_pool("A100", 30000, rooms) == "L40"
    # Pools the job may not use are not in `rooms` at all (placement.place_replacements
    # builds them from the job's eligible nodes only): with L40 and the RTX 4090s left out,
    # the H100 takes it.
    allowed = {pool: room for pool, room in rooms.items() if pool in ("A100", "H100")}
    assert choose_pool("A100", 30000, allowed) == "H100"
    # Nowhere fits: it waits on its own pool.
    assert choose_pool("A100", 90000, rooms) == "A100"


def test_odd_inputs_are_read_safely() -> None:
    garbled = pod()
    garbled["metadata"]["annotations"][INCARNATION_ANNOTATION] = "x"
    assert recovery.incarnation(garbled) == 0
    # A NotReady node with an unreadable transition time is lost; one that reports no
    # Ready condition at all is not (nothing says it went away).
    bad_time = {
        "status": {
            "conditions": [
                {"type": "DiskPressure", "status": "False"},
                {"type": "Ready", "status": "False", "lastTransitionTime": "yesterday"},
            ]
        }
    }
    assert recovery.node_lost(bad_time, NOW, timedelta(seconds=30))
    assert not recovery.node_lost({"status": {}}, NOW, timedelta(seconds=30))


def test_a_past_incarnation_still_running_is_replaced_without_counting() -> None:
    record = StageRecord(0, restarts=1, phase=REPLACING)
    assert decide(record, pod(incarnation=0), READY_NODE) == StageDecision("delete")


def test_a_terminating_pod_on_a_lost_node_is_force_deleted_and_counted_once() -> None:
    first = decide(StageRecord(0, phase="Running"), pod(deleting=True), None)
    assert first == StageDecision("delete", failure="NodeLost", force=True)
    again = decide(StageRecord(0, restarts=1, phase=REPLACING), pod(deleting=True), None)
    assert again == StageDecision("delete", force=True)
    failed_again = decide(StageRecord(0, restarts=1, phase=REPLACING), pod(incarnation=0), None)
    assert failed_again == StageDecision("delete", force=True)


def _ended(code: Any, message: str | None = None, incarnation: int = 0) -> dict[str, Any]:
    failed = pod("Failed", incarnation=incarnation)
    terminated: dict[str, Any] = {"exitCode": code, "reason": "Error"}
    if message is not None:
        terminated["message"] = message
    failed["status"]["containerStatuses"] = [
        {"name": "worker", "state": {"terminated": terminated}}
    ]
    return failed


def test_a_non_retryable_exit_of_the_current_pod_is_fatal_with_the_stage_s_words() -> None:
    verdict = decide(StageRecord(0, phase="Running"), _ended(3, " no records\n"), READY_NODE)
    assert (verdict.action, verdict.failure) == ("delete", "Failed")
    assert (verdict.fatal, verdict.message) == ("InvalidInput", "no records")
    # A crash, a link refused, an exit code that is no number: restarted as before.
    for code in (1, 4, 137, "3", None):
        plain = decide(StageRecord(0, phase="Running"), _ended(code), READY_NODE)
        assert (plain.failure, plain.fatal) == ("Failed", None), code
    # A past incarnation's exit was judged when it happened: it is only deleted.
    past = decide(StageRecord(0, restarts=1, phase=REPLACING), _ended(3), READY_NODE)
    assert past == StageDecision("delete")


def test_a_pod_still_running_has_no_exit() -> None:
    assert recovery.stage_exit(pod()) == (None, "")
    waiting = pod("Pending")
    waiting["status"]["containerStatuses"] = [{"name": "worker", "state": {"waiting": {}}}]
    assert recovery.stage_exit(waiting) == (None, "")
