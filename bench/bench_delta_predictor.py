"""Design experiment: would a predicted reference pay? A row's delta code carries its change
since the last epoch; a linear map of the row's cached value, fitted to the changes of the rows
already coded that epoch and sent to the receiver, could take most of that change off the code.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_delta_predictor.py [--seed N] [--json OUT]
    [--fits 0.125,0.25,0.5] [--at visit|end] [--states PATH]

bench_delta_boundary.py's fine-tune (a tiny Llama of width 256 pretrained on the base language,
LoRA r8, 4 stages, 128 rows of 64 tokens, 6 epochs, ``--seed``) is trained uncompressed, and
each boundary's rows are taken as the run's frames carried them (the unsplit model with the
adapters each row's step started from: what the codec would have been given, in the order it
was given them; ``--at end``: with the adapters at the end of the row's epoch instead, as if
they moved only between epochs). Each boundary's rows then go, epoch after epoch, through
the ``delta`` codec's allocated code at int3's error (`deltacache.DeltaSender`, no basis) in
two ways:

- ``plain``: against the row's cached value, the codec as it is;
- ``predicted``: against the cached value plus ``[c, 1] W``, where ``W`` (``(h + 1) x h``) is
  the ridge least-squares fit of the change ``x - c`` on ``[c, 1]`` over the tokens of the rows
  coded before in the same epoch (fitted after each share ``--fits`` of them, default 1/8, 1/4
  and 1/2; none before the first: the fit of an earlier epoch does not carry over, the
  adapters move another way each epoch), where that code is the smaller of the two (the
  sender tries both; a bit a row would say which). ``W`` would cross the link at 8 bits a
  value and a scale a column, charged to the epoch (``W bytes``).

Reported per epoch, averaged over the boundaries: each way's code bytes a token (codes, scales,
maps: ``DeltaMessage.nbytes``; no headers, labels or deflate), ``W``'s bytes a token, and the
changes' energy left after the prediction (the rows coded after the first fit). Bytes of
epoch 1 (full codes) are the same both ways. ``--states``: the boundaries' rows are kept
there (and read from there when it exists: the same seed's training, not run again).
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
sys.path[:0] = [str(REPO / "bench"), str(REPO / "worker_image"), str(REPO / "testkit")]

import bench_delta_boundary as bench  # noqa: E402

RIDGE = 1e-2
"""Ridge of the fit, a share of the mean diagonal of ``[c, 1]^T [c, 1]``."""


def fit(refs: torch.Tensor, changes: torch.Tensor) -> torch.Tensor:
    """``W`` (float64, ``(h + 1) x h``) of the ridge fit ``changes ~ [refs, 1] W``."""
    x = torch.cat([refs, torch.ones(len(refs), 1, dtype=refs.dtype)], dim=1)
    gram = x.T @ x
    gram += RIDGE * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
    return torch.linalg.solve(gram, x.T @ changes)


def predict(w: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    return torch.cat([refs, torch.ones(len(refs), 1, dtype=refs.dtype)], dim=1) @ w


def w_bytes(h: int) -> int:
    """``W`` on the wire: ``(h + 1) h`` values at 8 bits and a bf16 scale a column."""
    return (h + 1) * h + 2 * h


def boundary_epochs(
    states: torch.Tensor, orders: list[list[int]], fits_at: list[float]
) -> list[dict[str, float]]:
    """Both ways' bytes over the epochs of one boundary's rows (``[epochs, rows, seq, h]``,
    each epoch's in ``orders``), ``W`` fitted after each share ``fits_at`` of its rows."""
    from relaytrain_worker.pipeline.boundary import config_for
    from relaytrain_worker.pipeline.deltacache import DeltaSender
    from relaytrain_worker.pipeline.lowbit import to_blocks

    seq, h = states.shape[2:]
    config = config_for("int3")
    plain, predicted = DeltaSender(config), DeltaSender(config)
    out = []
    for e, order in enumerate(orders):
        fits = {max(1, int(len(order) * share)) for share in fits_at} if e else set()
        w: torch.Tensor | None = None
        seen_refs: list[torch.Tensor] = []
        seen_changes: list[torch.Tensor] = []
        tally = {"plain": 0.0, "predicted": 0.0, "W": 0.0, "change": 0.0, "left": 0.0}
        for i, row in enumerate(order):
            key = str(row)
            if i in fits:
                w = fit(torch.cat(seen_refs), torch.cat(seen_changes))
                tally["W"] += w_bytes(h)
            x = states[e, row]
            ref = predicted.cached(key)
            if ref is not None:
                c = ref.double().reshape(seq, h)
                change = x.double() - c
                seen_refs.append(c)
                seen_changes.append(change)
            tally["plain"] += plain.encode(x, key).nbytes
            if ref is None or w is None:
                tally["predicted"] += predicted.encode(x, key).nbytes
                continue
            guess = predict(w, c)
            tally["change"] += float(change.square().sum())
            tally["left"] += float((change - guess).square().sum())
            entry = predicted._entries[key]  # the sender tries the reference both ways
            as_is = entry.value
            bare = predicted.encode(x, key)
            after_bare = predicted._entries[key]
            entry.value = to_blocks((c + guess).float()).to(as_is.dtype)
            predicted._entries[key] = entry
            guessed = predicted.encode(x, key)
            if bare.nbytes < guessed.nbytes:
                predicted._entries[key] = after_bare
            tally["predicted"] += min(bare.nbytes, guessed.nbytes)
        tokens = len(order) * seq
        out.append({
            "plain": tally["plain"] / tokens,
            "predicted": tally["predicted"] / tokens,
            "W": tally["W"] / tokens,
            "left": tally["left"] / tally["change"] if tally["change"] else float("nan"),
        })  # fmt: skip
    return out


def visits(
    job: Any, params: list[dict[str, torch.Tensor]], setup: Any, at: str = "visit"
) -> tuple[torch.Tensor, list[list[int]]]:
    """``[epochs, boundaries, rows, seq, h]``: each row's boundary activations as its epoch's
    step computed them (the adapters after the step before; ``at="end"``: the adapters at the
    end of the epoch), and each epoch's rows in the order the steps visited them."""
    spe = setup.steps_per_epoch
    states = torch.zeros(setup.epochs, bench.STAGES - 1, setup.rows, setup.seq, setup.hidden)
    orders: list[list[int]] = [[] for _ in range(setup.epochs)]
    for s, step in enumerate(job.steps):
        rows = torch.cat([mb.rows for mb in step])
        before = job.evaluator.initial if s == 0 else params[s - 1]
        if at == "end":
            before = params[(s // spe + 1) * spe - 1]
        states[s // spe, :, rows] = job.evaluator.boundary_states(before, job.train_rows[rows])
        orders[s // spe] += rows.tolist()
    return states, orders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the LoRA's init and row order")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--fits", default="0.125,0.25,0.5", help="where W is fitted (shares)")
    parser.add_argument(
        "--at",
        choices=("visit", "end"),
        default="visit",
        help="the rows with the adapters "
        "their step started from, or those at the end of their epoch",
    )
    parser.add_argument("--states", type=Path, help="the boundaries' rows, kept or read")
    from relaytrain_contract import TrainingSpec
    from relaytrain_testkit import bigram

    bigram.add_base_arguments(parser, default="pretrained", pretrain_steps=600)
    args = parser.parse_args()
    args.gradient_tokens, args.gradient_bits = 1.0, 3
    torch.set_num_threads(1)
    setup = bench.Setup(128, 2, 6, 32)
    training = TrainingSpec(
        steps=setup.steps_per_epoch * setup.epochs, micro_batch_size=bench.MBS,
        micro_batches=setup.micros, learning_rate=setup.lr, schedule="cosine", warmup_steps=2,
        weight_decay=0.0, max_grad_norm=1.0, seed=args.seed,
    )  # fmt: skip
    fits_at = sorted(float(share) for share in args.fits.split(","))
    if not all(0 < share < 1 for share in fits_at):
        raise SystemExit(f"--fits: shares of an epoch between 0 and 1, got {args.fits!r}")
    if args.states is not None and args.states.exists():
        kept = torch.load(args.states)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            job, _ = bench.build_job(args, setup, training, bench.SlowLink(), Path(tmp))
            params: list[dict[str, torch.Tensor]] = []
            loss = bench.train(job, "none", limited=False, params=params).step_eval[-1]
            states, orders = visits(job, params, setup, args.at)
        kept = {"states": states, "orders": orders, "loss": loss}
        if args.states is not None:
            torch.save(kept, args.states)
    states, orders, loss = kept["states"], kept["orders"], kept["loss"]
    per_boundary = [boundary_epochs(states[:, b], orders, fits_at) for b in range(states.shape[1])]
    epochs: list[dict[str, Any]] = []
    for e in range(setup.epochs):
        each = [b[e] for b in per_boundary]
        epochs.append({k: sum(x[k] for x in each) / len(each) for k in each[0]})
    print(f"held-out loss after the run: {loss:.4f}; W fitted after {fits_at} of each epoch")
    print("| epoch | plain | predicted | W | predicted + W | change left after the fit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for e, row in enumerate(epochs, 1):
        print(
            f"| {e} | {row['plain']:.2f} | {row['predicted']:.2f} | {row['W']:.2f} | "
            f"{row['predicted'] + row['W']:.2f} | {row['left']:.3f} |"
        )
    total = {k: sum(r[k] for r in epochs) for k in ("plain", "predicted", "W")}
    print(
        f"| all | {total['plain']:.2f} | {total['predicted']:.2f} | {total['W']:.2f} | "
        f"{total['predicted'] + total['W']:.2f} | |"
    )
    if args.json:
        report = {"epochs": epochs, "seed": args.seed, "fits": fits_at}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
