"""One optimizer step of a stage: 1F1B over M micro-batches, then a step-end exchange.

Per micro-batch, activations (with the attention mask, position ids and labels, which
the later stages need) flow downstream and the gradient of the boundary activation
flows upstream. Stage k of P runs min(P-k-1, M) forwards first, then alternates one
forward and one backward, then drains the remaining backwards: at most P-k
micro-batches of activations are alive on stage k at any time.

The loss is the token-mean cross-entropy over the whole step: every micro-batch's
summed token loss is divided by the number of label tokens in the step (which stage 0
knows before the first forward and sends along), exactly as single-process gradient
accumulation with `num_items_in_batch` does.

After the last backward the stages exchange what needs a global view, in one pass up the
chain (behind the last gradients) and one pass down (ahead of the next step's activations):
- the per-parameter gradient norms (for clipping by the global norm across stages, the
  same arithmetic as `torch.nn.utils.clip_grad_norm_` over the unsplit model);
- with `full` training of a tied model, the two halves of the shared weight's gradient
  (embedding on stage 0, head on the last stage); both ends add them (a + b == b + a in
  IEEE arithmetic) and so apply the identical update.

The stage computes where its parameters are (or on ``device``): micro-batches and what
arrives over the links (decoded on the CPU, but for ``delta``'s codes, which a GPU stage
decodes on its card) are moved there, and what is sent is copied to the CPU by the codec. On
the CPU every move is a no-op.

With several pipelines (a `ReplicaGroup`, `stats.py`; the arithmetic is
`replicas/arithmetic.py`) two things change and nothing else: stage 0 swaps its share's
label-token count for the global one before the first forward, and after the last backward
every stage replaces its gradients (and the last stage its loss sum) by the fold over all
pipelines before the pass above, which then computes the global norm from the reduced
gradients. With the adapter methods (`ordered_terms`), a pipeline other than the step's
first keeps each micro-batch's gradients apart for that fold, so that it is single-process
accumulation in micro-batch order, bit for bit. Without a group (one pipeline) the step is
as before.

A pipeline that leaves in the middle of a step (a crash) leaves some results of the
gradient reduce without its micro-batches (`short`, replicas/star.py). The stages that got
one say so on the chain pass (up with the norms, down with the total), so every stage of
every surviving pipeline ends the step knowing, and none applies it: `run` drops the
gradients and raises `ShortStepError`, and the stage trains the step again with the pipelines
left (the step's next attempt, its micro-batches shared among them by `live_shares`). The
shares do not change the bits, so the step is the one it would have been without the
failure; a redo costs the survivors one more step's time. At most R - 1 redos a step (each
follows a member lost); after that, or in periodic mode, a step trains on what arrived.

In periodic mode (`periodic=True`, `replicas/periodic.py`) each pipeline's step is a step
of its own: stage 0 normalises by its share's label tokens, no gradient is reduced, and the
norm and clipping are the pipeline's own. Only the last stages fold their loss sums and token
counts (exchange `stats`), so that the reported loss and tokens/s are the whole step's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from relaytrain_contract.order import one_f_one_b
from torch import nn
from torch.nn import functional

from relaytrain_worker.model.methods import TIED_HEAD_NAME
from relaytrain_worker.model.model_slice import StageModel, device_of
from relaytrain_worker.pipeline.boundary import MODE, ROWS, bytes_per_value
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.sampling import sample_tokens, seed_of, share_within, token_norms
from relaytrain_worker.pipeline.stats import (
    ITEMS_KEY,
    LOSS_KEY,
    STATS,
    TOKENS_KEY,
    ReplicaGroup,
)
from relaytrain_worker.pipeline.transport import Frame
from relaytrain_worker.state.data import MicroBatch


@dataclass
class StepResult:
    """What one step produced on this stage."""

    loss: float | None
    """Token-mean loss of the step (last stage only; with replicas, of the global batch)."""
    tokens: int
    """Label tokens in the step (what the loss is averaged over; with replicas, the global
    batch's)."""
    share_tokens: int
    """Label tokens of this pipeline's share of the step (without replicas, `tokens`): in
    periodic mode what its gradients are normalised by, and its outer-step weight."""
    input_tokens: int
    """Non-padding input tokens this stage processed in the step (attention mask ones):
    what tokens/s counts. Padding is not counted; masked prompt tokens are."""
    step_input_tokens: int
    """The same for the whole step: with replicas, every pipeline's (on the last stage,
    which reduces them with its gradients; elsewhere this stage's); without, `input_tokens`."""
    grad_norm: float
    """Global gradient norm before clipping."""


class ShortStepError(Exception):
    """The step's gradient reduce missed a pipeline that left in the middle of it: no stage
    of this pipeline applied it, and the step is to be trained again by those left."""


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32), positions labelled -100 ignored."""
    shift_logits = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    return functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")


def count_items(micros: list[MicroBatch]) -> int:
    """Label tokens of a step (what the loss is averaged over)."""
    return int(sum(int((m.labels[:, 1:] != -100).sum()) for m in micros))


class StepRunner:
    """Runs steps of one stage over its links."""

    def __init__(
        self,
        stage: StageModel,
        *,
        index: int,
        count: int,
        peers: Peers,
        trainable: list[tuple[str, nn.Parameter]],
        compression: str,
        max_grad_norm: float,
        tied_name: str | None = None,
        group: ReplicaGroup | None = None,
        pipeline: int = 0,
        periodic: bool = False,
        ordered_terms: bool = False,
        device: torch.device | None = None,
        ahead: int = 0,
        gradient_tokens: float = 1.0,
        gradient_fill: bool = False,
        seed: int = 0,
    ) -> None:
        self.stage = stage
        self.index = index
        self.count = count
        self.peers = peers
        self.trainable = trainable
        self.compression = compression
        self.ahead = ahead
        """Forwards run ahead of 1F1B (`one_f_one_b`)."""
        self.gradient_tokens = gradient_tokens
        """The share of tokens whose gradients go back (`sampling.py`; 1: all)."""
        self.gradient_fill = gradient_fill
        """Whether a micro-batch's gradients take more tokens than that share, up to all,
        while their code fits in the bytes its activations took on the link
        (`pipeline.gradientFill: activations`, `sampling.share_within`)."""
        self._room: dict[tuple[int, int], int] = {}
        """With ``gradient_fill``: each micro-batch's activation frame's bytes, until its
        gradient goes back."""
        self.seed = seed
        """The job's seed, which the token draws are derived from."""
        self.max_grad_norm = max_grad_norm
        self.tied_name = tied_name
        """Global name of a weight shared by stage 0 and the last stage (full + tied), else None."""
        self.group = group
        """The other pipelines of a data-parallel job (None: this pipeline trains alone)."""
        self.pipeline = pipeline
        """This pipeline's index in `group`."""
        self.periodic = periodic
        """Whether the pipelines synchronise periodically (only the loss and counts are
        reduced each step) rather than every step."""
        self.ordered_terms = ordered_terms and tied_name is None
        """Whether, in a pipeline other than the step's first member, each micro-batch's
        gradients and loss are kept apart and given to the group as terms, so that the fold
        over pipelines is single-process accumulation (`replicas/arithmetic.py`, 3). For the
        adapter methods; `full` training gives one accumulated term."""
        self.device = device if device is not None else device_of(stage)
        """Where the stage computes: micro-batches and received tensors are moved here."""
        self.on_micro: Callable[[], None] | None = None
        self._input_tokens = 0
        self._step_input_tokens = -1
        self._terms: dict[str, list[torch.Tensor]] | None = None
        """This step's gradient terms by name, when kept apart (see `ordered_terms`)."""

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def run(
        self, step: int, micros: list[MicroBatch] | None, n_micro: int, attempt: int = 0
    ) -> StepResult:
        """Forward and backward every micro-batch; leaves clipped grads on the parameters.
        ShortStepError (the gradients dropped) when a member pipeline left in the middle of the
        step and `attempt` (the step's redos so far) leaves room for another."""
        items = count_items(micros) if micros is not None else -1
        if self.group is not None and self.first and not self.periodic:
            items = self.group.total_tokens(step, self.pipeline, items)
        saved: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        losses: list[float] = []
        self._input_tokens = 0
        self._step_input_tokens = -1
        self._room.clear()  # a step cut short leaves its rooms behind
        # Terms apart, except in the step's first member pipeline, whose accumulated sum
        # opens the fold (one that trains nothing gives no term at all).
        group = None if self.periodic or not self.ordered_terms else self.group
        apart = group is not None and (group.first_member != self.pipeline or n_micro == 0)
        self._terms = {} if apart else None
        for kind, m in one_f_one_b(self.index, self.count, n_micro, self.ahead):
            if kind == "F":
                out, inp, items, part = self._forward(step, m, micros, items)
                saved[m] = (out, inp)
                if part is not None:
                    loss_sum += part
                    losses.append(part)
            else:
                out, inp = saved.pop(m)
                self._backward(step, m, out, inp)
        share = max(items, 0)  # a stage given no micro-batch heard no count
        short = False
        if self.group is not None and self.periodic:
            if self.last:
                loss_sum, items = self._reduce_stats(step, loss_sum, share)
        elif self.group is not None:
            loss_sum = self._reduce(step, loss_sum, losses)
            short = attempt < self.group.pipelines - 1 and self.group.short(step)
        norm, short = self._finish(step, short)
        if short:
            for _, param in self.trainable:
                param.grad = None
            raise ShortStepError(f"step {step + 1} missed a pipeline that left during it")
        loss = float(loss_sum / items) if self.last and items > 0 else None
        mine = self._input_tokens
        every = self._step_input_tokens if self._step_input_tokens >= 0 else mine
        return StepResult(
            loss=loss, tokens=items, share_tokens=share if self.periodic else items,
            input_tokens=mine, step_input_tokens=every, grad_norm=norm,
        )  # fmt: skip

    def _forward(
        self, step: int, m: int, micros: list[MicroBatch] | None, items: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, int, float | None]:
        if self.first:
            assert micros is not None
            mb = micros[m]
            x, inp = mb.input_ids.to(self.device), None
            mask, pos, labels = self._here(mb.attention_mask, mb.position_ids, mb.labels)
            keys = mb.rows if self.compression == MODE else None
        else:
            assert self.peers.prev is not None
            frame = self.peers.prev.recv("activation", step, m, self.device)
            items = int(frame.meta["items"])
            if self.gradient_fill:
                self._room[step, m] = frame.wire_bytes
            got = frame.tensors
            hidden, mask, pos, labels = self._here(
                got["hidden"], got["attention_mask"], got["position_ids"], got["labels"]
            )
            inp = hidden.requires_grad_(True)
            x = inp
            keys = got.get(ROWS)
        self._input_tokens += int(mask.sum())
        out = self.stage(x, mask, pos)
        if self.last:
            total = token_loss_sum(out, labels)
            scaled = total / items
            return scaled, inp, items, float(total.detach())
        assert self.peers.next is not None
        tensors = {
            "hidden": out.detach(),
            "attention_mask": mask,
            "position_ids": pos,
            "labels": labels,
        }
        if keys is not None:  # the rows' keys, for the delta compression's caches
            tensors[ROWS] = keys
        frame = Frame("activation", step, m, tensors, {"items": items})
        self.peers.next.send(frame, self.compression)
        return out, inp, items, None

    def _backward(self, step: int, m: int, out: torch.Tensor, inp: torch.Tensor | None) -> None:
        if self.last:
            out.backward()  # type: ignore[no-untyped-call]
        else:
            assert self.peers.next is not None
            grad = self.peers.next.recv("gradient", step, m, self.device).tensors["grad"]
            torch.autograd.backward(out, grad.to(self.device))
        if not self.first:
            assert self.peers.prev is not None and inp is not None
            assert inp.grad is not None
            grad = inp.grad
            share, norms = self.gradient_tokens, None
            if share < 1.0:  # the norms the fill counts and the draw draws by, taken once
                norms = token_norms(grad)
            if self.gradient_fill:
                bits = self.peers.prev.link.codec.gradient_bits
                room = self._room.pop((step, m))
                share = share_within(grad, share, room, bytes_per_value(bits), norms)
            if share < 1.0:
                seed = seed_of(self.seed, step, m, self.index)
                grad = sample_tokens(grad, share, seed, norms)
            self.peers.prev.send(Frame("gradient", step, m, {"grad": grad}), self.compression)
        if self._terms is not None:  # this micro-batch's gradients, as a term of their own
            for name, param in self.trainable:
                if param.grad is not None:
                    self._terms.setdefault(name, []).append(param.grad)
                    param.grad = None
        if self.on_micro is not None:
            self.on_micro()

    # -- step end: replicas, global norm and tied weight ------------------------------

    def _reduce(self, step: int, loss_sum: torch.Tensor, losses: list[float]) -> torch.Tensor:
        """Swap this stage's gradients (and the last stage's loss sum) for their fold over
        every pipeline, given as stacks of terms (`stats.TERMS`): each micro-batch's own
        when they were kept apart, else one accumulated; returns the (reduced) loss sum."""
        assert self.group is not None
        terms = self._terms
        given: dict[str, torch.Tensor] = {}
        for name, grad in self._grads():
            if terms is None:
                given[self.replica_key(name)] = grad.unsqueeze(0)
            else:
                kept = terms.get(name)
                given[self.replica_key(name)] = (
                    torch.stack(kept) if kept else grad.new_zeros((0, *grad.shape))
                )
        if self.tied_name is not None and self.first and self.last:
            # One stage holds both halves, already added by autograd: it gives the whole
            # gradient as the embedding's half and nothing as the head's.
            given[TIED_HEAD_NAME] = torch.zeros_like(given[self.tied_name])
        if self.last:
            given[LOSS_KEY] = (
                loss_sum.unsqueeze(0)
                if terms is None
                else torch.tensor(losses, dtype=torch.float64).reshape(-1)
            )
            given[TOKENS_KEY] = torch.tensor([float(self._input_tokens)], dtype=torch.float64)
        self._terms = None
        # The exchange folds on the CPU (what the links carry and what arrives is there):
        # a stage on a GPU gives its contributions from there and takes the results back.
        given = {name: t.cpu() for name, t in given.items()}
        reduced = self.group.reduce(step, self.pipeline, self.index, given)
        if self.last:
            self._step_input_tokens = int(reduced[TOKENS_KEY])
        for name, param in self.trainable:
            param.grad = reduced[self.replica_key(name)].to(param.device)
        if self.tied_name is not None and self.first and self.last:
            tied = self._param(self.tied_name)
            tied.grad = (reduced[self.tied_name] + reduced[TIED_HEAD_NAME]).to(tied.device)
        return reduced[LOSS_KEY] if self.last else loss_sum

    def _reduce_stats(
        self, step: int, loss_sum: torch.Tensor, share: int
    ) -> tuple[torch.Tensor, int]:
        """Periodic mode, last stage: the whole step's loss sum and label tokens (and input
        tokens, for tokens/s), folded over every pipeline."""
        assert self.group is not None
        given = {
            LOSS_KEY: loss_sum,
            ITEMS_KEY: torch.tensor(float(share), dtype=torch.float64),
            TOKENS_KEY: torch.tensor(float(self._input_tokens), dtype=torch.float64),
        }
        reduced = self.group.reduce(step, self.pipeline, self.index, given, what=STATS)
        self._step_input_tokens = int(reduced[TOKENS_KEY])
        return reduced[LOSS_KEY], int(reduced[ITEMS_KEY])

    def replica_key(self, name: str) -> str:
        """The key of a parameter's gradient among the replicas: its global name, except
        that the last stage's half of a tied weight goes under the head's own name."""
        if name == self.tied_name and self.last and not self.first:
            return TIED_HEAD_NAME
        return name

    def _grads(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, param in self.trainable:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            out.append((name, grad))
        return out

    def _finish(self, step: int, short: bool) -> tuple[float, bool]:
        """The global gradient norm, clipped by: each stage's norms travel up the chain
        behind its last gradient (the norms of the stages below it in front), stage 0 —
        the last to finish its backwards — takes the norm of them all, and the total
        travels down ahead of the next step's first activation. So the exchange adds no
        latency of its own: each frame rides a link right after one that goes anyway.
        Whether any stage's reduce was `short` rides along the same way (up, then the
        whole pipeline's down): returned with the norm, the same on every stage."""
        grads = self._grads()
        sharing = self.tied_name is not None and self.count > 1
        own = [(n, g) for n, g in grads if n != self.tied_name] if sharing else grads
        mine = next((g for n, g in grads if n == self.tied_name), None) if sharing else None
        norms = (
            torch.stack(torch._foreach_norm([g for _, g in own], 2.0))
            if own
            else torch.zeros(0, device=self.device)
        )
        up = mine  # the head's half of the shared gradient, travelling up
        if not self.last:
            assert self.peers.next is not None
            frame = self.peers.next.recv("norms", step)
            short = short or bool(frame.meta.get("short"))
            norms = torch.cat([norms, frame.tensors["norms"].to(self.device)])
            up = self._here_or_none(frame.tensors.get("tied"))
        summed = None
        if self.first:
            if sharing:
                assert mine is not None and up is not None
                summed = mine + up
                # Counted once, at the front: where the unsplit model lists the embedding.
                norms = torch.cat([torch.linalg.vector_norm(summed, 2.0).reshape(1), norms])
            total = torch.linalg.vector_norm(norms, 2.0)
            down = mine  # the embedding's half, travelling down
        else:
            assert self.peers.prev is not None
            tensors = {"norms": norms}
            if sharing and up is not None:
                tensors["tied"] = up
            self.peers.prev.send(Frame("norms", step, -1, tensors, _flag(short)), "none")
            frame = self.peers.prev.recv("step_end", step)
            short = bool(frame.meta.get("short"))
            total = frame.tensors["total_norm"].to(self.device)
            down = self._here_or_none(frame.tensors.get("tied"))
            if self.last and sharing:
                assert mine is not None and down is not None
                summed = mine + down
        if not self.last:
            assert self.peers.next is not None
            tensors = {"total_norm": total}
            if sharing and down is not None:
                tensors["tied"] = down
            self.peers.next.send(Frame("step_end", step, -1, tensors, _flag(short)), "none")
        if summed is not None:
            self._param(self.tied_name).grad = summed
        if self.max_grad_norm > 0 and not short:
            params = [p for _, p in self.trainable]
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
        return float(total), short

    def _param(self, name: str | None) -> nn.Parameter:
        return next(p for n, p in self.trainable if n == name)

    def _here(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensors` on the stage's device (the same tensors where they already are)."""
        return tuple(t.to(self.device) for t in tensors)

    def _here_or_none(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.device)


def _flag(short: bool) -> dict[str, bool]:
    """A chain-pass frame's meta: the short mark only when set (the frame as before)."""
    return {"short": True} if short else {}
