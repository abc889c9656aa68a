"""What a per-block bit allocation would buy the boundary codes: bits per value and held-out
loss over epochs, simulated in one unsplit model.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_boundary_allocation.py
    [--base random|pretrained] [--shift S] [--epochs E] [--modes none,int4,delta,...]
    [--refit F] [--target LOSS] [--weight-floor W]
    [--allocate both|activations|gradients] [--gradient-floor 0|1|2] [--gradient-rows P] [...]

A design experiment, not the worker's code path: the codes are applied at the three
boundaries of a 4-stage split of the same tiny Llama as bench/bench_delta_boundary.py
(4 layers, hidden 256, LoRA r8 on every linear layer, 128 rows of 64 tokens of the bigram
language, micro-batches of 4 rows, 2 a step, AdamW 5e-3 cosine), inside one process: each
boundary's activation is replaced by what its code decodes to on the way forward, and its
gradient by what the gradient's code decodes to on the way back (an autograd function at
each layer's output), so training sees exactly the codes' errors. No links: bits are
counted, not bytes sent.

Modes, per boundary and direction:

- ``none``: uncompressed;
- ``int4``: every activation and gradient rotated 4-bit (`lowbit.py`), 4.25 bits a value;
- ``adaptive``: ``compression: delta`` until 2026-11-29: each row's activation coded against
  what its receiver decoded last epoch (`DeltaSender`, the fewest bits 1-4 for the whole
  row, a 4-bit full code first), gradients rotated 3-bit, 3.25 bits a value;
- ``delta``: the worker's ``compression: delta`` (`pipeline/boundary.py`): the same, with
  each block's bits allocated within the row's int4 error (`DeltaConfig.allocate`, as
  ``allocated`` does over a frame);
- ``allocated``: every row of a frame coded against a reference, its last decode (a cache
  per row, on both ends, for activations **and** gradients) or zero, whichever is nearer;
  then each block of 64 gets 0-4 bits by reverse water-filling over the whole frame
  (`allocation.allocate_bits`): the fewest bits whose expected error, ``sum_i D_b(i)
  ||r_i||^2`` (`lowbit.DISTORTION`, ``D_0 = 1``), stays within what today's code allows the
  frame, ``D_4 ||x||^2`` for activations and ``D_3 ||g||^2`` for gradients. A block with 0
  bits is not sent; its change stays in the next one. Counted: each sent block's codes and
  bf16 scale, 3 bits a block for its allocation, 1 bit a row for its reference. Options:
  `--allocate` one direction only (the other coded as ``adaptive`` codes it), other error
  budgets (`--activation-budget`, `--gradient-budget`), a floor under a gradient block's
  bits (`--gradient-floor 1`: none left out), stochastic rounding (`--unbiased-gradients`),
  no gradient cache (`--no-gradient-cache`), gradients for a share of the rows only
  (`--gradient-rows`).
- ``weighted``: activations as ``allocated`` codes them, each token's error weighted by its
  gradient's energy at the boundary the epoch before (`Weighted`, ``--weight-floor``);
  gradients as ``delta`` codes them (a design experiment that failed: docs/links-and-
  checkpoints.md, "the activations' error weighted by their tokens' gradients").
- ``transformed``: activations as ``allocated`` (a cache per row, each row against it or
  zero), but each token's change is first turned into coordinates along the eigenvectors
  of the changes' second moment (a Karhunen-Loeve transform, one basis for rows against
  zero and one for rows against their cache, fitted by the sender from what it coded and
  sent in bf16, ``h^2`` values, after the first 4 frames of each kind and every `--refit`
  after), largest first, so that a few blocks hold most of a token's energy; a block gets
  0-8 bits (5-8: a 4-bit code and a code of its residual), within int4's error for the
  frame. Gradients as ``delta`` codes them. Reported with the bases' bits and without
  them: a basis costs ``h^2`` bf16 values each time it is sent, which at this model's size
  (hidden 256, 2.1 M activation values a boundary an epoch) is half a bit a value per
  basis an epoch, and at Llama-3.1-8B's (hidden 4096) the values of one micro-batch of 2 x
  2048 tokens.

Reported per epoch: bits per value of each direction (averaged over the three
boundaries), ``x bf16`` (16 over them), the realised relative error of the allocated
codes, and the held-out loss of the trained adapters on the uncompressed model. Per run:
the steps until the held-out loss (evaluated after every step) is first within 1 % of the
first mode's final one (`bench/bench_delta_boundary.py`'s target over the links), or at
``--target``, which is where a code that learns more slowly shows before the final loss
does. The sampled codes' draws are seeded in the order the runs' codes are made, so they
depend on the modes listed before (``--modes delta`` alone and ``--modes none,delta`` draw
differently): another draw of the same setting.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO), str(REPO / "worker_image"), str(REPO / "testkit")]

from relaytrain_testkit import bigram  # noqa: E402
from relaytrain_testkit.tiny_models import tiny_model_dir  # noqa: E402
from relaytrain_worker.model.methods import apply_lora, lora_config  # noqa: E402
from relaytrain_worker.pipeline import boundary, lowbit  # noqa: E402
from relaytrain_worker.pipeline.allocation import allocate_bits  # noqa: E402
from relaytrain_worker.pipeline.deltacache import DeltaConfig, DeltaSender  # noqa: E402
from relaytrain_worker.pipeline.sampling import probabilities  # noqa: E402
from time_to_loss_model import steps_to  # noqa: E402

LAYERS, HIDDEN, SEQ, MBS, MICROS, ROWS = 4, 256, 64, 4, 2, 128
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = ("none", "int4", "adaptive", "delta", "allocated", "transformed", "weighted")
ADAPTIVE = DeltaConfig(full_bits=4, delta_bits=1, adaptive=True)
"""``delta``'s activations until 2026-11-29: each row's change at the fewest bits, 1-4, for
the whole row, within the first code's error."""
D = {0: 1.0, **lowbit.DISTORTION}
MAP_BITS = 3
"""Bits a block's allocation (0-4) costs on the wire."""


class Allocated:
    """One direction of one boundary: a cache per row, both ends alike (the decode is what
    both hold); codes each frame as the module docstring says."""

    def __init__(
        self, target_bits: int, cached: bool = True, floor: int = 0, unbiased: bool = False
    ) -> None:
        self.target = D[target_bits]
        self.cached = cached
        self.floor = floor
        self.unbiased = unbiased
        self.cache: dict[int, torch.Tensor] = {}
        self.version = 0
        self.bits = 0.0
        self.values = 0
        self.error = 0.0
        self.norm = 0.0

    def _weights(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Each block's weight in the frame's error (None: every block alike)."""
        return None

    def code(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self.version += 1
        blocks = [lowbit.to_blocks(x[i]) for i in range(x.shape[0])]
        refs = []
        for i, row in enumerate(rows):
            cached = self.cache.get(row) if self.cached else None
            near = cached is not None and float((blocks[i] - cached).square().sum()) < float(
                blocks[i].square().sum()
            )
            refs.append(cached if near else torch.zeros_like(blocks[i]))
        stacked = torch.cat(blocks)
        ref = torch.cat(refs)
        change = stacked - ref
        whole = float(stacked.square().sum())
        # each block's bits: water-filling within the frame's (weighted) error budget
        energy, w, budget = change.square().sum(1), self._weights(x, rows), whole
        if w is not None:
            energy, budget = energy * w, float((stacked.square().sum(1) * w).sum())
        bits = allocate_bits(energy, self.target * budget, self.floor)
        decoded = ref.clone()
        for b in range(1, 5):
            chosen = bits == b
            if bool(chosen.any()):
                seed = self.version * 8 + b if self.unbiased else None
                codes, scales = lowbit.quantise_blocks(
                    change[chosen], b, seed=seed, variant=self.version
                )
                decoded[chosen] += lowbit.dequantise_blocks(codes, scales, b, self.version)
        decoded = decoded.to(torch.bfloat16).to(torch.float32)  # the caches are bf16
        for i, row in enumerate(rows):
            n = blocks[i].shape[0]
            self.cache[row] = decoded[i * n : (i + 1) * n].clone()
        sent = bits > 0
        self.bits += float(64 * bits.sum() + 16 * sent.sum()) + MAP_BITS * bits.numel() + len(rows)
        self.values += x.numel()
        self.error += float((decoded - stacked).square().sum())
        self.norm += whole
        per_row = decoded.reshape(x.shape[0], -1)[:, : x[0].numel()]
        return per_row.reshape(x.shape).to(x.dtype)


class Weighted(Allocated):
    """``weighted``: activations as `Allocated` codes them, each token's error weighted by how
    much its gradient at the boundary made of the loss the epoch before (``||g_t||^2``,
    `GradientNorms`, each row's over its mean, at least ``floor``): the blocks' bits by
    water-filling over the weighted energies, the same weighted error as the uniform code's
    (``D_b sum_t w_t ||x_t||^2``). To first order a token's error ``e_t`` changes the loss by
    ``g_t . e_t``: a token the loss hardly depends on can take more of it."""

    def __init__(self, target_bits: int, norms: dict[int, torch.Tensor], floor: float) -> None:
        super().__init__(target_bits)
        self.norms, self.weight_floor = norms, floor

    def _weights(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        per_token = x.shape[-1] // lowbit.BLOCK  # blocks a token (the width is a multiple)
        weights = []
        for row in rows:
            norms = self.norms.get(row)
            w = torch.ones(x.shape[1]) if norms is None else norms / norms.mean().clamp_min(1e-30)
            weights.append(w.clamp_min(self.weight_floor).repeat_interleave(per_token))
        return torch.cat(weights)


class GradientNorms:
    """The gradients' way of a boundary that also keeps each row's tokens' ``||g_t||^2``
    (for `Weighted`, the epoch after): what the receiving stage measures before it codes."""

    def __init__(self, inner: Any, norms: dict[int, torch.Tensor]) -> None:
        self.inner, self.norms = inner, norms

    def code(self, g: torch.Tensor, rows: list[int]) -> torch.Tensor:
        for i, row in enumerate(rows):
            self.norms[row] = g[i].detach().float().square().sum(-1)
        return self.inner.code(g, rows)

    def __getattr__(self, name: str) -> Any:  # bits, values: the inner code's counts
        return getattr(self.inner, name)


FIRST_FIT = 4
"""`Transformed`: frames coded in the identity before the first fit."""
DEEP = (
    1.0,
    *(lowbit.DISTORTION[b] for b in (1, 2, 3, 4)),
    *(lowbit.DISTORTION[4] * lowbit.DISTORTION[b] for b in (1, 2, 3, 4)),
)
"""Expected error of 0-8 bits a value of a block, over its energy: 5-8 bits are a 4-bit code
and a 1-4-bit code of its residual (convex in the bits, as water-filling needs)."""


def allocate_deep(energy: torch.Tensor, budget: float) -> torch.Tensor:
    """Bits 0-8 for blocks of squared norms `energy`, the fewest whose expected error
    (`DEEP`) is within `budget`: each block's bits minimise ``64 b + 16 [b > 0] + 16 [b > 4] +
    lam D_b e``, the smallest ``lam`` that meets the budget (bisection)."""
    e = energy.to(torch.float64).reshape(-1, 1)
    d = torch.tensor(DEEP, dtype=torch.float64)[None, :]
    cost = torch.tensor([64.0 * b + 16 * (b > 0) + 16 * (b > 4) for b in range(9)])[None, :]

    def pick(lam: float) -> torch.Tensor:
        return (cost.double() + lam * d * e).argmin(dim=1)

    def error(bits: torch.Tensor) -> float:
        return float((d[0, bits] * e[:, 0]).sum())

    lo, hi = 0.0, 1.0
    while error(pick(hi)) > budget and hi < 1e300:
        lo, hi = hi, hi * 16
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(pick(mid)) > budget else (lo, mid)
    return pick(hi)


class Transformed(Allocated):
    """`Allocated` activations coded in a basis fitted to them (a Karhunen-Loeve transform):
    each token's change against its reference is turned into coordinates along the
    eigenvectors of the changes' second moment, largest first, before the blocks are cut and
    their bits allocated, so a few blocks hold most of the energy and the others get few bits
    or none. Two bases, one for rows coded against zero and one for rows coded against their
    cache, each fitted by the sender from the changes it coded since the basis before (the
    identity until a fit has data), after the first `FIRST_FIT` frames with rows of its kind
    and every `refit` such frames after, and sent in bf16 (both ends
    orthonormalise what was sent, a QR in float64: a basis both agree on); counted as
    ``h^2`` bf16 values each time it is sent (`basis_bits`)."""

    def __init__(self, target_bits: int, refit: int) -> None:
        super().__init__(target_bits)
        self.refit = refit
        self.frames = 0
        self.bases: dict[bool, torch.Tensor | None] = {False: None, True: None}
        self.moments: dict[bool, torch.Tensor | None] = {False: None, True: None}
        self.seen = {False: 0, True: 0}
        """Frames with rows of each kind (coded against zero, against the cache)."""
        self.basis_bits = 0.0
        self.sent_bases = 0

    def _fit(self, kinds: list[bool]) -> None:
        for kind in kinds:
            m = self.moments[kind]
            if m is None:
                continue
            _, vectors = torch.linalg.eigh(m)
            sent = vectors.flip(1).to(torch.bfloat16).to(torch.float64)
            self.bases[kind] = torch.linalg.qr(sent).Q.to(torch.float32)
            self.basis_bits += 16 * m.numel()
            self.bits += 16 * m.numel()
            self.sent_bases += 1
            self.moments[kind] = None

    def code(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self.version += 1
        self.frames += 1
        h = x.shape[-1]
        flat = [x[i].reshape(-1, h).to(torch.float32) for i in range(x.shape[0])]
        refs, kinds, coords = [], [], []
        near_kinds = set()
        for i, row in enumerate(rows):
            cached = self.cache.get(row)
            near = cached is not None and float((flat[i] - cached).square().sum()) < float(
                flat[i].square().sum()
            )
            ref = cached if near else torch.zeros_like(flat[i])
            near_kinds.add(near)
            change = flat[i] - ref
            m = (change.double().T @ change.double()).to(torch.float64)
            self.moments[near] = m if self.moments[near] is None else self.moments[near] + m
            basis = self.bases[near]
            refs.append(ref)
            kinds.append(basis)
            coords.append(change @ basis if basis is not None else change)
        blocks = [lowbit.to_blocks(c) for c in coords]
        stacked = torch.cat(blocks)
        whole = float(sum(float(f.square().sum()) for f in flat))
        bits = allocate_deep(stacked.square().sum(1), self.target * whole)
        decoded_blocks = torch.zeros_like(stacked)
        for stage in (0, 1):  # a block of more than 4 bits: 4, then its residual
            residual = stacked - decoded_blocks
            stage_bits = (bits - 4 * stage).clamp(0, 4)
            for b in range(1, 5):
                chosen = stage_bits == b
                if bool(chosen.any()):
                    variant = 2 * self.version + stage
                    codes, scales = lowbit.quantise_blocks(residual[chosen], b, variant=variant)
                    decoded_blocks[chosen] += lowbit.dequantise_blocks(codes, scales, b, variant)
            self.bits += 16.0 * float((stage_bits > 0).sum())
        out = torch.empty_like(x)
        n = blocks[0].shape[0]
        error = 0.0
        for i, row in enumerate(rows):
            y = lowbit.from_blocks(
                decoded_blocks[i * n : (i + 1) * n], tuple(flat[i].shape), torch.float32
            )
            change = y @ kinds[i].T if kinds[i] is not None else y
            decoded = (refs[i] + change).to(torch.bfloat16).to(torch.float32)
            self.cache[row] = decoded
            error += float((decoded - flat[i]).square().sum())
            out[i] = decoded.reshape(x[i].shape).to(x.dtype)
        self.bits += float(64 * bits.sum()) + 4 * bits.numel() + len(rows)
        self.values += x.numel()
        self.error += error
        self.norm += whole
        due = []
        for kind in (False, True):
            if kind in near_kinds:
                self.seen[kind] += 1
                if self.seen[kind] == FIRST_FIT or self.seen[kind] % self.refit == 0:
                    due.append(kind)
        self._fit(due)
        return out


class Fixed:
    """A rotated code of `bits` for every value (int4 both ways; today's gradients)."""

    def __init__(self, bits: int) -> None:
        self.bits_each = bits
        self.bits = 0.0
        self.values = 0

    def code(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        enc = lowbit.encode(x, self.bits_each)
        self.values += x.numel()
        self.bits += 8 * enc.nbytes
        return lowbit.decode(enc).to(x.dtype)


class Sampled:
    """Gradients of some of the tokens, chosen at random with probabilities in proportion to
    their norms (``p_i = min(1, c ||g_i||)``) and scaled by ``1 / p_i``, so that the code is
    unbiased; the chosen tokens rotated at `bits`, the others zero. ``c`` gives either a
    share of the tokens (``sum p_i``) or, with `variance`, the fewest tokens whose sampling
    variance, ``sum (1 / p_i - 1) ||g_i||^2``, is at most `variance` times ``sum ||g_i||^2``.
    With `lowrank`, the micro-batch's best rank-`lowrank` part crosses whole and the tokens
    of what it misses are drawn (a control variate; still unbiased). Counted: the codes and
    scales of the chosen tokens, 1 bit a token, and the shared part's two factors."""

    def __init__(
        self,
        bits: int,
        share: float,
        seed: int,
        variance: float | None = None,
        scatter: bool = False,
        lowrank: int = 0,
    ) -> None:
        self.bits_each = bits
        self.lowrank = lowrank
        """Rank of the shared part sent whole (`--gradient-lowrank`; 0: none)."""
        self.captured = 0.0
        """The gradients' energy in their shared part (with `lowrank`)."""
        self.share = share
        self.variance = variance
        self.scatter = scatter
        """With `variance`: the budget is that times the tokens' scatter around their mean,
        ``sum ||g_i - mean g||^2`` (the noise the micro-batch already has), not their energy."""
        self.gen = torch.Generator().manual_seed(seed)
        self.bits = 0.0
        self.values = 0
        self.kept = 0
        self.tokens = 0
        self.spread = 0.0
        self.energy = 0.0
        self.drifts: dict[int, float] | None = None
        """Each row's last activation drift at this boundary (`Today`), when gated."""
        self.below = math.inf

    def _probabilities(self, norms: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.variance is None:  # a share of the tokens: the worker's own draw
            return probabilities(norms, self.share)
        energy = float(norms.square().sum())
        budget = energy
        if self.scatter:
            live = tokens[norms > 0].double()
            if len(live):
                budget = float((live - live.mean(dim=0)).square().sum())

        def p_of(c: float) -> torch.Tensor:
            return torch.clamp(c * norms, max=1.0)

        def short(c: float) -> bool:  # c too small for the variance budget
            p = p_of(c)
            live = p > 0
            spread = float(((1 / p[live] - 1) * norms[live].square()).sum())
            return spread > self.variance * budget

        if energy == 0.0:
            return torch.zeros_like(norms)
        lo, hi = 0.0, 1.0 / float(norms.max())
        while short(hi) and hi < 1e30:
            lo, hi = hi, hi * 4
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if short(mid) else (lo, mid)
        return p_of(hi)

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """The micro-batch's gradients' best rank-`lowrank` approximation (SVD), its two
        factors (left scaled by the singular values) coded rotated 4-bit and counted."""
        u, s, vh = torch.linalg.svd(tokens.float(), full_matrices=False)
        r = min(self.lowrank, int(s.numel()))
        left = lowbit.encode((u[:, :r] * s[:r]).contiguous(), 4)
        right = lowbit.encode(vh[:r].contiguous(), 4)
        for enc in (left, right):
            self.bits += 8 * enc.nbytes
        shared = lowbit.decode(left).float() @ lowbit.decode(right).float()
        self.captured += float(shared.square().sum())
        return shared.to(tokens.dtype)

    def code(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        whole = x.reshape(-1, x.shape[-1])
        shared = self._shared(whole) if self.lowrank else None
        # With `lowrank`, what is sampled is what the shared part missed.
        tokens = whole if shared is None else whole - shared
        norms = tokens.norm(dim=1).double()
        if self.drifts is None:
            p = self._probabilities(norms, tokens)
        else:  # only rows whose activation drifted less than `below` are sampled
            calm = torch.tensor([self.drifts.get(r, math.inf) < self.below for r in rows])
            calm = calm.repeat_interleave(x[0].numel() // x.shape[-1])
            p = torch.ones_like(norms)
            if bool(calm.any()):
                p[calm] = self._probabilities(norms[calm], tokens[calm])
        keep = torch.rand(p.shape, generator=self.gen, dtype=torch.float64) < p
        out = torch.zeros_like(whole) if shared is None else shared.clone()
        if bool(keep.any()):
            kept = tokens[keep] / p[keep, None].to(tokens.dtype)
            enc = lowbit.encode(kept, self.bits_each)
            out[keep] += lowbit.decode(enc).to(x.dtype)
            self.bits += 8 * enc.nbytes
        live = p > 0
        self.spread += float(((1 / p[live] - 1) * norms[live].square()).sum())
        self.energy += float(whole.norm(dim=1).double().square().sum())
        self.kept += int(keep.sum())
        self.tokens += tokens.shape[0]
        self.bits += tokens.shape[0]
        self.values += x.numel()
        return out.reshape(x.shape)


class Today:
    """A delta code of the activations (`DeltaSender`, keyed by row): the worker's
    (`boundary.CONFIG`) or another."""

    def __init__(self, config: DeltaConfig = boundary.CONFIG) -> None:
        self.sender = DeltaSender(config)
        self.bits = 0.0
        self.values = 0
        self.drifts: dict[int, float] = {}
        """Each row's change against its last decode, over its norm (inf: first sight)."""

    def code(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self.values += x.numel()
        out = torch.empty_like(x)
        for i, row in enumerate(rows):
            last = self.sender.cached(f"activation:{row}")
            self.drifts[row] = (
                math.inf
                if last is None
                else float((x[i] - last.to(x.dtype)).norm() / x[i].norm().clamp_min(1e-30))
            )
            msg = self.sender.encode(x[i], f"activation:{row}")
            self.bits += 8 * msg.nbytes
            cached = self.sender.cached(f"activation:{row}")
            assert cached is not None
            out[i] = cached.to(x.dtype)
        return out


class Coded(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        pair: Any,
        rows: list[int],
        keep: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        ctx.pair, ctx.rows, ctx.keep, ctx.scale = pair, rows, keep, scale
        return pair[0].code(h.detach(), rows) if pair else h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.pair:
            return grad, None, None, None, None
        if ctx.keep is None:
            return ctx.pair[1].code(grad, ctx.rows), None, None, None, None
        # only the kept rows' gradients cross (the same rows at every boundary); the
        # others are zero, which costs the row's one bit
        out = torch.zeros_like(grad)
        kept = [r for r, k in zip(ctx.rows, ctx.keep.tolist(), strict=True) if k]
        out[ctx.keep] = ctx.pair[1].code(grad[ctx.keep] * ctx.scale, kept)
        ctx.pair[1].bits += int((~ctx.keep).sum())
        ctx.pair[1].values += grad[~ctx.keep].numel()
        return out, None, None, None, None


def rate(pairs: list[Any], marks: list[Any], d: int) -> float:
    """Bits a value of direction `d` (0 down, 1 up) since `marks`, over every boundary."""
    if not pairs[0]:
        return 16.0
    bits = sum(p[d].bits - m[d][0] for p, m in zip(pairs, marks, strict=True))
    values = sum(p[d].values - m[d][1] for p, m in zip(pairs, marks, strict=True))
    return float(bits / values)


_SEEDS = iter(range(100, 10_000))


class NoiseScale:
    """The noise of a micro-batch's gradient against the gradient's signal, ``phi =
    tr(Sigma) / (b |G|^2)``, from the norms of each micro-batch's gradient and of their sum
    (McCandlish et al. 2018's two batch sizes, b and M b), each averaged over steps (0.9)
    before the ratio is taken; 0 until both are known."""

    def __init__(self, micros: int) -> None:
        self.m = micros
        self.small = 0.0  # |M g_m|^2: a micro-batch's gradient as a gradient of its own
        self.large = 0.0  # |sum g_m|^2: the step's
        self.seen = 0
        self.parts: list[float] = []
        self.phi = 0.0

    def micro(self, params: list[torch.Tensor], before: list[torch.Tensor | None]) -> None:
        part = 0.0
        for p, b in zip(params, before, strict=True):
            g = p.grad if b is None else p.grad - b
            part += float(g.double().square().sum())
        self.parts.append(part * self.m**2)

    def step(self, params: list[torch.Tensor]) -> float:
        large = sum(float(p.grad.double().square().sum()) for p in params)
        small = sum(self.parts) / len(self.parts)
        self.parts = []
        b = 0.0 if self.seen == 0 else 0.9
        self.small, self.large = b * self.small + (1 - b) * small, b * self.large + (1 - b) * large
        self.seen += 1
        signal = self.m * self.large - self.small
        spread = self.m * (self.small - self.large)
        self.phi = max(0.0, spread / signal) if signal > 0 and self.seen >= 4 else 0.0
        return self.phi


def make_pair(mode: str, options: argparse.Namespace) -> Any:
    if mode == "int4":
        return (Fixed(4), Fixed(4))
    up: Any = Fixed(options.gradient_bits)
    if (
        options.gradient_sample < 1.0
        or options.gradient_variance is not None
        or options.gradient_noise_scale is not None
    ):
        up = Sampled(
            options.gradient_bits,
            options.gradient_sample,
            seed=next(_SEEDS) + 10_000 * options.seed,
            variance=0.0 if options.gradient_noise_scale is not None else options.gradient_variance,
            scatter=options.gradient_scatter,
            lowrank=options.gradient_lowrank,
        )
    if mode in ("adaptive", "delta"):
        down = Today(ADAPTIVE if mode == "adaptive" else boundary.CONFIG)
        if isinstance(up, Sampled) and options.sample_below is not None:
            up.drifts, up.below = down.drifts, options.sample_below
        return (down, up)
    if mode == "weighted":
        norms: dict[int, torch.Tensor] = {}
        up = GradientNorms(make_pair("delta", options)[1], norms)
        return (Weighted(options.activation_budget, norms, options.weight_floor), up)
    if mode == "transformed":
        down = Transformed(options.activation_budget, options.refit)
        return (down, make_pair("delta", options)[1])
    if mode == "allocated":
        down = options.allocate in ("both", "activations")
        up = options.allocate in ("both", "gradients")
        return (
            Allocated(options.activation_budget) if down else Today(ADAPTIVE),
            Allocated(
                options.gradient_budget,
                cached=options.gradient_cache,
                floor=options.gradient_floor,
                unbiased=options.unbiased_gradients,
            )
            if up
            else make_pair("delta", options)[1],
        )
    return None


def run(
    model_dir: Path,
    mode: str,
    train: torch.Tensor,
    held: torch.Tensor,
    epochs: int,
    options: argparse.Namespace,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(options.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for _, p in apply_lora(model, lora_config(8, 16.0, 0.0, TARGETS), 0)]
    steps = epochs * ROWS // (MBS * MICROS)
    optimizer = torch.optim.AdamW(params, lr=5e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    pairs = [make_pair(mode, options) for _ in range(LAYERS - 1)]
    current: dict[str, Any] = {"rows": [], "keep": None}
    share = options.gradient_rows
    keep_gen = torch.Generator().manual_seed(11 + 100 * options.seed)

    def hooked(k: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> Any:
            h = out[0] if isinstance(out, tuple) else out
            top = k == LAYERS - 2  # the first boundary a gradient crosses on its way back
            scale = 1.0 / share if top else 1.0
            coded = Coded.apply(h, pairs[k], current["rows"], current["keep"], scale)
            return (coded, *out[1:]) if isinstance(out, tuple) else coded

        return hook

    for k in range(LAYERS - 1):
        model.model.layers[k].register_forward_hook(hooked(k))

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )

    def held_loss() -> float:
        saved = list(pairs)
        pairs[:] = [None] * len(pairs)  # evaluated uncompressed
        with torch.no_grad():
            value = float(loss_of(held)) / (held.shape[0] * (SEQ - 1))
        pairs[:] = saved
        return value

    epochs_out = []
    step_held: list[float] = []
    order_gen = torch.Generator().manual_seed(10 + 100 * options.seed)
    # --gradient-noise-scale: the top layer's adapters (above every boundary: no code touches
    # their gradients) measure the micro-batch gradients' noise against their signal.
    ids = {id(p) for p in params}
    top = [p for n, p in model.named_parameters() if f"layers.{LAYERS - 1}." in n and id(p) in ids]
    assert top, "no adapter above the last boundary"
    noise = NoiseScale(MICROS) if options.gradient_noise_scale is not None else None
    for _ in range(epochs):
        marks = [((p[0].bits, p[0].values), (p[1].bits, p[1].values)) if p else None for p in pairs]
        basis_marks = [getattr(p[0], "basis_bits", 0.0) if p else 0.0 for p in pairs]
        order = torch.randperm(ROWS, generator=order_gen)
        for s in range(0, ROWS, MBS * MICROS):
            idx = order[s : s + MBS * MICROS]
            for chunk in idx.split(MBS):
                current["rows"] = chunk.tolist()
                if share < 1.0 and mode != "none":
                    keep = torch.zeros(chunk.numel(), dtype=torch.bool)
                    n = max(1, round(share * chunk.numel()))
                    keep[torch.randperm(chunk.numel(), generator=keep_gen)[:n]] = True
                    current["keep"] = keep
                before = [p.grad.clone() if p.grad is not None else None for p in top]
                (loss_of(train[chunk]) / (idx.numel() * (SEQ - 1))).backward()
                if noise is not None:
                    noise.micro(top, before)
            if noise is not None:
                phi = noise.step(top)
                for p in pairs:
                    if p and isinstance(p[1], Sampled):
                        p[1].variance = options.gradient_noise_scale * phi
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step_held.append(held_loss())
        down, up = (rate(pairs, marks, d) for d in (0, 1))
        values = (
            sum(p[0].values - m[0][1] for p, m in zip(pairs, marks, strict=True)) if pairs[0] else 1
        )
        basis = (
            sum(
                getattr(p[0], "basis_bits", 0.0) - b
                for p, b in zip(pairs, basis_marks, strict=True)
            )
            if pairs[0]
            else 0.0
        )
        epochs_out.append({"down": down, "up": up, "held": step_held[-1], "bases": basis / values})
        if noise is not None:
            print(f"{mode}: epoch {len(epochs_out)}: noise {noise.phi:.3f}", flush=True)
    errors = None
    if mode == "allocated":
        errors = [
            math.sqrt(sum(p[d].error for p in pairs) / sum(p[d].norm for p in pairs))
            if isinstance(pairs[0][d], Allocated)
            else None
            for d in (0, 1)
        ]
    sampled = None
    if pairs[0] and isinstance(pairs[0][1], Sampled):
        ups = [p[1] for p in pairs]
        sampled = (
            sum(u.kept for u in ups) / sum(u.tokens for u in ups),
            sum(u.spread for u in ups) / sum(u.energy for u in ups),
            sum(u.captured for u in ups) / sum(u.energy for u in ups),
        )
    basis = None
    if pairs[0] and isinstance(pairs[0][0], Transformed):
        downs = [p[0] for p in pairs]
        basis = (
            sum(d.basis_bits for d in downs) / sum(d.values for d in downs),
            sum(d.sent_bases for d in downs) / len(downs),
            math.sqrt(sum(d.error for d in downs) / sum(d.norm for d in downs)),
        )
    return {
        "epochs": epochs_out,
        "steps": step_held,
        "errors": errors,
        "sampled": sampled,
        "basis": basis,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bigram.add_base_arguments(parser, default="pretrained", pretrain_steps=600)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--activation-budget",
        type=int,
        default=4,
        choices=(1, 2, 3, 4),
        help="allocated, transformed: activations' error budget is this many bits' (D_b ||x||^2)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the adapters' initialisation, the rows' order and the draws (0: the runs above)",
    )
    parser.add_argument(
        "--target",
        type=float,
        help="count the steps to this held-out loss (default: the first mode's final + 1 %%)",
    )
    parser.add_argument(
        "--refit",
        type=int,
        default=8,
        help="transformed: frames between fits of each basis (each fit is sent, h^2 bf16)",
    )
    parser.add_argument(
        "--gradient-budget",
        type=int,
        default=3,
        choices=(1, 2, 3, 4),
        help="allocated: gradients' error budget is this many bits'",
    )
    parser.add_argument(
        "--allocate",
        choices=("both", "activations", "gradients"),
        default="both",
        help="allocated: the direction(s) coded so; the other is coded as adaptive codes it",
    )
    parser.add_argument(
        "--gradient-floor",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="allocated: the fewest bits a gradient block gets (0: a block may be left out)",
    )
    parser.add_argument(
        "--unbiased-gradients",
        action="store_true",
        help="allocated: gradient codes round stochastically (unbiased; lowbit's seeded mode)",
    )
    parser.add_argument(
        "--gradient-bits",
        type=int,
        default=3,
        choices=(1, 2, 3, 4),
        help="adaptive, delta: the gradients' bits (every value, rotated, nearest; 3, the"
        " figures in docs/ were measured so; a job's default is 2 since 2026-12-07)",
    )
    parser.add_argument(
        "--gradient-sample",
        type=float,
        default=1.0,
        help="adaptive, delta: gradients of this share of the tokens only, sampled in"
        " proportion to their norms and scaled to stay unbiased (`Sampled`)",
    )
    parser.add_argument(
        "--gradient-variance",
        type=float,
        help="as --gradient-sample, but the fewest tokens whose sampling variance is at most"
        " this times the gradients' energy",
    )
    parser.add_argument(
        "--gradient-noise-scale",
        type=float,
        help="as --gradient-variance, with a budget of this times the micro-batch gradients'"
        " noise against their signal (`NoiseScale`, measured on the top layer's adapters,"
        " above every boundary), step by step",
    )
    parser.add_argument(
        "--gradient-lowrank",
        type=int,
        default=0,
        help="with --gradient-sample: each micro-batch's gradients' best rank-R approximation"
        " (SVD; both factors rotated 4-bit, counted) crosses whole and only what it misses is"
        " sampled: a control variate that leaves the code unbiased",
    )
    parser.add_argument(
        "--gradient-scatter",
        action="store_true",
        help="with --gradient-variance: the budget is that times the tokens' scatter around"
        " their mean (the noise a micro-batch already has) instead of their energy",
    )
    parser.add_argument(
        "--sample-below",
        type=float,
        help="with --gradient-sample or --gradient-variance: sample only the gradients of rows"
        " whose activation moved less than this share of its norm since its last crossing",
    )
    parser.add_argument(
        "--gradient-rows",
        type=float,
        default=1.0,
        help="the share of a micro-batch's rows whose gradients cross the boundaries (the same"
        " rows at each, chosen at random, scaled by its inverse; the others' are zero)",
    )
    parser.add_argument(
        "--weight-floor",
        type=float,
        default=0.1,
        help="weighted: the least weight a token's error gets (its gradient's energy over its"
        " row's mean)",
    )
    parser.add_argument(
        "--no-gradient-cache",
        dest="gradient_cache",
        action="store_false",
        help="allocated: code gradients against zero, never against last epoch's",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: {args.modes!r}: give {', '.join(MODES)}, comma-separated")
    torch.set_num_threads(1)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, perm = bigram.base(
            args,
            tiny_model_dir(Path(tmp) / "m", layers=LAYERS, hidden=HIDDEN, max_shard_size="2MB"),
            Path(tmp) / "base",
            seq=SEQ,
        )
        train = bigram.rows(ROWS, SEQ, 2, perm)
        held = bigram.rows(32, SEQ, 99, perm)
        results = {m: run(model_dir, m, train, held, args.epochs, args) for m in modes}
    wall = time.monotonic() - started
    print(
        f"\n{args.base} base"
        + (f", {args.shift:.0%} of successors changed" if perm is not None else "")
        + f"; {args.epochs} epochs of {ROWS // (MBS * MICROS)} steps;"
        + f" entropy {bigram.entropy():.4f}; {wall:.0f} s\n"
    )
    head = " | ".join(f"epoch {e + 1}" for e in range(args.epochs))
    print(f"| mode | direction | {head} | run | x bf16 |")
    print("|---|---|" + "---|" * (args.epochs + 2))
    for m, r in results.items():
        for d, name in (("down", "activations"), ("up", "gradients")):
            per = [e[d] for e in r["epochs"]]
            run_bits = sum(per) / len(per)
            cells = " | ".join(f"{b:.2f}" for b in per)
            print(
                f"| {m} | {name}, bits a value | {cells} | {run_bits:.2f} | {16 / run_bits:.1f}x |"
            )
        if r.get("basis"):
            per = [e["down"] - e["bases"] for e in r["epochs"]]
            run_bits = sum(per) / len(per)
            cells = " | ".join(f"{b:.2f}" for b in per)
            print(
                f"| {m} | activations without the bases | {cells} | {run_bits:.2f} |"
                f" {16 / run_bits:.1f}x |"
            )
        cells = " | ".join(f"{e['held']:.4f}" for e in r["epochs"])
        last = r["epochs"][-1]["held"] / results[modes[0]]["epochs"][-1]["held"] - 1
        print(f"| {m} | held-out loss | {cells} | {last * 100:+.2f} % vs {modes[0]} | |")
    given = args.target is not None
    target = args.target if given else results[modes[0]]["steps"][-1] * 1.01
    named = "--target" if given else f"{modes[0]}'s final held-out loss + 1 %"
    print(f"\nsteps to {target:.4f} ({named}):")
    for m, r in results.items():
        reached = steps_to(r["steps"], target)
        print(f"- {m}: {'never' if reached is None else reached} of {len(r['steps'])}")
    for m, r in results.items():
        if r.get("sampled"):
            share, spread, captured = r["sampled"]
            print(
                f"\n{m}: gradients of {share:.1%} of the tokens, sampling variance {spread:.2f}"
                f" of their energy; {captured:.1%} of it in the shared part"
            )
    for m, r in results.items():
        if r.get("basis"):
            bits, sent, err = r["basis"]
            print(
                f"\n{m}: bases sent {sent:.0f} a boundary, {bits:.3f} bits a value of the run's"
                f" activations (included above); realised relative error {err:.3f}"
            )
    if "allocated" in results:
        a, g = (f"{e:.3f}" if e is not None else "-" for e in results["allocated"]["errors"])
        print(
            f"\nallocated: realised relative error {a} (activations), {g} (gradients);"
            f" today's bounds {math.sqrt(D[4]):.3f} and {math.sqrt(D[3]):.3f}"
        )


if __name__ == "__main__":
    main()
