"""The order a stage runs a step's micro-batches in: 1F1B, with forwards run ahead of it.

The worker runs it (`relaytrain_worker.pipeline.schedule`); the planner prices it: the
activations a stage holds (`in_flight`) and a step's time over slow links
(`relaytrain_operator.domain.planner.steptime`). Pure, so both play the same order.
"""

from __future__ import annotations

MAX_FORWARDS_AHEAD = 16
"""The most forwards a stage runs ahead of 1F1B (`pipeline.forwardsAhead`)."""


def warmup(stage_index: int, stages: int, ahead: int = 0) -> int:
    """The forwards this stage runs before its first backward, given enough micro-batches:
    1F1B's ``P - k - 1``, plus ``ahead`` on every stage but the last. Then it alternates a
    forward and a backward, and ends with the backwards left (`one_f_one_b`)."""
    extra = ahead if stage_index < stages - 1 else 0
    return stages - stage_index - 1 + extra


def one_f_one_b(
    stage_index: int, stages: int, micro_batches: int, ahead: int = 0
) -> list[tuple[str, int]]:
    """The order of ("F"|"B", micro) this stage runs in one step. ``ahead``: forwards every
    stage but the last runs before its first backward on top of 1F1B's (the backwards keep
    micro-batch order, so the gradients are the same bits)."""
    warm = min(warmup(stage_index, stages, ahead), micro_batches)
    order: list[tuple[str, int]] = [("F", m) for m in range(warm)]
    backward = 0
    for m in range(warm, micro_batches):
        order.append(("F", m))
        order.append(("B", backward))
        backward += 1
    order.extend(("B", m) for m in range(backward, micro_batches))
    return order


def in_flight(stage_index: int, stages: int, micro_batches: int, ahead: int = 0) -> int:
    """Micro-batches of activations the stage holds at most in `one_f_one_b`'s order: its
    forwards before the first backward (1F1B's ``P - k``, plus ``ahead`` on every stage but
    the last), never more than the step's micro-batches."""
    return min(warmup(stage_index, stages, ahead) + 1, micro_batches)
