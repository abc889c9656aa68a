"""Goodput while a pipeline is killed every N steps: two pipelines against one.

    .venv/bin/python bench/bench_fleet_goodput.py [--quick] [--json OUT] [--steps S]
                                                  [--kill-every N] [--kills K]

The same job (a random 4-layer Llama, float32, LoRA r4 on q/v, 3 micro-batches of 2 x 24
tokens per step, a checkpoint every 10 steps) run by `relaytrain run --local` — every stage
its own `python -m relaytrain_worker`, as in tests/e2e/test_local_pipelines_e2e.py — four
ways, side by side:

- one 2-stage pipeline, uninterrupted, and with its stage 1 killed (SIGKILL) K times;
- two 2-stage pipelines as one job, uninterrupted, and with stage 1 of pipeline 1 killed
  K times.

Each kill lands once the victim has trained N steps (60) since it started or came back: with
one pipeline, back is when the job trains again; with two, when pipeline 1 has rejoined (a
kill sooner would hit a process still loading). Both configurations get the same K kills (4;
the job is long enough, 1,200 steps, for pipeline 1's rejoins). With one pipeline a kill stops
the job: the replacement loads, every stage goes back to the last committed step and redoes
the steps since. With two, pipeline 0 trains on alone (the dead pipeline's micro-batches
redistributed, no rollback) and pipeline 1 rejoins at a step boundary with pipeline 0's
state.

Each pipeline stands for GPUs of its own: its stage processes are pinned to one core (pipeline
p on core p), replacements too, so two pipelines on a two-core machine do not slow each other
down beyond the replica links, and one pipeline runs on one core.

Reported per configuration: wall seconds from start to the job's end, kills, seconds lost per
kill (against the uninterrupted run), steps redone (trained again after a rollback: the sum
over kills of the step reached minus the step restored; with two pipelines, the steps the
survivor trained again because the victim died in the middle of them) and goodput =
uninterrupted wall / wall with kills (1.0 = the kills cost nothing).
The run pins OMP_NUM_THREADS=1 so both configurations compute with the same kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "testkit")]

from relaytrain_testkit.local_jobs import (  # noqa: E402
    fleet,
    make_workspace,
    pin_pipelines,
    progress,
    run_state,
    start_run,
)

EVERY = 10
"""Checkpoint interval, steps."""
ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Outcome:
    config: str
    pipelines: int
    steps: int
    kills: int
    wall_s: float
    redone_steps: int
    final_loss: float


def _job(root: Path, name: str, replicas: int, steps: int) -> Path:
    job = fleet(root, name, replicas=replicas, steps=steps, every=EVERY)
    return job.failure_policy(max_stage_restarts=1000, backoff_seconds=0).write(root)


def _base(replicas: int, pipeline: int, stage: int) -> str:
    """A stage's file name in the run's stages/ folder (no pipeline prefix with one)."""
    return f"p{pipeline}-stage-{stage}" if replicas > 1 else f"stage-{stage}"


def _restored(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"restored committed step (\d+)", log)]


def run(root: Path, replicas: int, steps: int, kill_every: int, kills: int) -> Outcome:
    """One run; `kills` kills of the victim, each once it has trained `kill_every` steps
    since it (re)joined (0 kills: uninterrupted)."""
    config = f"{replicas} pipeline{'s' if replicas > 1 else ''}" + (
        f", {kills} kills" if kills else ", uninterrupted"
    )
    name = f"p{replicas}-{'kill' if kills else 'clean'}"
    workdir = root / f"wd-{name}"
    victim = (replicas - 1, 1)
    log = workdir / "stages" / f"{_base(replicas, *victim)}.log"
    started = time.monotonic()
    proc = start_run(_job(root, name, replicas, steps), workdir, env=ENV)
    at_kill: list[int] = []  # the job's step at each kill
    next_kill: int | None = kill_every if kills else None
    record_at_kill: dict[str, Any] | None = None
    while proc.poll() is None:
        time.sleep(0.02)
        at = progress(root / "ckpt", name)
        state = run_state(workdir)
        pin_pipelines(state)
        if next_kill is None or at is None or state is None or at.get("done"):
            continue
        if at_kill and record_at_kill is not None:
            # Back? Two pipelines: the victim's pipeline rejoined; one: the job trains again.
            text = log.read_text() if log.exists() else ""
            back = (
                text.count(" rejoined at step ") >= len(at_kill)
                if replicas > 1
                else at != record_at_kill
            )
            if not back:
                continue
            next_kill, record_at_kill = at["step"] + kill_every, None
        if at["step"] < next_kill:
            continue
        pid = next(s for s in state["stages"] if (s["pipeline"], s["index"]) == victim)["pid"]
        if pid is None:
            continue
        os.kill(pid, signal.SIGKILL)
        at_kill.append(at["step"])
        record_at_kill = at
        if len(at_kill) == kills:
            next_kill = None
    out, _ = proc.communicate(timeout=60)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{config}: the run failed:\n{out}")
    if len(at_kill) < kills:
        print(f"  ({config}: the job ended after {len(at_kill)} of {kills} kills; raise --steps)")
    # Steps redone: with one pipeline, each kill sends every stage back to the last commit.
    first = (workdir / "stages" / f"{_base(replicas, 0, 0)}.log").read_text()
    restored = _restored(first)
    redone = sum(k - r for k, r in zip(at_kill, restored, strict=False) if k > r)
    redone += len(re.findall(r"trains step \d+ again", first))  # a step a pipeline died in
    history = json.loads((root / "ckpt" / "default" / name / "loss-history.json").read_text())
    return Outcome(config, replicas, steps, len(at_kill), wall, redone, history[-1]["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--steps", type=int, help="steps per run (default 1200; quick 400)")
    parser.add_argument(
        "--kill-every", type=int, help="steps the victim trains between kills (default 60)"
    )
    parser.add_argument("--kills", type=int, help="kills per run (default 4; quick 2)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    steps = args.steps or (400 if args.quick else 1200)
    kill_every = args.kill_every or 60
    kills = args.kills or (2 if args.quick else 4)
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        root = make_workspace(Path(tmp), layers=4, records=96)
        for replicas in (1, 2):
            for n in (0, kills):
                results.append(run(root, replicas, steps, kill_every, n))
                r = results[-1]
                print(f"  {r.config}: {r.wall_s:.1f} s, {r.kills} kills, {r.redone_steps} "
                      f"steps redone, final loss {r.final_loss:.4f}", flush=True)  # fmt: skip
    print(f"\n{steps} steps; the victim killed {kills} times, each after training {kill_every} "
          f"steps since it (re)joined; a checkpoint every {EVERY} steps\n")  # fmt: skip
    print("| configuration | wall s | kills | s lost per kill | steps redone | goodput |")
    print("|---|---|---|---|---|---|")
    goodput: dict[int, float] = {}
    for clean, killed in (results[0:2], results[2:4]):
        goodput[clean.pipelines] = clean.wall_s / killed.wall_s
        for r in (clean, killed):
            share = f"{clean.wall_s / r.wall_s:.2f}" if r is killed else "1.00"
            lost = (r.wall_s - clean.wall_s) / r.kills if r.kills else 0.0
            print(f"| {r.config} | {r.wall_s:.1f} | {r.kills} | {lost:.1f} | {r.redone_steps} "
                  f"| {share} |")  # fmt: skip
    print(f"\ngoodput kept under kills: two pipelines {goodput[2]:.2f}, one {goodput[1]:.2f} "
          f"({goodput[2] / goodput[1]:.2f}x)")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"results": [asdict(r) for r in results], "goodput": goodput}, indent=2)
        )


if __name__ == "__main__":
    main()
