"""Worker benchmarks: pipeline throughput vs single-process peft, and stage memory.

    .venv/bin/python bench/bench_worker.py [--quick]

1. Tokens/s of a P-stage pipeline (P = 2, 3; stages as threads over real loopback
   links, 1F1B, compression none and int8) against single-process peft LoRA training of
   the same model and batches; prints the ratio. On one machine the stages share its
   cores, so this measures the pipeline's overhead, not a speed-up.
2. Peak RSS of loading one stage's slice against loading the whole model (each in a
   fresh process; SmolLM2-135M when prepared, else a random 8-layer model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from relaytrain_contract import TrainingSpec
from relaytrain_worker.prepare_model import default_dir, is_prepared

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))
from relaytrain_testkit.inputs import even_splits, random_batches
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import PipelineRun, run_pipeline_threads
from relaytrain_testkit.references import run_reference
from relaytrain_testkit.tiny_models import tiny_model_dir

RSS_SCRIPT = """
import json, sys
from pathlib import Path
import torch, transformers, accelerate, peft
from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model
start, end, layers = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
stage = build_stage_model(Path(sys.argv[1]), SliceSpec(start, end, start == 0, end == layers))
for p in stage.parameters():
    float(p.sum())
print(json.dumps({"grow": status("VmHWM") - base}))
"""


def _in_thread(fn: Callable[[], PipelineRun]) -> PipelineRun:
    """Run `fn` on a fresh thread, as each pipeline stage runs: torch's intra-op thread
    settings are per thread, and the comparison must not favour either side."""
    box: list[PipelineRun] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def throughput(quick: bool) -> list[dict[str, object]]:
    root = Path(tempfile.mkdtemp())
    layers = 6
    model = tiny_model_dir(root / "m", layers=layers, hidden=256, max_shard_size="2MB")
    steps, m, mbs, seq = (3, 4, 2, 64) if quick else (4, 8, 4, 128)
    data = random_batches(steps, m, mbs, seq, 300)
    tokens = steps * m * mbs * seq
    training = TrainingSpec(
        steps=steps, microBatchSize=mbs, microBatches=m, learningRate=1e-3,
        schedule="constant", warmupSteps=0, weightDecay=0.0, maxGradNorm=1.0, seed=0,
    )  # fmt: skip
    rows = []
    run_reference(model, data[:1], training)  # warm-up: lazy imports, first-call costs
    single = tokens / _in_thread(lambda: run_reference(model, data, training)).seconds
    rows.append({"setup": "single-process peft", "tokens_per_s": round(single, 1), "ratio": 1.0})
    for stages in (2, 3):
        for compression in ("none", "int8"):
            run = run_pipeline_threads(
                model, even_splits(layers, stages), data, training,
                credentials=stage_credentials(stages, job="bench"), compression=compression,
            )  # fmt: skip
            rate = tokens / run.seconds
            rows.append({
                "setup": f"pipeline P={stages} {compression}",
                "tokens_per_s": round(rate, 1),
                "ratio": round(rate / single, 3),
            })  # fmt: skip
    return rows


def memory() -> list[dict[str, object]]:
    if is_prepared(default_dir()):
        model, layers, name = default_dir(), 30, "SmolLM2-135M"
    else:
        root = Path(tempfile.mkdtemp())
        model = tiny_model_dir(root / "m", layers=8, hidden=512, max_shard_size="20MB")
        layers, name = 8, "random 8-layer"

    def grow(start: int, end: int) -> int:
        out = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, str(model), str(start), str(end), str(layers)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return int(json.loads(out.stdout.strip().splitlines()[-1])["grow"])

    whole = grow(0, layers)
    rows = [{"model": name, "load": f"whole (0-{layers - 1})", "peak_MiB": whole >> 20}]
    for start, end in even_splits(layers, 3):
        g = grow(start, end)
        rows.append({
            "model": name, "load": f"stage {start}-{end - 1}", "peak_MiB": g >> 20,
            "vs_whole": round(g / whole, 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}")
    for row in throughput(args.quick):
        print(json.dumps(row))
    for row in memory():
        print(json.dumps(row))


if __name__ == "__main__":
    main()
