"""Convergence of periodic synchronisation against synchronous, on the demo's model and data.

    .venv/bin/python bench/bench_periodic_convergence.py [--quick] [--steps S]
                                                         [--every H ...] [--json OUT]

The job `make demo` runs (examples/demo/finetunejob-demo.yaml: LoRA r8 on SmolLM2-135M-
Instruct, the reverse-words data with a tenth held out, 4 micro-batches of 2 x 64 tokens per
step, two pipelines of two stages), run by `relaytrain run --local` from local files, side by
side with `spec.pipeline.sync`:

- `synchronous`: the gradients reduced every step (the same maths as one pipeline);
- `periodic` every H steps (4 and 8 by default): each pipeline steps on its half of every
  step and the weights are averaged, token-weighted, every H steps (and at every checkpoint
  and evaluation, every 5 steps here: so H = 8 averages at 5, 8, 10, 15, 16, 20, ...),
  merging the pipelines' LoRA adapters as `--merges` says (`sync.loraMerge`: `exact`, the
  default for two pipelines since 2026-11-29, and `average`, the factors one by one).

Reported per configuration: the training loss (mean of the last 5 steps), the held-out loss
at each evaluation and at the end, and its ratio to synchronous (1.00 = converges as well).
Wall time is printed but means little here: periodic sync saves link bytes, and these links
are loopback. Each pipeline's processes are pinned to a core of their own
(relaytrain_testkit.local_jobs.pin_pipelines); OMP_NUM_THREADS=1. Needs the demo's model
(`make deps` puts it in the cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "testkit")]

from relaytrain_testkit.demo_job import demo_job, loss_history, model_dir  # noqa: E402
from relaytrain_testkit.local_jobs import pin_pipelines, run_state, start_run  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Outcome:
    config: str
    steps: int
    wall_s: float
    train_loss: float
    """Mean training loss of the last 5 steps."""
    eval_losses: dict[int, float]
    """Held-out loss by step."""


def run(root: Path, steps: int, every: int | None, merge: str | None = None) -> Outcome:
    config = "synchronous" if every is None else f"periodic every {every}, {merge} merge"
    name = "sync" if every is None else f"periodic-{every}-{merge}"
    started = time.monotonic()
    job = demo_job(root, name, steps=steps, every=every, merge=merge)
    proc = start_run(job, root / f"wd-{name}", env=ENV)
    while proc.poll() is None:
        pin_pipelines(run_state(root / f"wd-{name}"))
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"{config}: the run failed:\n{out}")
    wall = time.monotonic() - started
    records = loss_history(root, name)
    train = [r["loss"] for r in records if r.get("loss") is not None][-5:]
    evals = {r["step"]: r["evalLoss"] for r in records if r.get("evalLoss") is not None}
    return Outcome(config, steps, wall, sum(train) / len(train), evals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--steps", type=int, help="steps per run (default 60; quick 20)")
    parser.add_argument(
        "--every", type=int, nargs="+", help="periodic intervals to compare (default 4 8)"
    )
    parser.add_argument(
        "--merges",
        default="exact,average",
        help="sync.loraMerge values to compare, comma-separated (default exact,average)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 60)
    model = model_dir() / "config.json"
    if not model.exists():
        raise SystemExit(f"{model.parent} is missing: run `make deps` first")
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-periodic-") as tmp:
        root = Path(tmp)
        configs = [(None, None)] + [
            (every, merge) for every in args.every or (4, 8) for merge in args.merges.split(",")
        ]
        for every, merge in configs:
            results.append(run(root, steps, every, merge))
            r = results[-1]
            last = max(r.eval_losses)
            print(f"  {r.config}: {r.wall_s:.1f} s, train loss {r.train_loss:.4f}, held-out "
                  f"{r.eval_losses[last]:.4f} at step {last}", flush=True)  # fmt: skip
    base = results[0]
    end = max(base.eval_losses)
    print(f"\n{steps} steps of the demo job (two pipelines of two stages); held-out loss "
          f"every 5 steps\n")  # fmt: skip
    marks = sorted(base.eval_losses)
    print("| sync | " + " | ".join(f"held-out @{s}" for s in marks)
          + " | train loss (last 5) | held-out vs synchronous | wall s |")  # fmt: skip
    print("|---|" + "---|" * (len(marks) + 3))
    for r in results:
        ratio = r.eval_losses[end] / base.eval_losses[end]
        cells = " | ".join(f"{r.eval_losses.get(s, float('nan')):.4f}" for s in marks)
        print(f"| {r.config} | {cells} | {r.train_loss:.4f} | {ratio:.3f} | {r.wall_s:.0f} |")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
