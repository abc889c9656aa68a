"""What a pipeline's step may exchange with other pipelines: the step's statistics.

One pipeline trains alone with none of this. With several (`replicas/`), the schedule
(`schedule.StepRunner`) is given a `ReplicaGroup` and hands it, by name, what the whole step
must agree on: stage 0 its share's label-token count, every stage its gradients, and the
last stage the step's statistics under the keys below (no parameter has these names). The
group folds every pipeline's values in pipeline order (`replicas/arithmetic.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

LOSS_KEY = "relaytrain.loss_sum"
"""The last stage's float64 summed token loss, reduced with the gradients (no parameter
has this name)."""
TOKENS_KEY = "relaytrain.input_tokens"
"""The last stage's non-padding input tokens of the step (float64), reduced with the
gradients so that every pipeline's last stage knows the whole step's (for tokens/s)."""
ITEMS_KEY = "relaytrain.loss_items"
"""The last stage's label tokens of its pipeline's share (float64), reduced with the loss
sum in periodic mode, where each pipeline's loss is normalised by its own share."""

STATS = "stats"
"""The exchange of the last stages alone (periodic mode's loss and counts, every step)."""
GRADS = "grads"
"""The exchange of a synchronous step's gradients (and the last stage's loss and counts).
Its contributions are stacks of terms (`TERMS`)."""
OUTER_CODES = "outer-codes"
"""The exchange of a periodic outer step's low-bit codes (`replicas/outer_codec.py`)."""
TERMS = frozenset({GRADS})
"""The exchanges whose contributions are stacks of terms: each tensor's leading dimension
lists terms in the pipeline's micro-batch order (a stage that accumulated its micro-batches
gives a stack of one), and the fold adds every term of every pipeline in turn
(`replicas/arithmetic.py`, `fold`). In the other exchanges a contribution is one term."""
GATHERS = frozenset({OUTER_CODES})
"""The exchanges whose result is not a sum but every contribution as given, stacked in
pipeline order (`replicas/arithmetic.py`, `gather`): codes that cannot be added, which
every pipeline decodes and folds itself in the same order."""


class ReplicaGroup(Protocol):
    """How the stages of R pipelines exchange what a step must agree on."""

    @property
    def pipelines(self) -> int:
        """R, the number of pipelines (replicas)."""
        ...

    def total_tokens(self, step: int, pipeline: int, count: int) -> int:
        """Stage 0 of `pipeline` gives its share's label tokens; returns the global count."""
        ...

    def reduce(
        self,
        step: int,
        pipeline: int,
        stage: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        what: str = GRADS,
    ) -> dict[str, torch.Tensor]:
        """Stage `stage` of `pipeline` gives its contributions by name; returns, for each of
        those names, the fold of every pipeline's contribution in pipeline order
        (`reduce_sum`, replicas/arithmetic.py; in `TERMS` exchanges, term by term).
        Contributions are not written to. `what` names the exchange: every stage of every
        pipeline makes one of each per step (`grads`: the step's gradients; `outer`: a
        periodic outer step's weights, replicas/periodic.py)."""
        ...

    def short(self, step: int) -> bool:
        """Whether a gradient result of `step` this stage got misses a member pipeline's
        contribution (it left in the middle of the step): the step is then redone."""
        ...

    @property
    def first_member(self) -> int:
        """The lowest pipeline training the current step: its contributions open every
        fold, so its stages may accumulate their micro-batches (a stack of one term)."""
        ...
