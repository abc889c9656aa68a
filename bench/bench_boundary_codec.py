"""Low-bit boundary codecs: bits per value against error, one-shot and over epochs.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_boundary_codec.py [--quick] [--json OUT]

Payload bits per value (codes, scales, skip bitmap; no frame header) and the error of each
setting, as ``rel`` = ||decode - x|| / ||x|| and ``cos`` (cosine similarity, flattened):

(a) One shot, Gaussian activations [8, 128, 512] with four 30x outlier channels: bf16,
    compression.py's int8/int4, lowbit.py at 1-4 bits (nearest) and at 1-2 bits with
    stochastic rounding (unbiased, for gradients). ``rel rest`` is the error on the
    non-outlier channels alone (relative to their own norm).
(b) Four epochs of drifting samples (deltacache.py, one key per sample, 8 samples):
    ``x_e = x_0 + e * f * s * n``, n Gaussian, s the channel's spread, f = 0.5 %, 2 %, 5 %.
    Per setting (full-code bits F, delta bits D, skip threshold S): bits per value of each
    epoch, the average over the 4 epochs, bf16's 16 bits over that average, and the
    relative error of each epoch.
(c) The same on real hidden states: a random 4-layer tiny Llama (testkit, hidden 256),
    its hidden state after layer 2 for 8 samples of 128 tokens; each epoch the model's
    q/v projections of layers 0-1 move by a rank-4 update (as a LoRA would) of 1 % of their
    norm per epoch. The measured drift of the hidden state is printed.
(d) Gradients: the gradient of the tiny Llama's loss with respect to that hidden state,
    coded once with nearest and stochastic rounding at 1-2 bits; ``mean-of-16 rel`` is the
    error of the average of 16 independently seeded codes (unbiased codes: ~rel / 4).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "worker_image"), str(REPO / "testkit")]

from relaytrain_worker.pipeline import compression, lowbit  # noqa: E402
from relaytrain_worker.pipeline.deltacache import (  # noqa: E402
    DeltaConfig,
    DeltaReceiver,
    DeltaSender,
)

EPOCHS = 4
SETTINGS: list[tuple[int, int, float]] = [
    (2, 1, 0.0),
    (2, 1, 0.05),
    (2, 1, 0.1),
    (2, 1, 0.2),
    (1, 1, 0.05),
    (1, 1, 0.1),
    (1, 1, 0.2),
    (4, 1, 0.1),
    (4, 1, 0.2),
    (2, 2, 0.1),
]
"""(full bits, delta bits, skip_below) settings of the epoch runs."""


def _rel(y: torch.Tensor, x: torch.Tensor) -> float:
    return float(((y.double() - x.double()).norm() / x.double().norm()).item())


def _cos(y: torch.Tensor, x: torch.Tensor) -> float:
    a, b = y.double().reshape(-1), x.double().reshape(-1)
    return float((a @ b / (a.norm() * b.norm())).item())


def _activations(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    channels = [7, 100, 300, 411]
    x[..., channels] *= 30.0
    return x, channels


def one_shot(x: torch.Tensor, outliers: list[int]) -> list[dict[str, Any]]:
    """(a): every single-tensor codec on ``x``."""
    rest = [c for c in range(x.shape[-1]) if c not in outliers]
    rows = []
    cases: list[tuple[str, Any]] = [
        (m, lambda t, m=m: _compression(t, m)) for m in ("bf16", "int8", "int4")
    ]
    for bits in lowbit.BITS:
        cases.append((f"lowbit{bits}", lambda t, b=bits: _lowbit(t, b, None)))
    for bits in (1, 2):
        cases.append((f"lowbit{bits} SR", lambda t, b=bits: _lowbit(t, b, 0)))
    for name, codec in cases:
        y, nbytes = codec(x)
        bpv = 8 * nbytes / x.numel()
        rows.append(
            {
                "codec": name,
                "bits": bpv,
                "x_bf16": 16 / bpv,
                "rel": _rel(y, x),
                "rel_rest": _rel(y[..., rest], x[..., rest]),
                "cos": _cos(y, x),
            }
        )
    return rows


def _compression(t: torch.Tensor, mode: str) -> tuple[torch.Tensor, int]:
    enc = compression.encode(t, mode)
    return compression.decode(enc), enc.nbytes


def _lowbit(t: torch.Tensor, bits: int, seed: int | None) -> tuple[torch.Tensor, int]:
    enc = lowbit.encode(t, bits, seed)
    return lowbit.decode(enc), enc.nbytes


def epochs(samples: list[torch.Tensor], setting: tuple[int, int, float]) -> dict[str, Any]:
    """(b)/(c): ``samples[e]`` is epoch e's batch; one key per row (sample)."""
    full, delta, skip = setting
    cfg = DeltaConfig(full_bits=full, delta_bits=delta, skip_below=skip)  # type: ignore[arg-type]
    sender, receiver = DeltaSender(cfg), DeltaReceiver(cfg)
    bits, rels, coss = [], [], []
    for batch in samples:
        nbytes, out = 0, []
        for i, x in enumerate(batch):
            msg = sender.encode(x, f"sample-{i}")
            out.append(receiver.decode(msg))
            nbytes += msg.nbytes
        y = torch.stack(out)
        bits.append(8 * nbytes / batch.numel())
        rels.append(_rel(y, batch))
        coss.append(_cos(y, batch))
    avg = sum(bits) / len(bits)
    return {
        "setting": f"F{full} D{delta} S{skip:g}",
        "bits": bits,
        "avg_bits": avg,
        "x_bf16": 16 / avg,
        "rel": rels,
        "mean_rel": sum(rels) / len(rels),
        "min_cos": min(coss),
    }


def drifting(x0: torch.Tensor, frac: float, seed: int = 1) -> list[torch.Tensor]:
    """x_e = x_0 + e * frac * (per-channel spread) * n."""
    n = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    spread = x0.reshape(-1, x0.shape[-1]).std(dim=0)
    return [x0 + e * frac * spread * n for e in range(EPOCHS)]


def tiny_llama(batch: int, seq: int) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    """(c)/(d): hidden states after layer 2 over EPOCHS LoRA-like updates, the gradient of
    the loss with respect to epoch 0's, and the mean relative drift per epoch."""
    from relaytrain_testkit.tiny_models import tiny_model_dir
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model_dir(Path(tmp) / "llama", arch="llama", hidden=256, layers=4)
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    targets = [layer.self_attn.q_proj.weight for layer in model.model.layers[:2]] + [
        layer.self_attn.v_proj.weight for layer in model.model.layers[:2]
    ]
    updates = []
    for w in targets:
        b = torch.randn(w.shape[0], 4, generator=g)
        a = torch.randn(4, w.shape[1], generator=g)
        ba = b @ a
        updates.append(ba * (0.01 * w.norm() / ba.norm()))
    base = [w.detach().clone() for w in targets]
    states = []
    for e in range(EPOCHS):
        with torch.no_grad():
            for w, w0, u in zip(targets, base, updates, strict=True):
                w.copy_(w0 + e * u)
        captured: dict[str, torch.Tensor] = {}

        def hook(_m: Any, _i: Any, out: Any, store: dict[str, torch.Tensor] = captured) -> None:
            h = out[0] if isinstance(out, tuple) else out
            h.retain_grad()
            store["h"] = h

        handle = model.model.layers[1].register_forward_hook(hook)
        loss = model(input_ids=ids, labels=ids).loss
        handle.remove()
        if e == 0:
            loss.backward()
            h_grad = captured["h"].grad
            assert h_grad is not None
            grad = h_grad.detach().clone()
        states.append(captured["h"].detach().clone())
    drift = sum(_rel(states[e], states[e - 1]) for e in range(1, EPOCHS)) / (EPOCHS - 1)
    return states, grad, drift


def gradients(grad: torch.Tensor) -> list[dict[str, Any]]:
    """(d): nearest vs stochastic rounding on a real gradient."""
    rows = []
    for bits in (1, 2):
        for seed in (None, 0):
            enc = lowbit.encode(grad, bits, seed)
            y = lowbit.decode(enc)
            row = {
                "codec": f"lowbit{bits} {'SR' if seed is not None else 'nearest'}",
                "bits": 8 * enc.nbytes / grad.numel(),
                "rel": _rel(y, grad),
                "cos": _cos(y, grad),
            }
            codes = [
                lowbit.decode(lowbit.encode(grad, bits, s if seed is not None else None))
                for s in range(16)
            ]
            row["mean16_rel"] = _rel(torch.stack(codes).mean(0), grad)
            rows.append(row)
    return rows


def _print_epochs(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(
        f"{'setting':<14}{'bits/value per epoch':<26}{'avg':>6}{'x bf16':>8}"
        f"  {'rel. error per epoch':<28}{'mean':>7}{'min cos':>9}"
    )
    for r in rows:
        bits = " ".join(f"{b:5.2f}" for b in r["bits"])
        rels = " ".join(f"{v:6.3f}" for v in r["rel"])
        print(
            f"{r['setting']:<14}{bits:<26}{r['avg_bits']:6.2f}{r['x_bf16']:8.1f}"
            f"  {rels:<28}{r['mean_rel']:7.3f}{r['min_cos']:9.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="smaller tensors, no tiny Llama")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = (4, 64, 512) if args.quick else (8, 128, 512)
    results: dict[str, Any] = {}

    x, outliers = _activations(shape)
    results["one_shot"] = rows = one_shot(x, outliers)
    print(f"(a) one shot, Gaussian {list(shape)} with four 30x outlier channels")
    print(f"{'codec':<12}{'bits/value':>11}{'x bf16':>8}{'rel':>8}{'rel rest':>10}{'cos':>9}")
    for r in rows:
        print(
            f"{r['codec']:<12}{r['bits']:11.3f}{r['x_bf16']:8.2f}{r['rel']:8.3f}"
            f"{r['rel_rest']:10.3f}{r['cos']:9.4f}"
        )

    results["drift"] = {}
    for frac in (0.005, 0.02, 0.05):
        samples = drifting(x, frac)
        rows = [epochs(samples, s) for s in SETTINGS]
        results["drift"][str(frac)] = rows
        _print_epochs(
            f"(b) drift {frac:.1%} of the channel spread per epoch, {EPOCHS} epochs", rows
        )

    if not args.quick:
        states, grad, drift = tiny_llama(batch=8, seq=128)
        rows = [epochs(states, s) for s in SETTINGS]
        results["tiny_llama"] = {"drift_per_epoch": drift, "rows": rows}
        _print_epochs(
            f"(c) tiny Llama hidden state after layer 2 [8, 128, 256], "
            f"measured drift {drift:.2%} per epoch",
            rows,
        )
        results["gradients"] = rows = gradients(grad)
        print("\n(d) gradient of the tiny Llama's loss at that boundary")
        print(f"{'codec':<18}{'bits/value':>11}{'rel':>8}{'cos':>9}{'mean-of-16 rel':>16}")
        for r in rows:
            print(
                f"{r['codec']:<18}{r['bits']:11.3f}{r['rel']:8.3f}{r['cos']:9.4f}"
                f"{r['mean16_rel']:16.3f}"
            )

    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
