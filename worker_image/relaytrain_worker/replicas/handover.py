"""A live stage's state handed to a rejoining peer, by parameter name (docs/worker.md,
"Several pipelines as processes": rejoin). At the step boundary that admits a pipeline,
each stage of the lowest pipeline that stayed sends each rejoining peer the weights, AdamW
state and schedule of the names that peer holds (`state_frame`); the peer takes them from
the frames of the stages that together hold its names (`load_state_frames`): the two
pipelines' splits may differ.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from relaytrain_worker.model.training import load_merged_state, named_optimizer_state
from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.transport import Frame

STATE = "replica_state"
"""Frame kind: a live stage's weights and optimizer state for a rejoining peer."""
STATE_KEY = "relaytrain.state"
"""The serialised optimizer and schedule state in a `STATE` frame (no parameter's name)."""


def state_frame(
    step: int,
    trainable: Sequence[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    names: Iterable[str],
) -> Frame:
    """This stage's state of `names` at the boundary before `step`: the weights (copies:
    the frame is encoded later, after this stage has trained on) and, serialised under
    `STATE_KEY`, their AdamW state by name and the schedule."""
    wanted = set(names)
    tensors = {n: p.detach().clone() for n, p in trainable if n in wanted}
    named = named_optimizer_state(optimizer, [n for n, _ in trainable])
    part = {"group": named["group"], "state": {n: v for n, v in named["state"].items()
                                                if n in wanted}}  # fmt: skip
    buf = io.BytesIO()
    torch.save({"optimizer_by_name": part, "scheduler": scheduler.state_dict()}, buf)
    tensors[STATE_KEY] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return Frame(STATE, step, -1, tensors)


def load_state_frames(
    frames: Sequence[Frame],
    trainable: Sequence[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Take the weights and optimizer state of every trainable name from `frames` (of the
    stages that together hold them); LinkBroken when a name is in none of them."""
    weights: dict[str, torch.Tensor] = {}
    parts = []
    for frame in frames:
        parts.append(bytes(frame.tensors[STATE_KEY].numpy()))
        weights.update({n: t for n, t in frame.tensors.items() if n != STATE_KEY})
    names = [n for n, _ in trainable]
    missing = [n for n in names if n not in weights]
    if missing:
        raise LinkBroken(f"the live peers sent no {missing[0]} (and {len(missing) - 1} more)")
    with torch.no_grad():
        for name, param in trainable:
            param.copy_(weights[name])
    load_merged_state(parts, optimizer, scheduler, names)
    optimizer.zero_grad(set_to_none=True)
