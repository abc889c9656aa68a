"""Bad input that only a stage can find stops the run at once, in the stage's own words
(relaytrain_contract.exits), through `relaytrain run --local`: no restart is spent on it.

The operator reads the same exit codes and lines from a pod's status
(tests/e2e/test_operator_e2e.py, the corpus of jobs wrong in the world); a store that
refuses the keys ends a stage with its own code (tests/unit/test_worker_config.py); a crash,
which a restart may pass, is still restarted (tests/e2e/test_local_supervisor.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from relaytrain_testkit.local_jobs import local_job, make_workspace, run_state, start_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("bad-input"), layers=2, records=8)


def _run(job: Path, workdir: Path, env: dict[str, str] | None = None) -> str:
    proc = start_run(job, workdir, env=env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    state = run_state(workdir)
    assert state is not None and [s["restarts"] for s in state["stages"]] == [0, 0], out
    assert "restarting it" not in out, out
    return out


def test_an_empty_data_set_stops_the_run_and_says_so(workspace: Path) -> None:
    empty = workspace / "empty.jsonl"
    empty.write_text("")
    job = local_job(workspace, "empty").dataset(str(empty)).write(workspace)
    out = _run(job, workspace / "wd-empty")
    assert (
        "stage 0 stopped (InvalidInput, exit 3), not to be restarted: relaytrain-worker: "
        f"stage 0: dataset.uri {str(empty)!r}: no records"
    ) in out
