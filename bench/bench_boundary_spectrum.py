"""How many bits a value a boundary's activations need at int4's error, in a rotated basis (what
the links' codes use) and in a basis fitted to them (transform coding), on a real model; with
``--gradients``, the same for the gradients that go back, at a 3-bit code's error.

Run: OMP_NUM_THREADS=2 .venv/bin/python bench/bench_boundary_spectrum.py [--rows 16] [--seq 512]
    [--gradients]

SmolLM2-135M-Instruct (the model `make deps` prepares) reads rows of 512 tokens of this
repository's own docs (English and code, nothing from a hub), and the hidden states at the
three boundaries of a four-stage split (after layers 7, 15 and 22 of 30) are collected, each
token normalised to a mean square of 1 (a code's scale takes its norm: the massive
activations of a few tokens would otherwise decide the spectrum). Reported per boundary, as
rate-distortion bounds of a Gaussian source at the error int4's code allows a token,
``D_4 ||x||^2`` (`lowbit.DISTORTION`):

- ``rotated``: every coordinate alike, ``log2(1 / D_4) / 2`` bits a value (a Hadamard
  rotation spreads a token's energy evenly; the links' codes are rotated);
- ``per channel``: bits by reverse water-filling over the channels' own variances (a basis
  that is the identity);
- ``fitted``: the same over the eigenvalues of the tokens' second moment (the
  Karhunen-Loeve basis), fitted on the first half of the rows and measured on the second
  (a basis is fitted on what a link sent before), and fitted on all of them (in-sample);
- the eigenvectors that hold 90 % of the energy.

Bounds, not codes: a code of 0-8 bits a block of 64 with a scale each pays about a bit a
value over them (bench/bench_boundary_allocation.py's ``transformed`` mode measures one).

``--gradients``: the rows' language-model loss is backpropagated and each boundary's gradient
taken instead, each token normalised alike (the gradients' tokens a share of which is drawn
cross at equal norms, `sampling.py`), at ``D_3``, the gradients' 3-bit code's error. A basis
fitted to them would save what ``rotated`` minus ``fitted, on other rows`` says
(docs/links-and-checkpoints.md, "Gradients at one bit").
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "worker_image"), str(REPO / "testkit")]

from relaytrain_testkit.demo_job import model_dir  # noqa: E402
from relaytrain_worker.pipeline.lowbit import DISTORTION  # noqa: E402

D4 = DISTORTION[4]
D3 = DISTORTION[3]


def water_filling(variances: torch.Tensor, distortion: float) -> float:
    """Bits a value of Gaussian components of `variances` at a mean error of `distortion` a
    component: reverse water-filling, ``sum max(0, log2(v_i / theta) / 2) / n``."""
    v = variances.double().clamp_min(1e-30)
    lo, hi = 0.0, float(v.max())
    for _ in range(200):
        theta = (lo + hi) / 2
        lo, hi = (
            (lo, theta) if float(v.clamp(max=theta).sum()) > distortion * len(v) else (theta, hi)
        )
    return float((0.5 * torch.log2(v / lo)).clamp_min(0).sum()) / len(v)


def basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (largest first) and eigenvectors of the rows' second moment."""
    values, vectors = torch.linalg.eigh(x.T @ x / x.shape[0])
    return values.flip(0), vectors.flip(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument(
        "--gradients", action="store_true", help="the gradients going back, at 3 bits' error"
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = model_dir()
    if not (where / "config.json").exists():
        parser.error(f"no model at {where}: run `make deps` first")
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    rows = min(args.rows, ids.numel() // args.seq)
    batch = ids[: rows * args.seq].view(rows, args.seq)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32)
    layers = model.model.layers
    picks = [len(layers) * k // 4 - 1 for k in (1, 2, 3)]
    seen: dict[int, list[torch.Tensor]] = {k: [] for k in picks}

    def keep(k: int, out: torch.Tensor) -> None:
        if not args.gradients:
            seen[k].append(out.detach())
        elif out.requires_grad:
            out.register_hook(lambda g: seen[k].append(g.detach()))

    for k in picks:
        layers[k].register_forward_hook(
            lambda _m, _a, out, k=k: keep(k, out[0] if isinstance(out, tuple) else out)
        )
    for chunk in batch.split(4):
        with torch.set_grad_enabled(args.gradients):
            out = model(input_ids=chunk, labels=chunk, use_cache=False)
        if args.gradients:
            out.loss.backward()
    error, what, code = (D3, "gradients", "a 3-bit") if args.gradients else (D4, "", "int4's")
    white = 0.5 * math.log2(1 / error)
    print(f"\nSmolLM2-135M-Instruct, {rows} rows of {args.seq} tokens of docs/*.md; bits a value")
    print(f"of the boundaries' {what or 'activations'} at {code} error (bounds); the fitted")
    print("basis fitted on the first half of the rows\n")
    print(
        "| boundary | rotated | per channel | fitted, on other rows | fitted, in-sample | 90 % in |"
    )
    print("|---|---|---|---|---|---|")
    for k in picks:
        h = seen[k][0].shape[-1]
        x = torch.cat(seen[k]).reshape(rows, args.seq, h).double()
        x = x / x.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-30)
        first, second = x[: rows // 2].reshape(-1, h), x[rows // 2 :].reshape(-1, h)
        whole = x.reshape(-1, h)
        channel = water_filling(whole.square().mean(dim=0), error)
        _, vectors = basis(first)
        outside = water_filling((second @ vectors).square().mean(dim=0), error)
        values, _ = basis(whole)
        inside = water_filling(values, error)
        share = values.cumsum(0) / values.sum()
        k90 = int((share < 0.9).sum()) + 1
        print(
            f"| after layer {k + 1} | {white:.2f} | {channel:.2f} | {outside:.2f} |"
            f" {inside:.2f} | {k90} of {h} |"
        )


if __name__ == "__main__":
    main()
