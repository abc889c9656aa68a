"""The benchmarks' language, and a base model that already knows most of it.

A noisy bigram language over ``VOCAB`` tokens: each token is followed by its successor (a
fixed permutation) with probability 0.9, by a uniformly random token otherwise. Its entropy
(`entropy`) is the lowest eval loss any model can reach, so a benchmark can say how far a
run is from done, not only how it compares with another run.

Two ways to fine-tune on it (bench/bench_outer_sync.py, bench/bench_delta_boundary.py):
from a random model, where the LoRA learns the whole language from nothing (hard, far
from done after thousands of steps), or from a base pretrained in full on the language
with a share of its successors changed (`successors(shifted)`, `pretrain`): the
fine-tune learns the change, as a real one learns a new task on a base that already
knows the rest.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

VOCAB = 300
NOISE = 0.1


def successors(shifted: float = 0.0) -> torch.Tensor:
    """Each token's successor: a fixed permutation, with a random `shifted` share of the
    tokens given each other's successors (the fine-tuning language against the base's)."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    if shifted:
        gen = torch.Generator().manual_seed(7)
        moved = torch.randperm(VOCAB, generator=gen)[: int(shifted * VOCAB)]
        perm = perm.clone()
        perm[moved] = perm[moved[torch.randperm(moved.numel(), generator=gen)]]
    return perm


def rows(
    n: int, seq: int, seed: int | torch.Generator, perm: torch.Tensor | None = None
) -> torch.Tensor:
    """`n` rows of `seq` tokens of the language of `perm` (default: `successors()`), drawn
    from a generator seeded with `seed` (or from `seed`, a generator, where it stands)."""
    perm = successors() if perm is None else perm
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    x = torch.empty(n, seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=gen)
    for t in range(1, seq):
        noise = torch.rand(n, generator=gen) < NOISE
        x[:, t] = torch.where(
            noise, torch.randint(0, VOCAB, (n,), generator=gen), perm[x[:, t - 1]]
        )
    return x


def entropy() -> float:
    """The eval loss (nats a token after the first) of a model that knows the language
    exactly: the successor has probability 0.9 + 0.1 / VOCAB, every other token
    0.1 / VOCAB."""
    right, other = 1 - NOISE + NOISE / VOCAB, NOISE / VOCAB
    return -(right * math.log(right) + (VOCAB - 1) * other * math.log(other))


def pretrain(
    model_dir: Path, out: Path, *, steps: int, rows_per_step: int = 16, seq: int = 24
) -> Path:
    """The model of `model_dir` trained in full on `successors()` (`fit`, AdamW 3e-3) for
    `steps` steps of `rows_per_step` rows, saved with its tokenizer files in `out`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    fit(model, steps=steps, rows_per_step=rows_per_step, seq=seq)
    model.save_pretrained(str(out))
    for f in model_dir.iterdir():  # the tokenizer's files
        weights = f.name.startswith(("config", "model", "generation"))
        if f.is_file() and not weights and not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def fit(
    model: torch.nn.Module, *, steps: int, rows_per_step: int = 16, seq: int = 24, lr: float = 3e-3
) -> float:
    """Train every parameter of `model`, in place on the device it lives on, on
    `successors()`: AdamW at `lr`, cosine to zero, clipped at 1, `steps` steps of
    `rows_per_step` rows of `seq` tokens. Returns the mean loss of the last tenth of the
    steps (against `entropy()`, how well the model learnt the language)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    device = next(model.parameters()).device
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    data = rows(steps * rows_per_step, seq, seed=11)
    positions = torch.arange(seq, device=device).expand(rows_per_step, -1)
    tail: list[torch.Tensor] = []
    for step, batch in enumerate(torch.split(data, rows_per_step)):
        ids = batch.to(device)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= steps - max(steps // 10, 1):
            tail.append(loss.detach())
    return float(torch.stack(tail).mean())


def fit_cached(
    model: torch.nn.Module,
    cache: Path | None,
    *,
    steps: int,
    rows_per_step: int = 16,
    seq: int = 24,
    lr: float = 3e-3,
) -> float:
    """`fit`, or the parameters a `fit` of the same model left in `cache` (a folder; None:
    always fit): a width of 1024 takes 15-17 minutes of a CPU thread to pretrain, the same
    each call. The key is everything the result depends on: the parameters as drawn, the
    arguments, this file (the language and `fit` itself), torch's version, the device's
    type and the float32 matmul precision. Returns `fit`'s loss, stored beside them."""
    import hashlib
    import json
    import os

    from safetensors.torch import load_file, save_file

    if cache is None:
        return fit(model, steps=steps, rows_per_step=rows_per_step, seq=seq, lr=lr)
    params = dict(model.named_parameters())
    key = hashlib.sha256(Path(__file__).read_bytes())
    for name, p in sorted(params.items()):
        key.update(name.encode())
        key.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    device = next(model.parameters()).device
    key.update(
        json.dumps(
            [steps, rows_per_step, seq, lr, torch.__version__, device.type,
             torch.get_float32_matmul_precision()]
        ).encode()
    )  # fmt: skip
    where = cache / key.hexdigest()[:32]
    weights, meta = where.with_suffix(".safetensors"), where.with_suffix(".json")
    if weights.is_file() and meta.is_file():
        stored = load_file(str(weights), device=str(device))
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(stored[name])
                p.requires_grad_(True)  # as `fit` leaves them
        model.train()
        return float(json.loads(meta.read_text())["loss"])
    loss = fit(model, steps=steps, rows_per_step=rows_per_step, seq=seq, lr=lr)
    cache.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().cpu().contiguous() for n, p in params.items()}
    # A part of this process's own: two runs that pretrain the same base at once each write
    # it whole, and the last rename wins with the same bytes.
    part = cache / f"{weights.name}.{os.getpid()}.part"
    save_file(state, str(part))
    part.replace(weights)  # the weights whole before the file that says they are there
    part = cache / f"{meta.name}.{os.getpid()}.part"
    part.write_text(json.dumps({"loss": loss, "steps": steps, "seq": seq, "lr": lr}))
    part.replace(meta)
    return loss


def fit_lr(hidden: int) -> float:
    """`fit`'s learning rate for a model of width `hidden`: 3e-3 up to the width the CPU
    benchmarks use (256), shrinking as 1 / width beyond it (Adam moves every weight by about
    the rate, and a matmul's output by the width times that: 3e-3 at an 8B's width, 4096,
    would throw the model about; 1.9e-4 moves its logits as far a step as 3e-3 does at 256)."""
    return 3e-3 * min(1.0, 256 / hidden)


def add_base_arguments(
    parser: argparse.ArgumentParser, *, default: str, pretrain_steps: int
) -> None:
    """A benchmark's `--base`, `--shift` and `--pretrain-steps` (see `base`)."""
    parser.add_argument(
        "--base",
        choices=("random", "pretrained"),
        default=default,
        help="fine-tune a random model (the LoRA learns the language from nothing) or one "
        "pretrained on a language that differs in a share of its successors (--shift)",
    )
    parser.add_argument(
        "--shift", type=float, default=0.25, help="with --base pretrained: the share changed"
    )
    parser.add_argument(
        "--pretrain-steps", type=int, default=pretrain_steps, help="with --base pretrained"
    )


def base(
    args: argparse.Namespace, model_dir: Path, out: Path, *, rows_per_step: int = 16, seq: int = 24
) -> tuple[Path, torch.Tensor | None]:
    """The model a benchmark fine-tunes, as `add_base_arguments`' options say, and the
    successors of its fine-tuning language (None: the base language): `model_dir` itself,
    or the model pretrained on the base language in `out`."""
    if args.base != "pretrained":
        return model_dir, None
    pretrained = pretrain(
        model_dir, out, steps=args.pretrain_steps, rows_per_step=rows_per_step, seq=seq
    )
    return pretrained, successors(args.shift)
