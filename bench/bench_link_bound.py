"""Tokens/s of a 2-stage pipeline on a rate-limited link, against the bound that link sets.

    .venv/bin/python bench/bench_link_bound.py [--quick] [--json OUT]

Two stages of a random Llama run as two threads of this process (`testing.run_pipeline_threads`:
the worker's real StepRunner, 1F1B, Peers and encrypted loopback links), with the boundary
link paced by `Link.limit_rate` in each direction (what each end sends). For each rate
and compression mode:

- B/token down and up: bytes on the wire per input token crossing the boundary
  (activations + mask + positions + labels down, gradients up, framing, encryption and
  the step-end control frames included), measured from the link counters;
- the link bound: rate / max(down, up) tokens/s, since each direction has the full rate
  (a full-duplex link); the bound if the two directions shared one rate would be
  rate / (down + up), half as much;
- measured tokens/s and its ratio to the bound; and the compute ceiling (same run with
  an unpaced link), since when the CPU is slower than the link the link cannot be the
  bottleneck and the ratio says nothing about link use.

Each setup runs with the encoder on its own thread (`overlap_encode=True`, what the
stage does) and, for comparison, encoding on the sender thread (`False`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from relaytrain_contract import TrainingSpec
from relaytrain_worker.state.data import MicroBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))
from relaytrain_testkit.inputs import random_batches
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import run_pipeline_threads
from relaytrain_testkit.tiny_models import tiny_model_dir

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""


def measure(
    model: Path,
    data: list[list[MicroBatch]],
    training: TrainingSpec,
    compression: str,
    rate: float | None,
    overlap: bool,
) -> dict[str, float]:
    tokens = sum(int(mb.attention_mask.sum()) for micros in data for mb in micros)
    run = run_pipeline_threads(
        model,
        [(0, 1), (1, 2)],
        data,
        training,
        credentials=stage_credentials(2, job="bench"),
        compression=compression,
        link_rate=rate,
        overlap_encode=overlap,
    )
    down, up = run.boundary_bytes[0]
    return {"tokens_per_s": tokens / run.seconds, "down": down / tokens, "up": up / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rates", type=float, nargs="+", default=[200.0, 50.0], help="Mbit/s")
    parser.add_argument("--modes", nargs="+", default=["none", "int8"])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    # One decoder layer per stage keeps compute small against the boundary tensors, so
    # the link can be the bottleneck even on a CPU.
    model = tiny_model_dir(
        Path(tempfile.mkdtemp()) / "m", layers=2, hidden=args.hidden, max_shard_size="8MB",
        intermediate=args.hidden,
    )  # fmt: skip
    steps, m, mbs, seq = (2, 4, 2, 128) if args.quick else (3, 8, 4, 128)
    data = random_batches(steps + 1, m, mbs, seq, 300)
    training = TrainingSpec(
        steps=steps, microBatchSize=mbs, microBatches=m, learningRate=1e-3,
        schedule="constant", warmupSteps=0, weightDecay=0.0, maxGradNorm=1.0, seed=0,
    )  # fmt: skip
    measure(model, data[:1], training, "int8", None, True)  # warm-up: imports, first calls
    rows = []
    for mode in args.modes:
        ceiling = measure(model, data[1:], training, mode, None, True)["tokens_per_s"]
        for mbit in args.rates:
            for overlap in (True, False):
                got = measure(model, data[1:], training, mode, mbit * MBIT, overlap)
                bound = mbit * MBIT / max(got["down"], got["up"])
                row = {
                    "mode": mode, "mbit": mbit, "encode": "own thread" if overlap else "sender",
                    "down_B_per_token": round(got["down"], 1),
                    "up_B_per_token": round(got["up"], 1),
                    "bound_tokens_per_s": round(bound), "compute_tokens_per_s": round(ceiling),
                    "tokens_per_s": round(got["tokens_per_s"]),
                    "ratio": round(got["tokens_per_s"] / bound, 3),
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print("| mode | Mbit/s | encode | B/token down | up | link bound tok/s | compute tok/s "
          "| tokens/s | of bound |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['mbit']:g} | {r['encode']} | {r['down_B_per_token']} | "
            f"{r['up_B_per_token']} | {r['bound_tokens_per_s']} | {r['compute_tokens_per_s']} | "
            f"{r['tokens_per_s']} | {r['ratio']:.0%} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
