"""How many bits a value a boundary's activations need at int4's error, in a rotated basis (what
the links' codes use) and in a basis fitted to them (transform coding), on a real model; with
``--gradients``, the same for the gradients that go back, at a 3-bit code's error.

Run: OMP_NUM_THREADS=2 .venv/bin/python bench/bench_boundary_spectrum.py [--rows 16] [--seq 512]
    [--gradients]

SmolLM2-135M-Instruct (the model `make deps` prepares) reads rows of 512 tokens of pinned
packages' READMEs (`relaytrain_testkit.prose`: English and code that stays put, nothing from
a hub; docs/*.md until 2026-12-07), and the hidden states at the three boundaries of a
four-stage split (after layers 7, 15 and 22 of 30) are collected, each token normalised to a
mean square of 1 (a code's scale takes its norm: the massive activations of a few tokens
would otherwise decide the spectrum). Reported per boundary, as rate-distortion bounds of a
Gaussian source at the error int4's code allows a token, ``D_4 ||x||^2``
(`lowbit.DISTORTION`):

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

``--codes``: codes, not bounds. The worker's own ``delta`` codec (`boundary.codec_for`) codes
each boundary's rows as a link does, in frames of ``--frame-rows`` rows, once in the identity
and once in fitted bases (``pipeline.activationBasis: fitted``), at int4's and int3's error,
the hidden states as they are (bf16, not normalised): a first crossing of every row (full
codes), then a second, after the layers before the boundary moved by a random low-rank
update of ``--drift`` of each weight's norm on every linear layer (an adapter's step: deltas
against the first). Reported, of the frames coded after the first basis of their kind
(`transform.FIRST_FIT` frames in): bits a value of the rows' codes (the bases' own left out)
and the root of the mean of the tokens' squared relative errors as decoded; the rows in
fitted bases as a share of the identity's.

``--loss``: what a code's error costs the model itself. The language-model loss of the rows
(no training) with the hidden states at the three boundaries of the stage split a 4-stage
pipeline makes of the 30 layers (`relaytrain_testkit.inputs.even_splits`: after layers 8, 15
and 22) replaced by the receiving stage's decode of each row's first crossing (full codes, in
frames of ``--frame-rows`` rows), at int4's and at int3's error, in the identity and in
fitted bases, each against the loss of the rows as they are.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "worker_image"), str(REPO / "testkit")]

from relaytrain_testkit.demo_job import model_dir  # noqa: E402
from relaytrain_testkit.prose import prose  # noqa: E402
from relaytrain_worker.pipeline import transform  # noqa: E402
from relaytrain_worker.pipeline.boundary import codec_for  # noqa: E402
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


@dataclass
class Coded:
    """What a link sent of the frames of one kind past its first basis (`coded`)."""

    rows: int = 0
    """Bytes of the rows' codes."""
    bases: int = 0
    """Bytes of the bases the frames carried."""
    values: int = 0
    tokens: int = 0
    squared: float = 0.0
    """The sum of the tokens' squared relative errors, as decoded."""

    def bits(self) -> float:
        return 8 * self.rows / max(1, self.values)

    def error(self) -> float:
        """The root of the mean of the tokens' squared relative errors."""
        return math.sqrt(self.squared / max(1, self.tokens))


def coded(crossings: list[torch.Tensor], error: str, fitted: bool, frame_rows: int) -> list[Coded]:
    """Per crossing, what a link of ``error`` (``fitted``: in fitted bases) sent of the frames
    of ``crossings`` past the first `transform.FIRST_FIT` of their kind (one tensor of rows
    after another, the same rows each time: the first a full code of each, the later ones
    deltas), and how near the receiver's decode came (it decodes every frame, and installs the
    bases they carry)."""
    sender, receiver = codec_for(error, transform=fitted), codec_for(error, transform=fitted)
    out = []
    for x in crossings:
        got = Coded()
        for i, frame in enumerate(x.split(frame_rows)):
            rows = torch.arange(i * frame_rows, i * frame_rows + frame.shape[0])
            ((entry, parts),) = sender.encode("activation", {"hidden": frame, "rows": rows})
            sizes = [p.numel() * p.element_size() for p in parts]
            held = len(entry.get("bases", [])) * 3  # a basis is three parts, ahead of the rows
            it = iter(parts)
            y = receiver.decode("activation", entry, frame.dtype, lambda _n, _d, it=it: next(it))
            if i < transform.FIRST_FIT:
                continue
            truth = frame.float()
            each = (y.float() - truth).norm(dim=-1) / truth.norm(dim=-1).clamp_min(1e-30)
            got.rows += sum(sizes[held:])
            got.bases += sum(sizes[:held])
            got.values += frame.numel()
            got.tokens += each.numel()
            got.squared += float(each.square().sum())
        out.append(got)
    return out


def drifted(model: torch.nn.Module, drift: float, seed: int) -> None:
    """Adds to every linear weight of ``model``'s layers a random rank-8 update of ``drift``
    of its norm, as a LoRA's step moves the layers (in place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                b = torch.randn(w.shape[0], 8, generator=gen)
                a = torch.randn(8, w.shape[1], generator=gen)
                update = b @ a
                w += update * (drift * w.norm() / update.norm())


def codes(args: argparse.Namespace, hidden: dict[int, list[torch.Tensor]]) -> None:
    """``--codes``: the table of the worker's codes in the identity and in fitted bases."""
    print(
        f"\nThe worker's delta codes, frames of {args.frame_rows} rows, of the frames after the"
        f" first {transform.FIRST_FIT} of each kind: bits a value of the rows' codes and the"
        " root of the mean of the tokens' squared relative errors\n"
    )
    print(
        "| boundary | the row's energy in its largest token | crossing | error | identity:"
        " bits | tokens' error | fitted bases: bits | tokens' error | fitted / identity |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k, (first, second) in hidden.items():
        x = first.float()
        norms = x.norm(dim=-1)
        largest = float((norms.max(dim=-1).values.square() / norms.square().sum(dim=-1)).mean())
        moved = (second.float() - x).norm(dim=-1) / norms
        names = ("first (full codes)", f"second (deltas; tokens moved {moved.median():.1%})")
        for error in ("int4", "int3"):
            plain = coded([first, second], error, False, args.frame_rows)
            basis = coded([first, second], error, True, args.frame_rows)
            for name, a, b in zip(names, plain, basis, strict=True):
                print(
                    f"| after layer {k + 1} | {largest:.1%} | {name} | {error} | {a.bits():.3f} |"
                    f" {a.error():.3f} | {b.bits():.3f} | {b.error():.3f} |"
                    f" {b.bits() / a.bits():.3f} |"
                )


class Link:
    """One boundary's link, a first crossing of each row (full codes) in frames of
    ``frame_rows`` rows: what the receiving stage decodes."""

    def __init__(self, error: str, fitted: bool, frame_rows: int) -> None:
        self.ends = codec_for(error, transform=fitted), codec_for(error, transform=fitted)
        self.frame_rows, self.sent = frame_rows, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sender, receiver = self.ends
        out = []
        for frame in x.to(torch.bfloat16).split(self.frame_rows):
            rows = torch.arange(self.sent, self.sent + frame.shape[0])
            self.sent += frame.shape[0]
            ((entry, parts),) = sender.encode("activation", {"hidden": frame, "rows": rows})
            it = iter(parts)
            y = receiver.decode("activation", entry, frame.dtype, lambda _n, _d, it=it: next(it))
            out.append(y)
        return torch.cat(out).to(x.dtype)


def losses(args: argparse.Namespace, model: torch.nn.Module, batch: torch.Tensor) -> None:
    """``--loss``: the rows' loss with the boundaries' hidden states decoded (see above)."""
    from relaytrain_testkit.inputs import even_splits

    layers = model.model.layers  # type: ignore[union-attr]
    cuts = [end for _, end in even_splits(len(layers), 4)[:-1]]
    print(
        f"\nThe rows' loss, the hidden states after layers {', '.join(map(str, cuts))} decoded"
        f" (first crossings, frames of {args.frame_rows} rows)\n"
    )
    print("| boundaries | loss | against the rows as they are |")
    print("|---|---|---|")
    plain = None
    for error, fitted in ((None, False), ("int4", False), ("int4", True), ("int3", False),
                          ("int3", True)):  # fmt: skip
        links = {} if error is None else {c: Link(error, fitted, args.frame_rows) for c in cuts}

        def code(_m: object, _a: object, out: Any, link: Link) -> Any:
            if isinstance(out, tuple):
                return (link(out[0]), *out[1:])
            return link(out)

        hooks = [
            layers[c - 1].register_forward_hook(functools.partial(code, link=link))
            for c, link in links.items()
        ]
        total = 0.0
        with torch.no_grad():
            for chunk in batch.split(8):
                total += float(model(input_ids=chunk, labels=chunk, use_cache=False).loss)
        for hook in hooks:
            hook.remove()
        loss = total / len(batch.split(8))
        plain = loss if plain is None else plain
        name = (
            "as they are"
            if error is None
            else f"{error}, {'fitted bases' if fitted else 'identity'}"
        )
        print(f"| {name} | {loss:.4f} | {100 * (loss / plain - 1):+.2f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument(
        "--gradients", action="store_true", help="the gradients going back, at 3 bits' error"
    )
    parser.add_argument(
        "--codes", action="store_true", help="the worker's codes, identity and fitted bases"
    )
    parser.add_argument(
        "--loss", action="store_true", help="the loss with the boundaries decoded (no training)"
    )
    parser.add_argument("--frame-rows", type=int, default=2, help="rows a frame (--codes, --loss)")
    parser.add_argument(
        "--drift", type=float, default=0.05, help="the layers' update before the second crossing"
    )
    args = parser.parse_args()
    if args.gradients and (args.codes or args.loss):
        parser.error("--codes and --loss code the activations; leave out --gradients")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = model_dir()
    if not (where / "config.json").exists():
        parser.error(f"no model at {where}: run `make deps` first")
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    ids = tokenizer(prose(), return_tensors="pt").input_ids[0]
    rows = min(args.rows, ids.numel() // args.seq)
    batch = ids[: rows * args.seq].view(rows, args.seq)
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32)
    if args.loss:
        print(f"\nSmolLM2-135M-Instruct, {rows} rows of {args.seq} tokens of pinned READMEs")
        losses(args, model.eval(), batch)
        return
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
    if args.codes:
        passes = {k: [torch.cat(v).to(torch.bfloat16)] for k, v in seen.items()}
        drifted(model, args.drift, seed=0)
        for v in seen.values():
            v.clear()
        with torch.no_grad():
            for chunk in batch.split(4):
                model(input_ids=chunk, use_cache=False)
        for k, v in seen.items():
            passes[k].append(torch.cat(v).to(torch.bfloat16))
        print(f"\nSmolLM2-135M-Instruct, {rows} rows of {args.seq} tokens of pinned READMEs")
        codes(args, passes)
        return
    error, what, code = (D3, "gradients", "a 3-bit") if args.gradients else (D4, "", "int4's")
    white = 0.5 * math.log2(1 / error)
    print(f"\nSmolLM2-135M-Instruct, {rows} rows of {args.seq} tokens of pinned READMEs; bits a")
    print(f"value of the boundaries' {what or 'activations'} at {code} error (bounds); the fitted")
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
