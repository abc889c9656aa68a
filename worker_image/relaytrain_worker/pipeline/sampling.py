"""Gradients of a share of the tokens (`pipeline.gradientTokens`): which tokens' gradients
cross a boundary, chosen at random, and scaled so that what crosses is unbiased.

A micro-batch's gradient at a stage boundary is one vector per token. With a share ``s`` < 1
each token ``i`` is sent with probability ``p_i = min(1, c ||g_i||)``, ``c`` chosen so that
``sum p_i = s T`` (T tokens with a gradient), and a token sent is divided by ``p_i``; the
others are zero. So ``E[sent] = g`` exactly (importance sampling: every token's expected
contribution is its own), and the variance it adds, ``sum (1 / p_i - 1) ||g_i||^2``, is the
least that any choice of independent tokens, ``s T`` on average, each divided by its
probability, can add. The stage before receives
the zeros as they are and backpropagates them: everything downstream of a boundary gradient
is linear in it, so its adapters' gradients stay unbiased too. The boundary code
(`boundary.py`) sends a token map and the nonzero tokens only: the bytes fall with ``s``.

When it pays: on a fine-tune of a pretrained base most tokens are ones the base already
predicts, their gradients are small and rarely sent: with a quarter of the tokens
bench/bench_delta_boundary.py's fine-tune ends within 1 % of uncompressed training's
held-out loss (+0.26 and +0.55 % in two runs), its gradients 19.5x fewer bytes than bf16.
When a LoRA learns from a random model every token has a large gradient and the sampling
noise keeps it from learning: +17 to +43 % held-out loss at a quarter
(docs/links-and-checkpoints.md). Hence a job's choice, off (1) by default. The share
trades bytes for steps: a quarter takes 47-63 steps to that fine-tune's target loss where
int8 takes 35-39, a half 41 in each of three seeds (the same runs, through the worker's
links; bench/bench_boundary_allocation.py simulates the draw's variance falling from 0.25 of
the gradients' energy to 0.05), at twice the bytes, which cost no time while a link's
busiest direction is the activations' (2026-12-01).

With `pipeline.gradientFill: activations` the share is a floor: a micro-batch's gradient
takes as many more tokens, up to all, as fit in the bytes its activations took on the same
link the other way (`share_within`). A link carries both directions at once and a step waits
for the busier, so those bytes cost no time while the activations' direction is the busier,
and the draw's noise, which costs steps, falls; the share then follows what the rows cost
(all of them while their first crossings are dear, fewer as their changes get cheap).

The draw is seeded by the job's seed, the step, the micro-batch and the stage, so a step
redone after a rollback sends the same tokens (with a fill, the same share too where the
activations took the same bytes; after a failure their rows cross as full codes again).
Hand-written: a few tensor operations no library offers in this form (torch.multinomial
samples without the inverse weights).
"""

from __future__ import annotations

import torch


def probabilities(norms: torch.Tensor, share: float) -> torch.Tensor:
    """Each token's probability of being sent, float64: ``min(1, c norms)`` with
    ``sum = share * (tokens with a norm above 0)`` (every such token when that is all of
    them), by bisection on ``c``; 0 for a token without a gradient."""
    n = norms.to(torch.float64)
    live = int((n > 0).sum())
    if live == 0:
        return torch.zeros_like(n)
    want = share * live
    if want >= live:
        return (n > 0).to(torch.float64)
    lo, hi = 0.0, 1.0 / float(n.max())
    while float(torch.clamp(hi * n, max=1.0).sum()) < want:
        lo, hi = hi, hi * 4
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(torch.clamp(mid * n, max=1.0).sum()) < want else (lo, mid)
    return torch.clamp(hi * n, max=1.0)


def token_norms(grad: torch.Tensor) -> torch.Tensor:
    """Each token's norm of ``grad`` (``[..., hidden]``), float32 on the CPU: what
    `sample_tokens` draws by and `share_within` counts the live tokens of."""
    norms: torch.Tensor = grad.detach().reshape(-1, grad.shape[-1]).float().norm(dim=1)
    return norms.cpu()


def sample_tokens(
    grad: torch.Tensor, share: float, seed: int, norms: torch.Tensor | None = None
) -> torch.Tensor:
    """``grad`` (``[..., hidden]``) with only a random ``share`` of its tokens (in
    expectation), each divided by its probability (`probabilities`), the others zero; the
    same tensor when ``share`` is 1. Same device and dtype. ``norms``: its `token_norms`,
    where the caller has them already."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"gradient token share must be above 0 and at most 1, got {share}")
    if share >= 1.0:
        return grad
    tokens = grad.detach().reshape(-1, grad.shape[-1])
    p = probabilities(token_norms(grad) if norms is None else norms, share)
    draw = torch.rand(p.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    kept = (draw < p).nonzero().reshape(-1)
    out = torch.zeros_like(tokens)
    # Divided in float64: a drawn token's norm becomes 1 / c whatever its p (no overflow).
    weights = p[kept].to(tokens.device)[:, None]
    out[kept.to(tokens.device)] = (tokens[kept.to(tokens.device)].double() / weights).to(grad.dtype)
    return out.reshape(grad.shape)


def share_within(
    grad: torch.Tensor,
    floor: float,
    room: int,
    value_bytes: float,
    norms: torch.Tensor | None = None,
) -> float:
    """The share of ``grad``'s tokens to send (`pipeline.gradientFill: activations`): the
    most whose code fits in ``room`` bytes, the bytes the micro-batch's activations took on
    the same link in the other direction, which a link leaves idle otherwise; never below
    ``floor`` (`pipeline.gradientTokens`), never above 1 (every token, sent without a map).
    A share ``s`` of the ``live`` tokens with a gradient costs about ``s live hidden
    value_bytes`` (``boundary.bytes_per_value`` of the gradients' bits), a bit a token for
    the map and ``FRAME_BYTES`` for the frame's header (deflate takes about 2 % off a
    gradient's codes: not counted, so the sum errs on the side of the room). ``norms``: its
    `token_norms`, where the caller has them already (a token is live where its norm is
    above 0, as `probabilities` counts them)."""
    if floor >= 1.0:
        return 1.0
    norms = token_norms(grad) if norms is None else norms
    live = int((norms > 0).sum())
    if live == 0:
        return 1.0
    codes = live * grad.shape[-1] * value_bytes
    fits = (room - FRAME_BYTES - norms.numel() / 8) / codes
    return min(1.0, max(floor, fits))


FRAME_BYTES = 96
"""What a gradient frame holds besides its token map and codes, about: its length word and
deflated header (about 50 bytes, docs/links-and-checkpoints.md) and the codes' block scales'
rounding."""


def seed_of(job_seed: int, step: int, micro: int, stage: int) -> int:
    """The draw's seed for one micro-batch's gradient leaving ``stage`` (splitmix64-mixed,
    so neighbouring steps and stages draw unrelated tokens)."""
    z = (job_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & _MASK64
    z = (z + micro * 0x94D049BB133111EB + stage * 0xD6E8FEB86659FD93) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1
