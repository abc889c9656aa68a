"""The order a stage runs a step's micro-batches in: 1F1B, with forwards run ahead of it.

Pure, and apart from `schedule.py`'s torch, so that what times a step without running one
(bench/pipeline_time.py) plays the worker's own order.
"""

from __future__ import annotations


def one_f_one_b(
    stage_index: int, stages: int, micro_batches: int, ahead: int = 0
) -> list[tuple[str, int]]:
    """The order of ("F"|"B", micro) this stage runs in one step. ``ahead``: forwards every
    stage but the last runs before its first backward on top of 1F1B's (the backwards keep
    micro-batch order, so the gradients are the same bits)."""
    extra = ahead if stage_index < stages - 1 else 0
    warmup = min(stages - stage_index - 1 + extra, micro_batches)
    order: list[tuple[str, int]] = [("F", m) for m in range(warmup)]
    backward = 0
    for m in range(warmup, micro_batches):
        order.append(("F", m))
        order.append(("B", backward))
        backward += 1
    order.extend(("B", m) for m in range(backward, micro_batches))
    return order
