"""Four pipelines' outer steps: bytes against exact data parallelism, loss against exact.

    .venv/bin/python bench/bench_outer_sync.py [--quick] [--steps S] [--json OUT]
        [--base random|pretrained] [--shift S] [--seed N]

The maths of periodic synchronisation with a cheaper outer step, in one process (one
unsplit model per pipeline, as `testkit.references.run_periodic_reference` does; no links):
a 4-layer, 64-wide tiny Llama with LoRA r8 on every linear layer learns a noisy bigram
language (each token followed by a fixed permutation of itself, 10 % random), four
pipelines each training one micro-batch of 4 x 24 tokens of every step. Side by side:

- `exact synchronous`: one model stepping on the whole step (what synchronous data
  parallelism computes, bit for bit: tests/unit/test_worker_dataparallel.py);
- `periodic`, every H steps (and after the last) an outer step that either averages the
  factors one by one (`naive`, what periodic sync does) or merges the adapters exactly
  (`exact`: the means plus the aggregation bias folded into the frozen weight,
  model/lora_merge.py; the worker's `loraMerge: exact`), or trains B alone with every A frozen at
  its shared initialisation (`frozen-a`: LoRA-FA; averaging B is then the exact mean of
  B @ A, with no state beyond the adapter, and half the values to send), or trains B and A
  in turn (`alternating`, after RoLoRA: between two outer steps one factor rests, the same in
  every pipeline, so averaging the other is the exact mean of B @ A, and only it is sent;
  B trains first, A from the second outer step, and so on), sending the
  weights in float64
  (`outerCode: float64`) or each pipeline's update since the last outer step as an
  error-fed rotated low-bit code (`int4`, `int2`, `int1`; replicas/outer_codec.py, the
  rotation of the step; every pipeline gets every pipeline's code and decodes the same
  mean, which the exact merge then merges).

With `--base pretrained` the model is first trained in full on the language
(`testkit/bigram.py`, `--pretrain-steps`), and the LoRA fine-tunes it on the language with a
share of its successors changed (`--shift`): a fine-tune that learns a change, where the
default (a random model) has its LoRA learn the whole language. `--seed` changes the
training order and the LoRA's initialisation, not the held-out rows or the base.

Bytes per optimizer step are the bytes on every replica link of a star (R - 1 followers
and one leader), against exact synchronous data parallelism priced as its lightest exact
exchange: a bf16 gradient up and the bf16 sum down, every step. `float64` sends the weights
and token weights up and the folded mean down (periodic.py); with the exact merge every
pipeline needs every pipeline's factors, so the leader sends each follower the R - 1 it
lacks, as the worker's star does with codes (gathered: `stats.OUTER_CODES`). Eval loss is
on 8 held-out batches after the last step; `vs exact` is its relative difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "testkit")]

from relaytrain_contract import TrainingSpec  # noqa: E402
from relaytrain_testkit import bigram  # noqa: E402
from relaytrain_testkit.tiny_models import tiny_model_dir  # noqa: E402
from relaytrain_worker.model import lora_merge  # noqa: E402
from relaytrain_worker.model.methods import apply_lora, lora_config  # noqa: E402
from relaytrain_worker.model.training import make_optimizer, optimizer_step  # noqa: E402
from relaytrain_worker.pipeline.schedule import token_loss_sum  # noqa: E402
from relaytrain_worker.replicas import outer_codec  # noqa: E402
from relaytrain_worker.state.data import MicroBatch  # noqa: E402

R, SEQ, ROWS = 4, 24, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Outcome:
    config: str
    eval_loss: float
    vs_exact: float
    """Relative eval-loss difference from exact synchronous training."""
    bytes_per_step: float
    ratio: float
    """Exact synchronous data parallelism's bytes per step over this configuration's."""


def bigram_batches(
    steps: int, seed: int, perm: torch.Tensor | None = None
) -> list[list[MicroBatch]]:
    gen = torch.Generator().manual_seed(seed)

    def one() -> MicroBatch:
        x = bigram.rows(ROWS, SEQ, gen, perm)
        pos = torch.arange(SEQ).expand(ROWS, -1).contiguous()
        return MicroBatch(x, torch.ones_like(x), pos, x.clone())

    return [[one() for _ in range(R)] for _ in range(steps)]


def build(
    model_dir: Path, training: TrainingSpec, frozen_a: bool = False
) -> tuple[Any, list[tuple[str, torch.nn.Parameter]], Any, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = apply_lora(model, lora_config(8, 16.0, 0.0, TARGETS), training.seed)
    if frozen_a:  # every pipeline's A is the same seeded initialisation, and stays so
        for _, param in trainable:
            param.requires_grad_(".lora_A" not in _)
        trainable = [(n, p) for n, p in trainable if p.requires_grad]
    model.train()
    return (model, trainable, *make_optimizer(trainable, training))


def train_step(
    model: Any,
    trainable: list[tuple[str, torch.nn.Parameter]],
    micros: list[MicroBatch],
    clip: float,
    resting: str | None = None,
) -> None:
    """One step's gradients, clipped; the factor `resting` (".lora_A" or ".lora_B") is left
    without one, so that the optimizer leaves it as it is (AdamW skips a parameter whose
    gradient is None)."""
    items = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in micros)
    for mb in micros:
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
        (token_loss_sum(logits, mb.labels) / items).backward()
    if resting is not None:
        for name, p in trainable:
            if resting in name:
                p.grad = None
    torch.nn.utils.clip_grad_norm_([p for _, p in trainable if p.grad is not None], clip)


def evaluate(model: Any, held: list[MicroBatch]) -> float:
    total, items = 0.0, 0
    with torch.no_grad():
        for mb in held:
            logits = model(
                input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False
            ).logits
            total += float(token_loss_sum(logits, mb.labels))
            items += int((mb.labels[:, 1:] != -100).sum())
    return total / items


def run_exact(
    model_dir: Path, training: TrainingSpec, steps: list[list[MicroBatch]], held: list[MicroBatch]
) -> tuple[float, int]:
    model, trainable, optimizer, scheduler = build(model_dir, training)
    for micros in steps:
        train_step(model, trainable, micros, training.max_grad_norm)
        optimizer_step(optimizer, scheduler)
    return evaluate(model, held), sum(p.numel() for _, p in trainable)


def run_periodic(
    model_dir: Path,
    training: TrainingSpec,
    steps: list[list[MicroBatch]],
    held: list[MicroBatch],
    *,
    every: int,
    merge: str,
    code: str,
    outer: tuple[float, float] = (1.0, 0.0),
) -> tuple[float, int]:
    """Eval loss and total replica-link bytes of a periodic run (see the module docstring);
    `outer`: the outer step's learning rate and Nesterov momentum ((1, 0): the mean)."""
    exact = merge == "exact"
    replicas = [build(model_dir, training, frozen_a=merge == "frozen-a") for _ in range(R)]
    layers = [lora_merge.lora_layers(r[0]) for r in replicas]
    params = [dict(r[1]) for r in replicas]
    anchor = {n: p.detach().clone() for n, p in replicas[0][1]}
    residual = [{n: torch.zeros_like(p) for n, p in r[1]} for r in replicas]
    bits = None if code == "float64" else outer_codec.bits_of(code)
    sent, rounds = 0, 0
    velocity: dict[str, torch.Tensor] = {}
    for s, micros in enumerate(steps):
        # Alternating: B trains while every A rests (round 0: B is zero, so A would learn
        # nothing first), then A while B rests, and so on, one outer step each.
        resting = None if merge != "alternating" else (".lora_A", ".lora_B")[rounds % 2]
        for q, (model, trainable, optimizer, scheduler) in enumerate(replicas):
            train_step(model, trainable, [micros[q]], training.max_grad_norm, resting)
            optimizer_step(optimizer, scheduler)
        if (s + 1) % every and s + 1 != len(steps):
            continue
        rounds += 1
        with torch.no_grad():
            held_by = {}  # per name: every pipeline's value as the others receive it
            for name, base in anchor.items():
                if resting is not None and resting in name:
                    continue  # the same in every pipeline: nothing to send or average
                if bits is None:
                    held_by[name] = [p[name].detach().clone() for p in params]
                    size = 8 * (base.numel() + 1)
                    sent += (R - 1) * (R * size if merge in ("exact", "projected") else 2 * size)
                    continue
                values = []
                for q in range(R):
                    update = params[q][name].detach() - base + residual[q][name]
                    c, residual[q][name] = outer_codec.encode(update, 1.0, bits, s + 1)
                    decoded = outer_codec.decode(c, base.numel(), bits, s + 1)[1]
                    values.append(base + decoded.reshape(base.shape))
                # The star: every follower sends its code and gets the R - 1 others.
                sent += (R - 1) * R * outer_codec.code_bytes(base.numel(), bits)
                held_by[name] = values
            means = {n: (sum(v.double() for v in vs) / R).float() for n, vs in held_by.items()}
            for module in layers[0] if merge in ("naive", "exact", "projected") else ():
                b_name = next(n for n in anchor if n.startswith(module + ".lora_B"))
                a_name = next(n for n in anchor if n.startswith(module + ".lora_A"))
                factors = [(1.0, held_by[b_name][q], held_by[a_name][q]) for q in range(R)]
                means[b_name], means[a_name], fold = lora_merge.exact_merge(factors)
                if merge == "projected":
                    means[b_name] = _projected_b(factors, means[a_name])
                if exact:
                    for q in range(R):
                        lora_merge.fold_into(layers[q][module], fold)
            for name, mean in means.items():
                new = mean
                if outer != (1.0, 0.0):  # DiLoCo's outer Nesterov step on the mean update
                    lr, mu = outer
                    delta = mean - anchor[name]
                    velocity[name] = mu * velocity.get(name, torch.zeros_like(delta)) + delta
                    new = anchor[name] + lr * (delta + mu * velocity[name])
                for q in range(R):
                    params[q][name].copy_(new)
                anchor[name] = new.clone()
    return evaluate(replicas[0][0], held), sent


def _projected_b(
    factors: list[tuple[float, torch.Tensor, torch.Tensor]], a_mean: torch.Tensor
) -> torch.Tensor:
    """The B that, with the mean A, comes nearest the mean of B_q @ A_q (least squares):
    ``sum_q w_q B_q (A_q mean(A)^T) / sum_q w_q`` times ``(mean(A) mean(A)^T)^-1``; only
    r x r products, no dense matrix."""
    a = a_mean.double()
    total = sum(w for w, _, _ in factors)
    m = sum(w * (b.double() @ (q.double() @ a.T)) for w, b, q in factors) / total
    return torch.linalg.solve(a @ a.T, m.T).T.to(a_mean.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 steps, four configurations")
    parser.add_argument("--steps", type=int, help="steps per run (default 300)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--merges",
        default="naive,exact",
        help="merges to run, of naive, exact, frozen-a and alternating",
    )
    parser.add_argument(
        "--outer",
        default="1,0",
        help="the outer step's learning rate and Nesterov momentum (DiLoCo: 0.7,0.9)",
    )
    parser.add_argument("--grid", help="intervals and codes, e.g. 16:float64,64:int2")
    bigram.add_base_arguments(parser, default="random", pretrain_steps=1500)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="another training order and LoRA initialisation (the held-out rows and the base stay)",
    )
    args = parser.parse_args()
    outer = tuple(float(x) for x in args.outer.split(","))
    torch.set_num_threads(1)
    n_steps = args.steps or (60 if args.quick else 300)
    training = TrainingSpec(
        steps=n_steps, micro_batch_size=ROWS, micro_batches=R, learning_rate=1e-2,
        schedule="cosine", warmup_steps=5, weight_decay=0.0, max_grad_norm=1.0, seed=3 + args.seed,
    )  # fmt: skip
    grid = (
        [(16, "float64"), (16, "int2")]
        if args.quick
        else [(16, c) for c in ("float64", "int4", "int2", "int1")]
        + [(32, "float64"), (32, "int2"), (64, "int2")]
    )
    if args.grid:
        grid = [(int(h), c) for h, c in (x.split(":") for x in args.grid.split(","))]
    merges = args.merges.split(",")
    if not set(merges) <= {"naive", "exact", "frozen-a", "alternating", "projected"}:
        parser.error(
            f"--merges: {args.merges!r}: give naive, exact, frozen-a or alternating, "
            "comma-separated"
        )
    configs = [
        (f"periodic every {h}, {code}, {merge} merge", h, merge, code)
        for h, code in grid
        for merge in merges
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, perm = bigram.base(
            args,
            tiny_model_dir(Path(tmp) / "llama", layers=4, hidden=64),
            Path(tmp) / "base",
            rows_per_step=R * ROWS,
            seq=SEQ,
        )
        steps, held = (
            bigram_batches(n_steps, 2 + 100 * args.seed, perm),
            bigram_batches(2, 99, perm),
        )
        held_out = [mb for step in held for mb in step]
        started = time.monotonic()
        untrained = evaluate(build(model_dir, training)[0], held_out)
        base_loss, trainable = run_exact(model_dir, training, steps, held_out)
        baseline = (R - 1) * 2 * 2 * trainable  # bf16 gradient up and bf16 sum down, per step
        outcomes = [Outcome("exact synchronous", base_loss, 0.0, baseline, 1.0)]
        for name, every, merge, code in configs:
            loss, sent = run_periodic(
                model_dir, training, steps, held_out, every=every, merge=merge, code=code,
                outer=(outer[0], outer[1]),
            )  # fmt: skip
            per_step = sent / n_steps
            outcomes.append(
                Outcome(name, loss, loss / base_loss - 1, per_step, baseline / per_step)
            )
        wall = time.monotonic() - started
    print(
        f"\n{n_steps} steps, 4 pipelines, LoRA r8 ({trainable:,} trainable values), {wall:.0f} s;"
        f" eval loss before training {untrained:.4f},"
        f" the language's entropy {bigram.entropy():.4f}\n"
    )
    print("| configuration | eval loss | vs exact | bytes per step | fewer bytes than exact DP |")
    print("|---|---|---|---|---|")
    for o in outcomes:
        print(
            f"| {o.config} | {o.eval_loss:.4f} | {o.vs_exact * 100:+.2f} % "
            f"| {o.bytes_per_step:,.0f} | {o.ratio:,.0f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))


if __name__ == "__main__":
    main()
