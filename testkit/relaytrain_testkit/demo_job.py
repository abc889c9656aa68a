"""The job `make demo` runs (examples/demo/finetunejob-demo.yaml), on local files, for
`relaytrain run --local`: the SmolLM2-135M-Instruct model `make deps` prepares in the cache,
the reverse-words data (hack/demo_data.py) and a checkpoint directory beside them. The
periodic-sync benchmark and the committed loss curves run it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hack import demo_data, toolpaths
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.local_jobs import NAMESPACE


def model_dir() -> Path:
    """Where `make deps` puts the demo's model."""
    return toolpaths.cache_dir() / "models" / "smollm2-135m-instruct"


def demo_job(root: Path, name: str, *, steps: int, every: int | None = None) -> Path:
    """The demo's job as `name` at `root/<name>.yaml`, on `root/reverse-words.jsonl` (written
    if missing), checkpoints under `root/ckpt`; periodic sync every `every` steps, or the
    demo's synchronous one."""
    data = root / "reverse-words.jsonl"
    if not data.exists():
        demo_data.write(data)
    job = (
        Job.example("demo/finetunejob-demo")
        .set("metadata", {"name": name})
        .model(str(model_dir()))
        .dataset(str(data))
        .training(steps=steps)
        .set("spec.checkpoint", {"uri": str(root / "ckpt"), "everySteps": 5, "keep": 2})
        .output(str(root / "out" / name))
    )
    if every is not None:
        job = job.sync("periodic", every_steps=every)
    return job.write(root / f"{name}.yaml")


def loss_history(root: Path, name: str) -> list[dict[str, Any]]:
    """The loss history a run of `name` under `root/ckpt` wrote: one record per step."""
    records: list[dict[str, Any]] = json.loads(
        (root / "ckpt" / NAMESPACE / name / "loss-history.json").read_text()
    )
    return records
