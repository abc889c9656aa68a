"""CPU time of each boundary code per value: what the planner charges a link for coding.

Run: .venv/bin/python bench/bench_codec_speed.py [--quick] [--device cuda] [--json OUT]

A boundary tensor of a micro-batch ([2, 1024, 1024] bf16 by default, 2.1 M values: hidden
states of two rows of 1,024 tokens) is encoded and decoded on one CPU thread, each code side
by side in one process, median of the repetitions:

- ``compression.py``'s bf16, int8 and int4 (on a GPU host these run on the GPU, where they
  cost next to nothing: the planner charges them nothing);
- the ``delta`` codec (``boundary.py``): a row's first crossing (rotated, each block's bits
  allocated within int4's error: about 4 bits), a later crossing after a 5 % drift (within
  that error: most blocks not sent), and the gradients' 3-bit code; ``--activation-error
  int3`` and ``--basis`` make it a job's `delta:int3+basis` (rows coded in fitted bases),
  with a row more: the crossing that fits the deltas' basis and sends it (both ends: the
  fit's ``eigh``, each end's float64 QR on the CPU), and the later crossings coded in it;
  the fit alone, that crossing less a later one, is printed in seconds beside what the
  planner charges (``link_cost.basis_fit_seconds``), and each end's QR of the basis, which
  runs beside the frames from a width of 2048 (`transform.switch_frames`) and in the fit's
  frame under it;
  It encodes where the stage computes and decodes on the CPU (the link's reader), so the
  planner charges it (``link_cost.DELTA_FORWARD_CODEC_SECONDS``,
  ``link_cost.DELTA_BACKWARD_CODEC_SECONDS``, printed beside the measurement);
- the allocation of a ``delta`` row's blocks' bits alone (`allocation.allocate_bits`, a sort
  of 8 breakpoints a block), part of each crossing's encode, timed where the rows are: until
  2026-12-05 it ran on the CPU for a GPU stage's rows too (one thread's, in the first card
  run of `hack/gpu-check.sh time-to-loss`), twice a row in a fitted basis;
- the deflate ``delta`` frames get on top (frames.py, on the CPU wherever the codes were
  made): the first crossing's and the gradients' parts deflated and inflated, in ns per
  value and per byte of the codes (``link_cost.DEFLATE_SECONDS_PER_BYTE``,
  ``INFLATE_SECONDS_PER_BYTE``). These Gaussian codes
  hardly shrink; a real run's do (bench_delta_boundary.py), and DEFLATE's time grows little
  with what it finds.

``--device cuda`` puts the tensor on the GPU, as on a GPU stage, and leaves torch its CPU
threads (what the stage's host does beside the card: the rows' caches, the frames' deflate,
a basis's QR, `transform.Bases.install`): every code encodes there
(timed to the codes' arrival on the CPU for ``delta``, to the encode's end on the device for
the others); ``delta`` decodes there too, as a GPU stage's links do (`BoundaryCodec.device`),
the other codes on the CPU, where a link decodes them.

Each row gives ns per value for encode and decode, and their sum against int4's (the
baseline, measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "worker_image")]

from relaytrain_operator.domain.planner import link_cost  # noqa: E402
from relaytrain_worker.pipeline import (  # noqa: E402
    compression,
    frames,
    lowbit,
    transform,
)
from relaytrain_worker.pipeline.allocation import (  # noqa: E402
    DEEP,
    DEEP_COST,
    SHALLOW,
    allocate_bits,
)
from relaytrain_worker.pipeline.boundary import (  # noqa: E402
    BoundaryCodec,
    codec_for,
    config_for,
)
from relaytrain_worker.pipeline.lowbit import DISTORTION  # noqa: E402
from relaytrain_worker.pipeline.transform import FIRST_FIT  # noqa: E402

GRADIENT_BITS = 3
"""The gradients' bits timed: what the figures in docs/ time (a job's default is 2 since
2026-12-07)."""


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, after one warm-up call (each to the end of
    what it queued on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def deflated(parts: list[torch.Tensor], reps: int) -> tuple[float, float, int]:
    """Deflate and inflate seconds of a frame's ``parts`` (frames.py), and their bytes."""
    views = [frames.bytes_view(p.contiguous()) for p in parts]
    size = sum(len(v) for v in views)
    packed = frames.deflate(views)
    stream = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    return (
        timed(lambda: frames.deflate(views), reps),
        timed(lambda: frames.Inflated(stream, size), reps),
        size,
    )


def delta_rows(
    x: torch.Tensor, reps: int, codec: Callable[[], BoundaryCodec] = BoundaryCodec
) -> dict[str, tuple[float, float]]:
    """Encode and decode seconds of a row's first crossing and of a later one (5 % drift);
    with a codec of fitted bases (``--basis``), also of the frame that fits them (``fit``:
    the whole frame, both ends), which the later crossings' median leaves out."""
    rows = torch.arange(x.shape[0])
    sender, receiver = codec(), codec()
    receiver.device = None if x.device.type == "cpu" else x.device
    gen = torch.Generator().manual_seed(0)

    fits: list[tuple[float, float]] = []

    def crossing(t: torch.Tensor) -> tuple[float, float] | None:
        start = time.perf_counter()
        ((entry, parts),) = sender.encode("activation", {"hidden": t, "rows": rows})
        middle = time.perf_counter()
        it = iter(parts)
        receiver.decode("activation", entry, t.dtype, lambda n, dtype: next(it))
        _sync()
        took = middle - start, time.perf_counter() - middle
        if "bases" in entry:
            fits.append(took)
            return None
        return took

    first = crossing(x)
    assert first is not None  # nothing fitted before the first frame
    later: list[tuple[float, float]] = []
    y = x.float()
    # ``reps`` crossings; with bases, ``reps`` once the rows are coded in the deltas' first
    # basis: it is fitted after `transform.FIRST_FIT` frames of deltas, and the rows are coded
    # in it `Fitter.lag` frames after the one that carries it (each end's QR beside them).
    fitting = sender.sender.config.transform
    switch = sender.sender.fitter.lag(x.shape[-1])
    frames_left = reps + FIRST_FIT + 1
    skip = 0
    while frames_left > 0 and (len(later) < reps or (fitting and not fits)):
        frames_left -= 1
        y = y + 0.05 * y.std() * torch.randn(y.shape, generator=gen).to(y.device)
        _sync()
        took = crossing(y.to(x.dtype))
        if took is None:
            later.clear()
            frames_left, skip = reps + switch, switch
        elif skip:
            skip -= 1
        else:
            later.append(took)
    out = {
        "first": first,
        "later": (statistics.median(e for e, _ in later), statistics.median(d for _, d in later)),
    }
    if fits:
        out["fit"] = fits[0]
    return out


def fit_seconds(delta: dict[str, tuple[float, float]]) -> float | None:
    """Both ends' seconds of a basis's fit alone (what the planner prices as
    ``link_cost.basis_fit_seconds``): the crossing that fits and sends it less a later
    crossing's, which codes its rows alike; None without a fit."""
    if "fit" not in delta:
        return None
    return max(0.0, sum(delta["fit"]) - sum(delta["later"]))


def allocation(x: torch.Tensor, activation_error: str, basis: bool) -> Callable[[], Any]:
    """Each row's allocation of its blocks' bits where the rows are (`allocation.allocate_bits`,
    as `deltacache.DeltaSender` calls it on a first crossing: a row against zero, within the
    error of ``activation_error``'s code; 0-8 bits a block in a fitted basis, once for each
    candidate basis a later crossing weighs, so twice there)."""
    config = config_for(activation_error, transform=basis)
    energies = [lowbit.to_blocks(row.float()).square().sum(dim=1) for row in x]
    budgets = [DISTORTION[config.full_bits] * float(e.sum()) for e in energies]
    table, cost = (DEEP, DEEP_COST) if basis else (SHALLOW, None)
    pairs = list(zip(energies, budgets, strict=True))
    return lambda: [allocate_bits(e, b, table=table, cost=cost) for e, b in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, not 7")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens a row (default 1024)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--device", default="cpu", help="where the tensor is (cpu, cuda)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--activation-error",
        default="int4",
        help="delta's pipeline.activationError (int4, the default, or int3)",
    )
    parser.add_argument(
        "--basis",
        action="store_true",
        help="delta's rows coded in fitted bases (pipeline.activationBasis: fitted)",
    )
    args = parser.parse_args(argv)
    try:
        config_for(args.activation_error, transform=args.basis)
    except ValueError as err:
        parser.error(f"--activation-error: {err}")
    if args.device == "cpu":  # what the planner charges a CPU stage: one thread's time
        torch.set_num_threads(1)
    reps = 3 if args.quick else 7
    x = torch.randn(2, args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16).to(args.device)
    n = x.numel()
    rows: dict[str, tuple[float, float]] = {}
    for mode in ("bf16", "int8", "int4"):
        enc = compression.encode(x, mode)
        on_cpu = compression.encode(x.cpu(), mode)  # what the link's reader decodes
        rows[mode] = (
            timed(lambda mode=mode: compression.encode(x, mode), reps),
            timed(lambda enc=on_cpu: compression.decode(enc), reps),
        )
        del enc
    label = args.activation_error + (", fitted bases" if args.basis else "")
    delta = delta_rows(x, reps, lambda: codec_for(args.activation_error, transform=args.basis))
    rows[f"delta ({label}), first crossing"] = delta["first"]
    where_coded = "in the fitted basis" if args.basis else "most blocks within the error"
    rows[f"delta ({label}), later crossing (5 % drift: {where_coded})"] = delta["later"]
    if "fit" in delta:
        rows[f"delta ({label}), the crossing that fits and sends a basis"] = delta["fit"]
    rows[f"delta ({label}), the blocks' bits allocated, a row at a time (in each encode)"] = (
        timed(allocation(x, args.activation_error, args.basis), reps),
        0.0,
    )
    grad = lowbit.encode(x, GRADIENT_BITS)
    there = None if x.device.type == "cpu" else x.device
    rows[f"delta, gradient ({GRADIENT_BITS} bits)"] = (
        timed(lambda: lowbit.encode(x, GRADIENT_BITS), reps),
        timed(lambda: lowbit.decode(grad, there), reps),
    )
    ((_, parts),) = BoundaryCodec().encode("activation", {"hidden": x, "rows": torch.arange(2)})
    coded = {
        "first crossing": deflated([p.cpu() for p in parts], reps),
        "gradient": deflated([grad.codes, grad.scales], reps),
    }
    for name, (e, d, _) in coded.items():
        rows[f"deflate of the delta {name}'s frame parts"] = (e, d)
    base = sum(rows["int4"])
    where = "the CPU" if x.device.type == "cpu" else _name(x.device)
    decode = "" if x.device.type == "cpu" else " (delta's decode there too)"
    threads = torch.get_num_threads()
    print(f"Codec time, encode on {where}, decode on the CPU{decode}, "
          f"{threads} CPU thread{'s' if threads > 1 else ''}, "
          f"{list(x.shape)} bf16 ({n:,} values), median of {reps}")  # fmt: skip
    print()
    print("| code | encode ns/value | decode ns/value | both, x int4 |")
    print("|---|---|---|---|")
    figures = {}
    for name, (e, d) in rows.items():
        figures[name] = {"encode_ns": e / n * 1e9, "decode_ns": d / n * 1e9}
        print(f"| {name} | {e / n * 1e9:.1f} | {d / n * 1e9:.1f} | {(e + d) / base:.1f}x |")
    print()
    print(
        "The planner charges delta "
        f"{link_cost.DELTA_FORWARD_CODEC_SECONDS * 1e9:.0f} ns a value forward and "
        f"{link_cost.DELTA_BACKWARD_CODEC_SECONDS * 1e9:.0f} backward (encode + decode)."
    )
    fit = fit_seconds(delta)
    qr = None
    if fit is not None:
        square = torch.randn(args.hidden, args.hidden)
        qr = timed(lambda: transform.orthonormal(square), 1)
        where = "beside the frames" if transform.switch_frames(args.hidden) else "in its frame"
        print(
            f"The fit of a {args.hidden} x {args.hidden} basis on the frames' way, both ends "
            f"(the crossing that fits and sends it less a later crossing's): {fit:.3f} s, "
            f"the planner charges {link_cost.basis_fit_seconds(args.hidden):.3f} s "
            f"(link_cost.basis_fit_seconds), one fit every {link_cost.BASIS_REFIT} frames; "
            f"each end's QR of it, {qr:.3f} s, {where} (transform.switch_frames)."
        )
    for name, (e, d, size) in coded.items():
        print(
            f"Deflate of the {name}'s parts: {e / size * 1e9:.1f} ns a byte of its codes, "
            f"inflate {d / size * 1e9:.1f}; the planner charges "
            f"{link_cost.DEFLATE_SECONDS_PER_BYTE * 1e9:.1f} and "
            f"{link_cost.INFLATE_SECONDS_PER_BYTE * 1e9:.1f}."
        )
    if args.json:
        args.json.write_text(json.dumps(
            {"shape": list(x.shape), "device": _name(x.device), "threads": threads,
             "codes": figures, "fit_seconds": fit, "qr_seconds": qr}, indent=2
        ))  # fmt: skip
    return 0


def _name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)


if __name__ == "__main__":
    raise SystemExit(main())
