"""Periodic synchronisation (`replicas.sync.mode: periodic`): the outer step.

In periodic mode every pipeline trains its share of each step as a step of its own: its
loss is normalised by its share's label tokens, it clips by its own global norm and takes
its own AdamW step; no gradient crosses the replica links. Every H steps (and after the
last step) an outer step makes every replica equal again:

    theta = sum_q w_q * theta_q / sum_q w_q

over the live pipelines q, where `w_q` is the label tokens pipeline q trained since the last
outer step (a pipeline that rejoined counts from its rejoin). Each trainable parameter
(LoRA or full) is reduced by name with the group's star (`ReplicaGroup.reduce`, exchange
`outer`), packed with its weight as one float64 vector ``[w_q * theta_q..., w_q]``: the
numerator and the denominator of a name travel and fold together, so even when a pipeline
leaves in the middle of an outer step every holder of a name divides the very sum it
folded, and all get the same bits (the fold order is fixed, pipeline order). Products and
sums are float64 (a float32 weight times a token count up to 2**29 is exact), so replicas
that are already equal stay exactly equal, and the result is rounded once to the
parameter's dtype. The outer step sends each stage's trainable weights in float64 once each
way every H steps: 2x the bytes of a float32 gradient reduce, H times less often.

Outer optimizer: plain averaging (outer learning rate 1, no momentum). DiLoCo's Nesterov
outer momentum (lr 0.7, momentum 0.9) was tuned for pre-training with H in the hundreds;
for fine-tuning with small H, averaging is the baseline whose H=1 case has an exact
statement (tests/unit/test_periodic_sync.py), it has no outer state to checkpoint or hand
to a rejoining pipeline, and it is bit-identical across replicas by construction.

With `sync.outerCode` int4, int2 or int1 an outer step sends, instead of the weights, each
pipeline's update since the last outer step as an error-fed, rotated low-bit code
(`outer_codec.py`), gathered (exchange `outer-codes`); every pipeline sets each weight to
the anchor (the weights of the last outer step, kept on the CPU in float32) plus the
token-weighted mean of every pipeline's decoded update, folded in pipeline order, so every
replica again holds the same bits. What its code left out stays in the pipeline's residual
and goes with its next update. The rotation differs per outer step (its step number). The
residual is not checkpointed: a restart loses at most one code's error, and checkpoints
are taken at outer steps, so the restored weights are the anchor. A pipeline that rejoins
takes the anchor with the weights from its live peer (`anchor_tensors`, `take_anchor`).

**The exact LoRA merge** (`exact=True`; `sync.loraMerge`, relaytrain_contract.lora_merge_of;
`model/lora_merge.py`): averaging B and A one by one does not average the pipelines' layers
(``mean(B) @ mean(A) != mean(B @ A)``), so every pipeline needs every pipeline's factors:
the outer step gathers (exchange `outer-codes`: the codes, or with `float64` the weights as
raw float64 bytes, `outer_codec.raw`), every pipeline sets B and A to their token-weighted
means and folds the rest of the mean of ``B_q @ A_q`` into the frozen weight (`Fold`), all
from the same bytes in the same order, so every replica's layer is the same bits and exactly
the mean of the pipelines' layers. Parameters that are no LoRA factor pair are averaged.

AdamW moments stay local: each pipeline's moments describe its own gradients, averaging
them would triple the outer step's bytes, and DiLoCo keeps the inner optimizer state per
worker too. Only the weights are equal after an outer step; pipeline 0's moments are the
ones checkpointed, and a rejoining pipeline takes a live peer's (`handover.state_frame`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from relaytrain_worker.model import lora_merge
from relaytrain_worker.model.methods import TIED_HEAD_NAME
from relaytrain_worker.pipeline.schedule import StepRunner
from relaytrain_worker.pipeline.stats import OUTER_CODES, ReplicaGroup
from relaytrain_worker.replicas import outer_codec

OUTER = "outer"
"""The `what` of an outer step's exchange (separate from a step's `grads`)."""
ANCHOR_PREFIX = "relaytrain.anchor:"
"""Handover tensors' prefix for the anchor of a coded outer step (no parameter's name)."""


def is_outer_step(step: int, every: int, total: int) -> bool:
    """Whether the boundary after `step` steps (1-based count) ends with an outer step:
    every `every` steps, and after the last step."""
    return step % every == 0 or step == total


class PeriodicSync:
    """One stage's side of periodic synchronisation in its step loop: counts the label
    tokens its pipeline trained since the last outer step and runs the outer step at every
    boundary that is due (`is_outer_step`, or `also(step)`: the stage adds its checkpoint
    and evaluation steps, so that a checkpoint and a held-out loss are of the job's averaged
    weights, not of pipeline 0's local ones).

    `trainable`: the (name, parameter) pairs the stage averages; `key` maps a name to its
    replica key. A stage that rejoins starts a new instance: it counts from its rejoin.
    """

    def __init__(
        self,
        group: ReplicaGroup,
        pipeline: int,
        stage: int,
        trainable: Sequence[tuple[str, nn.Parameter]],
        *,
        every: int,
        total: int,
        also: Callable[[int], bool] = lambda step: False,
        key: Callable[[str], str] = lambda name: name,
        code: str = "float64",
        fold: lora_merge.Fold | None = None,
        exact: bool = False,
    ) -> None:
        self.group, self.pipeline, self.stage = group, pipeline, stage
        self.fold = fold
        """What exact merges folded into the stage's frozen weights (handed to a rejoining
        peer whether or not this run merges exactly: a fold from before stays)."""
        self.pairs = _factor_pairs(trainable, fold) if exact and fold is not None else {}
        """Per LoRA layer merged exactly: the indices of its (B, A) in `trainable` (none:
        every parameter is averaged on its own)."""
        self.trainable = list(trainable)
        self.every, self.total, self.also, self.key = every, total, also, key
        self.weight = 0
        """Label tokens this pipeline trained since the last outer step."""
        self.bits = None if code == "float64" else outer_codec.bits_of(code)
        """Bits of the outer code; None: the weights themselves, in float64."""
        self.anchor: list[torch.Tensor] = []
        """Per trainable entry, its float32 CPU value after the last outer step (coded)."""
        self.residual: list[torch.Tensor] = []
        """Per trainable entry, what this pipeline's codes have left out so far (coded)."""
        if self.bits is not None:
            self.anchor = [
                p.detach().to("cpu", torch.float32, copy=True) for _, p in self.trainable
            ]
            self.residual = [torch.zeros_like(a) for a in self.anchor]

    @classmethod
    def of(
        cls,
        runner: StepRunner,
        group: ReplicaGroup,
        *,
        every: int,
        total: int,
        also: Callable[[int], bool] = lambda step: False,
        code: str = "float64",
        fold: lora_merge.Fold | None = None,
        exact: bool = False,
    ) -> PeriodicSync:
        """The periodic side of the stage that `runner` steps: its trainable parameters under
        their replica keys. A lone stage (first and last) of a tied model gives its shared
        weight under the head's key too: the other pipelines' last stages average their
        head copy under it, and both keys fold the same copies, so they agree bit for bit."""
        pairs = list(runner.trainable)
        if runner.tied_name is not None and runner.first and runner.last:
            tied = next(param for name, param in pairs if name == runner.tied_name)
            pairs.append((TIED_HEAD_NAME, tied))
        return cls(group, runner.pipeline, runner.index, pairs, every=every, total=total,
                   also=also, key=runner.replica_key, code=code, fold=fold,
                   exact=exact)  # fmt: skip

    def due(self, step: int) -> bool:
        return is_outer_step(step, self.every, self.total) or self.also(step)

    def after_step(self, step: int, tokens: int) -> bool:
        """After the optimizer step that completed `step` steps, having trained `tokens`
        label tokens in it: the outer step when one is due. Returns whether it ran."""
        self.weight += max(tokens, 0)
        if not self.due(step):
            return False
        if self.pairs:
            self._gathered_outer_step(step)
        elif self.bits is None:
            outer_step(self.group, step, self.pipeline, self.stage, self.trainable,
                       weight=self.weight, key=self.key)  # fmt: skip
        else:
            self._coded_outer_step(step)
        self.weight = 0
        return True

    def _coded_outer_step(self, step: int) -> None:
        """Send this pipeline's update since the last outer step as a code (with what the
        earlier codes left out), gather every pipeline's, and set every weight to the
        anchor plus their token-weighted mean (see the module docstring)."""
        assert self.bits is not None
        given = {}
        for i, (name, param) in enumerate(self.trainable):
            update = param.detach().to("cpu", torch.float32) - self.anchor[i] + self.residual[i]
            code, self.residual[i] = outer_codec.encode(update, self.weight, self.bits, step)
            given[self.key(name)] = code
        gathered = self.group.reduce(step, self.pipeline, self.stage, given, what=OUTER_CODES)
        with torch.no_grad():
            for i, (name, param) in enumerate(self.trainable):
                anchor = self.anchor[i]
                mean = outer_codec.weighted_mean(gathered[self.key(name)], anchor.numel(),
                                                 self.bits, step)  # fmt: skip
                self.anchor[i] = anchor + mean.reshape(anchor.shape)
                param.copy_(self.anchor[i].to(param.dtype))

    def _gathered_outer_step(self, step: int) -> None:
        """The exact merge's outer step (see the module docstring): every pipeline's weights
        (float64) or decoded updates gathered, LoRA pairs merged exactly, the rest averaged."""
        given = {}
        for i, (name, param) in enumerate(self.trainable):
            if self.bits is None:
                given[self.key(name)] = outer_codec.raw(param, self.weight)
                continue
            update = param.detach().to("cpu", torch.float32) - self.anchor[i] + self.residual[i]
            code, self.residual[i] = outer_codec.encode(update, self.weight, self.bits, step)
            given[self.key(name)] = code
        gathered = self.group.reduce(step, self.pipeline, self.stage, given, what=OUTER_CODES)
        values = [self._values(i, gathered[self.key(n)], step)
                  for i, (n, _) in enumerate(self.trainable)]  # fmt: skip
        merged: dict[int, torch.Tensor] = {}
        assert self.fold is not None
        for module, (b, a) in self.pairs.items():
            factors = [(w, vb, va) for (w, vb), (_, va) in zip(values[b], values[a], strict=True)
                       if w > 0]  # fmt: skip
            if factors:
                merged[b], merged[a], fold = lora_merge.exact_merge(factors)
                self.fold.add(module, fold)
        with torch.no_grad():
            for i, (_, param) in enumerate(self.trainable):
                new = merged[i] if i in merged else _mean(values[i])
                if new is None:  # no live pipeline trained a token since the last outer step
                    continue
                if self.bits is not None:
                    self.anchor[i] = new.to(torch.float32).reshape(self.anchor[i].shape)
                param.copy_(new.reshape(param.shape).to(param.dtype))

    def _values(self, i: int, rows: torch.Tensor, step: int) -> list[tuple[float, torch.Tensor]]:
        """Every pipeline's (weight, value of trainable entry `i`) from its gathered row, in
        pipeline order: the weights themselves, or the anchor plus the decoded update."""
        shape = self.trainable[i][1].shape
        numel = self.trainable[i][1].numel()
        if self.bits is None:
            return [(w, v.reshape(shape)) for w, v in (outer_codec.unraw(r, numel) for r in rows)]
        out = []
        for row in rows:
            w, update = outer_codec.decode(row, numel, self.bits, step)
            out.append((w, self.anchor[i] + update.reshape(self.anchor[i].shape)))
        return out

    def anchor_tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """For a rejoining peer holding `names`, under `ANCHOR_PREFIX`: the anchors of a coded
        outer step (none when it sends weights: the weights are the state) and the exact
        merge's folds of their layers."""
        out = {}
        if self.fold is not None:
            modules = {pair[0] for pair in map(lora_merge.pair_of, names) if pair is not None}
            out = {FOLDS + k: v for k, v in self.fold.tensors(modules).items()}
        if self.bits is None:
            return out
        wanted = set(names)
        pairs = zip(self.trainable, self.anchor, strict=True)
        return out | {ANCHOR_PREFIX + n: a for (n, _), a in pairs if n in wanted}

    def take_anchor(self, tensors: dict[str, torch.Tensor]) -> None:
        """Rejoining: the live peers' anchors and folds (`anchor_tensors`) become this
        stage's, and its residuals start empty. A tied head entry takes its weight's anchor."""
        if self.fold is not None:
            self.fold.load({k[len(FOLDS) :]: v for k, v in tensors.items() if k.startswith(FOLDS)})
        if self.bits is None:
            return
        by_param: dict[int, torch.Tensor] = {}
        for i, (name, param) in enumerate(self.trainable):
            value = tensors.get(ANCHOR_PREFIX + name, by_param.get(id(param)))
            if value is None:
                raise ValueError(f"the live peers sent no outer-step anchor of {name}")
            self.anchor[i] = value.to("cpu", torch.float32, copy=True)
            self.residual[i] = torch.zeros_like(self.anchor[i])
            by_param[id(param)] = self.anchor[i]


FOLDS = ANCHOR_PREFIX + lora_merge.FOLD_PREFIX
"""Handover tensors' prefix for the exact merge's folds (with the anchors')."""


def _factor_pairs(
    trainable: Sequence[tuple[str, nn.Parameter]], fold: lora_merge.Fold
) -> dict[str, tuple[int, int]]:
    """Per LoRA layer of `fold` whose B and A are both in `trainable` and whose product has
    its weight's shape: (index of B, index of A)."""
    found: dict[str, dict[str, int]] = {}
    for i, (name, _) in enumerate(trainable):
        pair = lora_merge.pair_of(name)
        if pair is not None and pair[0] in fold.layers:
            found.setdefault(pair[0], {})[pair[1]] = i
    out = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            continue
        b, a = trainable[ab["B"]][1], trainable[ab["A"]][1]
        weight: torch.Tensor = fold.layers[module].base_layer.weight  # type: ignore[union-attr,assignment]
        if b.dim() == a.dim() == 2 and b.shape[0] * a.shape[1] == weight.numel():
            out[module] = (ab["B"], ab["A"])
    return out


def _mean(values: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor | None:
    """The token-weighted mean of (weight, value) pairs, folded in order in float64 (None
    when no weight is positive)."""
    acc, total = None, 0.0
    for w, v in values:
        if w > 0:
            term = v.to(torch.float64) * w
            acc = term if acc is None else acc + term
            total += w
    return None if acc is None else acc / total


def outer_contributions(
    trainable: Sequence[tuple[str, nn.Parameter]],
    weight: int,
    key: Callable[[str], str] = lambda name: name,
) -> dict[str, torch.Tensor]:
    """This stage's part of an outer step: per parameter, under `key(name)`, the float64
    vector ``[weight * theta..., weight]``."""
    w = float(weight)
    out = {}
    for name, param in trainable:
        flat = param.detach().reshape(-1).to("cpu", torch.float64) * w
        out[key(name)] = torch.cat([flat, torch.tensor([w], dtype=torch.float64)])
    return out


def apply_average(
    trainable: Sequence[tuple[str, nn.Parameter]],
    reduced: dict[str, torch.Tensor],
    key: Callable[[str], str] = lambda name: name,
) -> None:
    """Set every parameter to its reduced numerator over its reduced weight (left as it is
    when no live pipeline trained a token since the last outer step)."""
    with torch.no_grad():
        for name, param in trainable:
            packed = reduced[key(name)]
            total = packed[-1]
            if float(total) <= 0.0:
                continue
            param.copy_((packed[:-1] / total).reshape(param.shape).to(param.dtype))


def outer_step(
    group: ReplicaGroup,
    step: int,
    pipeline: int,
    stage: int,
    trainable: Sequence[tuple[str, nn.Parameter]],
    *,
    weight: int,
    key: Callable[[str], str] = lambda name: name,
) -> None:
    """Average this stage's trainable parameters with every live pipeline's copy, weighted
    by the label tokens each trained since the last outer step (`weight`: this pipeline's).
    `key` maps a parameter's name to its replica key (the head's half of a tied weight)."""
    given = outer_contributions(trainable, weight, key)
    reduced = group.reduce(step, pipeline, stage, given, what=OUTER)
    apply_average(trainable, reduced, key)
