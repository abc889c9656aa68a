"""The job `make demo` runs (examples/demo/finetunejob-demo.yaml), on local files, for
`relaytrain run --local`: the SmolLM2-135M-Instruct model `make deps` prepares in the cache,
the reverse-words data (hack/demo_data.py) and a checkpoint directory beside them. The
periodic-sync benchmark runs it.

And `make demo` itself, as a user types it (`make_demo`): the e2e tests share one run (the
`made_demo` fixture, tests/e2e/conftest.py), its output and the working folder it leaves
(loss.png, loss-history.json, the operator's and each stage's log).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack import demo_data, toolpaths
from relaytrain_testkit import REPO
from relaytrain_testkit.doc_commands import Result, Shell, clean_env
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.local_jobs import NAMESPACE


def model_dir() -> Path:
    """Where `make deps` puts the demo's model."""
    return toolpaths.cache_dir() / "models" / "smollm2-135m-instruct"


def demo_job(
    root: Path, name: str, *, steps: int, every: int | None = None, merge: str | None = None
) -> Path:
    """The demo's job as `name` at `root/<name>.yaml`, on `root/reverse-words.jsonl` (written
    if missing), checkpoints under `root/ckpt`; periodic sync every `every` steps (merging
    LoRA as `merge` says: `sync.loraMerge`), or the demo's synchronous one. With the
    64-token rows and the held-out loss every 5 steps that docs/planner.md's convergence
    figures were measured with (`make demo` has since run 32-token rows, which hold every
    example as well, and evaluated every 10 steps)."""
    data = root / "reverse-words.jsonl"
    if not data.exists():
        demo_data.write(data)
    job = (
        Job.example("demo/finetunejob-demo")
        .set("metadata", {"name": name})
        .model(str(model_dir()))
        .dataset(str(data))
        .set("spec.dataset.sequenceLength", 64)
        .training(steps=steps)
        .set("spec.training.evalEverySteps", 5)
        .set("spec.checkpoint", {"uri": str(root / "ckpt"), "everySteps": 5, "keep": 2})
        .output(str(root / "out" / name))
    )
    if every is not None:
        job = job.sync("periodic", every_steps=every, lora_merge=merge)
    return job.write(root / f"{name}.yaml")


def loss_history(root: Path, name: str) -> list[dict[str, Any]]:
    """The loss history a run of `name` under `root/ckpt` wrote: one record per step."""
    records: list[dict[str, Any]] = json.loads(
        (root / "ckpt" / NAMESPACE / name / "loss-history.json").read_text()
    )
    return records


@dataclass(frozen=True)
class MadeDemo:
    """One `make demo` run: what it printed and the working folder it left."""

    result: Result
    workdir: Path | None
    """From its `[demo] Working folder: PATH` line (None when it printed none)."""

    def killed_after(self) -> int | None:
        """The job's step when the demo killed a stage (`After the kill at step N`): steps up
        to N had ended everywhere, so their losses are the same in every run."""
        match = re.search(r"^\[demo\] After the kill at step (\d+) ", self.result.output, re.M)
        return int(match.group(1)) if match else None

    def loss_history(self) -> list[dict[str, Any]]:
        """The run's loss history, one record per step, as the demo left it in its working
        folder (`loss-history.json`, the workers' own file from MinIO)."""
        assert self.workdir is not None, self.result.output[-20000:]
        records: list[dict[str, Any]] = json.loads((self.workdir / "loss-history.json").read_text())
        return records


def make_demo(timeout: float = 1800) -> MadeDemo:
    """`make demo` in the repository, as a user types it (a fresh shell's environment)."""
    result = Shell(clean_env(), REPO).run("make demo", timeout=timeout)
    match = re.search(r"^\[demo\] Working folder: (.+)$", result.output, re.M)
    return MadeDemo(result, Path(match.group(1).strip()) if match else None)
