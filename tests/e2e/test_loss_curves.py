"""Committed loss curves (torchtitan's tests/assets/losses): a numeric change anywhere in
training — data order, the schedule, compression, the exchange between pipelines, the
optimizer — changes these runs' per-step losses and is seen in review.

Each case's loss history (one record per step, written by the last stage of the writing
pipeline) is compared step by step with tests/assets/losses/<case>.json:

- `demo`: no run of its own but the session's one `make demo` (the `made_demo` fixture,
  tests/e2e/conftest.py; test_doc_commands_e2e checks what it prints): the job
  examples/demo/finetunejob-demo.yaml through the chart-installed operator on the local
  cluster, with MinIO and four real stage processes (LoRA r8 on SmolLM2-135M-Instruct, two
  pipelines of two stages sharing each step's micro-batches, int8 links, 20 steps, held-out
  loss every 10). Its curve is the loss-history.json the demo leaves in its working folder
  (the workers' own, from MinIO). The demo kills stage p1/s1 once the job reports step 10,
  and only steps 1–10 and the held-out losses at steps 0 and 10 are compared (the committed
  curve). Until 2026-11-27 the step in which the stage died trained on the contributions
  that arrived, which depends on where in that step the SIGKILL lands: four 20-step runs
  then ended on two curves, up to 1.9e-1 apart from step 13 on. That step is now trained
  again by pipeline 0 (docs/worker.md, Faults), and a 20-step demo with the kill gave the
  bits of one without it (`--kill-stage -1`) at every step and held-out loss (2026-11-27);
  the comparison still stops at step 10, where the rounding drift between CPUs measured
  below was.
  (The demo's rows went from 64 tokens to 32 on 2026-11-27: every example still fits, and
  steps 1–10 and the held-out losses gave the committed bits unchanged. On 2026-12-02 the
  planner began pricing each plan's step played out over its links, and the demo's plan
  changed: each pipeline's 30 layers split 8/22 with 2 + 2 micro-batches, where the sends
  priced in turn had put them 19/11 with 3 + 1. The int8 boundary sits after another layer,
  so even the held-out loss at step 0 moved, 4.935 to 4.926: the curve was written again.)
- `three-pipelines`: a tiny Llama run through `relaytrain run --local` (real stage processes
  over real links) as three pipelines of two stages, each step's three micro-batches shared
  among them, no compression, 12 steps.

Tolerance, relative per step: 2e-3 for `three-pipelines`, 1.5e-2 for the demo. The same run
twice gives the same bits on one machine; the tolerance is room for rounding (a sum in
another order, another CPU's kernels), not for a change of the maths, which moves the losses
far more: on the demo's compared steps, measured 2026-11-26 (demo runs without the kill, the
largest relative difference at any of steps 1–12 and held-out 0, 5, 10, when the comparison
went to step 12), a learning rate 1 % higher 4.4e-2, a linear schedule instead of cosine
1.2e-1, int4 links instead of int8 7.1e-1. Another CPU moves the demo more than 2e-3: on
2026-11-27's machine (AVX-512 with AMX; torch's CPU capability AVX512) the same code and
inputs gave a held-out loss at step 0 5.7e-6 away from the committed one (the same weights
and rows: only the kernels differ) and losses up to 7.6e-3 away by step 10, the gap growing
with the steps (the demo's learning rate takes the loss from 4.9 to 0.45 in ten). 1.5e-2 is
twice that, and a third of the smallest change of the maths measured. To regenerate after an
intended change, run this file with RELAYTRAIN_WRITE_LOSS_CURVES=1 and commit the files with
the change that explains them (the demo's steps, its kill step or its job change the demo's
curve).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from relaytrain_testkit import REPO
from relaytrain_testkit.demo_job import MadeDemo, loss_history
from relaytrain_testkit.local_jobs import fleet_job, make_workspace, start_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CURVES = REPO / "tests" / "assets" / "losses"
RTOL = 2e-3
DEMO_RTOL = 1.5e-2
"""The demo's: its kernels' rounding on another CPU grows to 7.6e-3 by step 10 (above)."""
DEMO_KILLED_AFTER = 10
"""hack/demo.py's --kill-at-step default: the demo's steps up to it are compared."""
WRITE = os.environ.get("RELAYTRAIN_WRITE_LOSS_CURVES") == "1"


def _run(job: Path, workdir: Path) -> None:
    proc = start_run(job, workdir, env={"OMP_NUM_THREADS": "1"})
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out


def _curve(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "loss": {str(r["step"]): r["loss"] for r in records if r.get("loss") is not None},
        "evalLoss": {
            str(r["step"]): r["evalLoss"] for r in records if r.get("evalLoss") is not None
        },
    }


def _demo(request: pytest.FixtureRequest, root: Path) -> dict[str, Any]:
    made: MadeDemo = request.getfixturevalue("made_demo")  # the session's one `make demo`
    assert made.result.rc == 0, made.result.output[-20000:]
    killed = made.killed_after()
    assert killed is not None and killed >= DEMO_KILLED_AFTER, made.result.output[-20000:]
    return _curve([r for r in made.loss_history() if r["step"] <= DEMO_KILLED_AFTER])


def _three_pipelines(request: pytest.FixtureRequest, root: Path) -> dict[str, Any]:
    make_workspace(root, layers=4, records=48)
    _run(fleet_job(root, "fleet", replicas=3, steps=12, every=6), root / "wd")
    return _curve(loss_history(root, "fleet"))


CASES = {"demo": _demo, "three-pipelines": _three_pipelines}
DEMO_MARKS = [pytest.mark.cluster, pytest.mark.demo]


def differences(got: dict[str, Any], want: dict[str, Any], rtol: float) -> list[str]:
    """Each step whose loss (or held-out loss) is missing, extra or off by more than `rtol`."""
    found = []
    for key in ("loss", "evalLoss"):
        for step in sorted(set(got[key]) | set(want[key]), key=int):
            a, b = got[key].get(step), want[key].get(step)
            if a is None or b is None or not math.isclose(a, b, rel_tol=rtol):
                found.append(f"{key} at step {step}: ran {a}, committed {b}")
    return found


def test_a_changed_step_is_reported() -> None:
    want = {"loss": {"1": 2.0, "2": 1.5}, "evalLoss": {"2": 1.7}}
    assert differences(want, want, RTOL) == []
    assert differences({**want, "loss": {"1": 2.0, "2": 1.5 * (1 + 3 * RTOL)}}, want, RTOL) == [
        f"loss at step 2: ran {1.5 * (1 + 3 * RTOL)}, committed 1.5"
    ]
    assert differences({**want, "evalLoss": {}}, want, RTOL) == [
        "evalLoss at step 2: ran None, committed 1.7"
    ]


@pytest.mark.parametrize(
    "case",
    # `demo` uses the session's `make demo` (its own control plane): marked as the tests
    # that use it are (tests/conftest.py), so that it runs in their session.
    [pytest.param(c, marks=DEMO_MARKS) if c == "demo" else c for c in sorted(CASES)],
)
def test_the_loss_curve_is_the_committed_one(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    got = CASES[case](request, tmp_path)
    path = CURVES / f"{case}.json"
    if WRITE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    assert len(want["loss"]) >= 10
    assert differences(got, want, DEMO_RTOL if case == "demo" else RTOL) == []
