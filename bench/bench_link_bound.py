"""Tokens/s of a 2-stage pipeline on a rate-limited link, against the bound that link sets.

    .venv/bin/python bench/bench_link_bound.py [--quick] [--json OUT]
        [--shaper pacing|kernel] [--latency-ms MS] [--loss-pct P] [--micro-batches M]
        [--rows R] [--hidden H]

Two stages of a random Llama run as two threads of this process (`testing.run_pipeline_threads`:
the worker's real StepRunner, 1F1B, Peers and encrypted loopback links), with the boundary
link limited to a rate in each direction. `--shaper pacing` (the default): `Link.limit_rate`
paces what each end sends. `--shaper kernel`: the benchmark runs itself again in a fresh
user and network namespace whose loopback the kernel shapes (relaytrain_testkit.shaped_links:
an htb class per link and direction), the links unpaced, so TCP meets a real bottleneck
queue. `--latency-ms` adds a one-way latency to every link (`Link.set_latency`, a delay
line: the kernel here has no netem). For each rate and compression mode:

- B/token down and up: bytes on the wire per input token crossing the boundary
  (activations + mask + positions + labels down, gradients up, framing, encryption and
  the step-end control frames included), measured from the link counters;
- the link bound: rate / max(down, up) tokens/s, since each direction has the full rate
  (a full-duplex link); the bound if the two directions shared one rate would be
  rate / (down + up), half as much;
- measured tokens/s and its ratio to the bound; and the compute ceiling (same run with
  an unlimited link), since when the CPU is slower than the link the link cannot be the
  bottleneck and the ratio says nothing about link use;
- where a step's time goes (from the time every boundary frame was sent and received),
  in % of the step: `fill` (stage 0 starts sending until stage 1 holds its first
  activation), `stream` (until stage 1 holds the last), `drain` (until stage 0 holds the
  last gradient), `end` (stage 0's last backward and the step-end exchange of gradient
  norms, a round trip) and `gap` (stage 0's optimizer step, first forward and encode,
  until it starts sending the next step). A 1F1B step over one link cannot beat
  m / (m + 1) of the bound with m micro-batches: the last gradient crosses after the last
  activation (`drain`), which the bound does not count.

`--ahead K` is the worker's `spec.pipeline.forwardsAhead`: stage 0 runs K more forwards
before its first backward than 1F1B does, so K more activations are in flight (and held
in memory) while the link carries them; the gradients are the same, in the same order.

Each setup runs with the encoder on its own thread (`overlap_encode=True`, what the
stage does) and, for comparison, encoding on the sender thread (`False`); `--encode own`
runs only the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from relaytrain_contract import TrainingSpec
from relaytrain_worker.pipeline.frames import parse_head
from relaytrain_worker.pipeline.transport import Frame, Link, PreparedFrame
from relaytrain_worker.state.data import MicroBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))
from relaytrain_testkit import shaped_links
from relaytrain_testkit.inputs import random_batches
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import run_pipeline_threads
from relaytrain_testkit.tiny_models import tiny_model_dir

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""
PHASES = ("fill", "stream", "drain", "end", "gap")

_events: list[tuple[float, str, str, int, int]] = []
"""(time, event, frame kind, step, micro) of every boundary frame: `sent` (stage 0's send
began), `act` / `grad` / `done` (stage 1 holds an activation / stage 0 a gradient, the
step-end norms)."""
_events_lock = threading.Lock()


def _trace() -> None:
    """Record when boundary frames are sent and received (wraps the Link class)."""
    send, recv = Link.send_prepared, Link.recv

    def note(event: str, kind: str, step: int, micro: int) -> None:
        with _events_lock:
            _events.append((time.perf_counter(), event, kind, step, micro))

    def traced_send(self: Link, prepared: PreparedFrame) -> None:
        if self.peer_identity.endswith("/s1"):  # stage 0, sending down
            head = parse_head(bytes(prepared.head))
            note("sent", head["kind"], head["step"], head["micro"])
        send(self, prepared)

    def traced_recv(self: Link, timeout: float | None = None) -> Frame:
        frame = recv(self, timeout)
        event = {"activation": "act", "gradient": "grad", "norms": "done"}.get(frame.kind)
        if event is not None:
            note(event, frame.kind, frame.step, frame.micro)
        return frame

    Link.send_prepared = traced_send  # type: ignore[method-assign]
    Link.recv = traced_recv  # type: ignore[method-assign]


def phases(events: list[tuple[float, str, str, int, int]]) -> dict[str, float]:
    """Mean seconds of each phase (PHASES) per step, over the steps that have a next one."""
    at: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t, event, kind, step, _ in events:
        if event == "sent" and kind != "activation":
            continue
        at[(event, step)].append(t)
    steps = sorted({step for (event, step) in at if event == "done"})
    rows = []
    for s in steps:
        if not at.get(("sent", s + 1)) or not at.get(("act", s)) or not at.get(("grad", s)):
            continue
        start, acts, grads = min(at[("sent", s)]), at[("act", s)], at[("grad", s)]
        done, following = max(at[("done", s)]), min(at[("sent", s + 1)])
        marks = [start, min(acts), max(acts), max(grads), done, following]
        rows.append([b - a for a, b in itertools.pairwise(marks)])
    if not rows:
        return {}
    return {name: sum(r[i] for r in rows) / len(rows) for i, name in enumerate(PHASES)}


def measure(
    model: Path,
    data: list[list[MicroBatch]],
    training: TrainingSpec,
    compression: str,
    rate: float | None,
    overlap: bool,
    *,
    kernel: bool = False,
    latency: float = 0.0,
    ahead: int = 0,
    loss: float = 0.0,
) -> dict[str, Any]:
    """One run; with ``kernel`` the namespace's loopback is shaped to ``rate`` (None:
    unshaped: no loss either) and the links are not paced; ``loss``: the chance that a
    packet is lost (`shaped_links.Shaping.loss`)."""
    if kernel:
        if rate is None:
            shaped_links.unshape()
        else:
            shaped_links.shape(shaped_links.Shaping(rate, loss=loss))
    tokens = sum(int(mb.attention_mask.sum()) for micros in data for mb in micros)
    _events.clear()
    run = run_pipeline_threads(
        model,
        [(0, 1), (1, 2)],
        data,
        training,
        credentials=stage_credentials(2, job="bench"),
        compression=compression,
        link_rate=None if kernel else rate,
        link_latency=latency,
        overlap_encode=overlap,
        ahead=ahead,
    )
    down, up = run.boundary_bytes[0]
    spent = phases(_events)
    step = sum(spent.values()) or 1.0
    return {
        "tokens_per_s": tokens / run.seconds, "down": down / tokens, "up": up / tokens,
        "phases": {k: round(100 * v / step, 1) for k, v in spent.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rates", type=float, nargs="+", default=[200.0, 50.0], help="Mbit/s")
    parser.add_argument("--modes", nargs="+", default=["none", "int8"])
    parser.add_argument("--shaper", choices=["pacing", "kernel"], default="pacing",
                        help="Link.limit_rate, or htb in a network namespace")  # fmt: skip
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way, every link")
    parser.add_argument("--loss-pct", type=float, default=0.0,
                        help="packets lost, %% each way (--shaper kernel: iptables in the "
                        "namespace)")  # fmt: skip
    parser.add_argument("--micro-batches", type=int, help="per step (default 8; 4 --quick)")
    parser.add_argument("--rows", type=int, help="sequences of 128 tokens a micro-batch "
                        "(default 4; 2 --quick)")  # fmt: skip
    parser.add_argument("--encode", choices=["both", "own"], default="both",
                        help="own: only the encoder on its own thread")  # fmt: skip
    parser.add_argument(
        "--ahead", type=int, default=0, help="forwards ahead of 1F1B (pipeline.forwardsAhead)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    kernel = args.shaper == "kernel"
    if kernel and not shaped_links.inside():
        problem = shaped_links.missing()
        if problem is not None:
            sys.exit(f"--shaper kernel: {problem}")
        argv = shaped_links.command([sys.executable, *sys.argv], None)
        os.execvp(argv[0], argv)  # this benchmark again, inside a fresh namespace
    _trace()
    # One decoder layer per stage keeps compute small against the boundary tensors, so
    # the link can be the bottleneck even on a CPU.
    model = tiny_model_dir(
        Path(tempfile.mkdtemp()) / "m", layers=2, hidden=args.hidden, max_shard_size="8MB",
        intermediate=args.hidden,
    )  # fmt: skip
    steps, m, mbs, seq = (2, 4, 2, 128) if args.quick else (3, 8, 4, 128)
    m, mbs = args.micro_batches or m, args.rows or mbs
    data = random_batches(steps + 1, m, mbs, seq, 300)
    training = TrainingSpec(
        steps=steps, microBatchSize=mbs, microBatches=m, learningRate=1e-3,
        schedule="constant", warmupSteps=0, weightDecay=0.0, maxGradNorm=1.0, seed=0,
    )  # fmt: skip
    latency = args.latency_ms / 1000
    if args.loss_pct and not kernel:
        parser.error("--loss-pct needs --shaper kernel (pacing loses nothing)")
    how = dict(kernel=kernel, latency=latency, ahead=args.ahead)
    measure(model, data[:1], training, "int8", None, True, **how)  # warm-up: first calls
    rows = []
    for mode in args.modes:
        ceiling = measure(model, data[1:], training, mode, None, True, **how)["tokens_per_s"]
        for mbit in args.rates:
            for overlap in (True,) if args.encode == "own" else (True, False):
                got = measure(model, data[1:], training, mode, mbit * MBIT, overlap, **how,
                              loss=args.loss_pct / 100)  # fmt: skip
                bound = mbit * MBIT / max(got["down"], got["up"])
                row = {
                    "shaper": args.shaper, "latency_ms": args.latency_ms,
                    "loss_pct": args.loss_pct, "micro_batches": m,
                    "rows": mbs, "hidden": args.hidden,
                    "ahead": args.ahead,
                    "mode": mode, "mbit": mbit, "encode": "own thread" if overlap else "sender",
                    "down_B_per_token": round(got["down"], 1),
                    "up_B_per_token": round(got["up"], 1),
                    "bound_tokens_per_s": round(bound), "compute_tokens_per_s": round(ceiling),
                    "tokens_per_s": round(got["tokens_per_s"]),
                    "ratio": round(got["tokens_per_s"] / bound, 3),
                    "phases_pct": got["phases"],
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"shaper {args.shaper}, latency {args.latency_ms:g} ms, loss {args.loss_pct:g} %, "
          f"hidden {args.hidden}, "
          f"{m} micro-batches of {mbs} x {seq} tokens a step, "
          f"{args.ahead} extra forwards ahead")  # fmt: skip
    print("| mode | Mbit/s | encode | B/token down | up | link bound tok/s | compute tok/s "
          "| tokens/s | of bound | fill | stream | drain | end | gap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ph = " | ".join(f"{r['phases_pct'].get(p, 0):.0f}%" for p in PHASES)
        print(
            f"| {r['mode']} | {r['mbit']:g} | {r['encode']} | {r['down_B_per_token']} | "
            f"{r['up_B_per_token']} | {r['bound_tokens_per_s']} | {r['compute_tokens_per_s']} | "
            f"{r['tokens_per_s']} | {r['ratio']:.0%} | {ph} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
