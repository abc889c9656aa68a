"""`python -m relaytrain_worker` and SIGTERM: a pod deleted at any moment ends the stage
cleanly (130 while it trains, its own code or a plain SIGTERM once the outcome is decided),
never as an uncaught KeyboardInterrupt (-2, which reads as a crash). A stage of several
pipelines asked to stop while it trains goes on to its step boundary and leaves there
(`Replication.depart`, exercised with real stages in tests/e2e/test_local_pipelines_e2e.py).
A stage that dies of a fatal signal leaves every thread's stack in its log (faulthandler).

The stage itself is stood in for here so that the signal lands at a chosen moment; the
real stages are stopped by pod deletion throughout tests/e2e.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from relaytrain_contract.exits import StageExit
from relaytrain_operator.domain.stage_config import build_stage_configs, pod_endpoints
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.stage_pods import JOB, PLAN

pytestmark = [pytest.mark.unit, pytest.mark.torch]

# A stand-in stage whose loading, run() or close() receives the pod's SIGTERM; the worker
# is imported once (torch takes seconds) and each case runs in a forked child.
_SCRIPT = """
import json, os, signal, sys, time
import relaytrain_worker.process as process
import relaytrain_worker.model.shards, relaytrain_worker.pipeline.linkauth
import relaytrain_worker.state.records
import relaytrain_worker.stopping
from relaytrain_worker.__main__ import main

relaytrain_worker.stopping.STOP_SECONDS = 1.0  # the watcher's bound, shortened for the test
relaytrain_worker.stopping.LEAVE_WAIT_SECONDS = 3600.0  # only a second SIGTERM ends "twice"

def _sigterm_here(where):
    if where == WHERE:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)  # the handler runs at once; the sleep is never finished

from relaytrain_worker.pipeline.replication import DepartedError

class Replication:
    asked = False
    def depart(self):  # a stage of several pipelines leaves at its next step boundary
        if WHERE not in ("leave", "twice") or self.asked:
            return False
        self.asked = True
        return True

class Stand_in:
    replication = Replication()
    def run(self):
        _sigterm_here("run")
        if WHERE == "ignored":  # the KeyboardInterrupt lost on its way up (a catch-all)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(2)
            except KeyboardInterrupt:
                pass
            while True:  # and the stage trains on
                time.sleep(0.01)
        if WHERE == "twice":  # leaving at a step boundary it never reaches; asked again
            os.kill(os.getpid(), signal.SIGTERM)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(2)
            except KeyboardInterrupt:  # and that one lost too
                pass
            while True:
                time.sleep(0.01)
        if WHERE == "crash":  # a native crash (torch, a link thread): no Python exception
            os.kill(os.getpid(), signal.SIGSEGV)
        if WHERE == "replaced":  # no signal: a link met a stage of a later plan
            from relaytrain_worker.pipeline.linkauth import PlanReplaced
            raise PlanReplaced("stage at h:1 (s1) is a stage of plan 2 of this job, which"
                               " replaced every stage of plan 1, this one's")
        if WHERE == "leave":
            os.kill(os.getpid(), signal.SIGTERM)  # handled: training goes on to the boundary
            assert self.replication.asked
            raise DepartedError("stage p1/s0 left at step 7")
        return 0
    def close(self):
        _sigterm_here("close")

def load_runtime(cfg):
    _sigterm_here("load")
    return Stand_in()

process.load_runtime = load_runtime
codes = {}
for WHERE in sys.argv[2:]:
    child = os.fork()
    if child == 0:
        os._exit(main(["--config", sys.argv[1]]))  # an uncaught exception ends it otherwise
    codes[WHERE] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
print(json.dumps(codes))
"""

# Where the SIGTERM lands -> the exit codes that read as a clean stop.
CLEAN = {
    "load": {130},  # stopped while loading the model
    "run": {130},  # stopped while training
    "leave": {130},  # several pipelines: left at the step boundary after the SIGTERM
    "close": {0, -signal.SIGTERM},  # done; the pod deleted while the links close
    "ignored": {130},  # the main thread trains on: the watcher ends it (stopping.py)
    "twice": {130},  # a second SIGTERM: the watcher waits for no step boundary
    "nowhere": {0},
    "replaced": {130},  # no signal: a stage of a replaced plan stops (PlanReplaced)
}


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], str]:
    """Each case's exit code, and the stderr of them all (one run: torch imports once)."""
    job = parse_job(JOB.build())
    config = build_stage_configs(job, PLAN, pod_endpoints("smol", "team-a", 2))[1]
    path = tmp_path_factory.mktemp("sigterm") / "stage.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(path), *CLEAN, "crash"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_sigterm_never_reads_as_a_crash(ended: tuple[dict[str, int], str]) -> None:
    codes, stderr = ended
    assert {where: codes[where] in ok for where, ok in CLEAN.items()} == dict.fromkeys(
        CLEAN, True
    ), (codes, stderr[-3000:])
    assert "Traceback" not in stderr
    assert "stage p1/s0 left at step 7" in stderr  # the leave, not a stop at the signal
    # A stage whose link met one of a later plan stops as a stage of a replaced plan, saying so.
    assert "it stops: stage at h:1 (s1) is a stage of plan 2 of this job" in stderr, stderr[-3000:]


def test_a_stage_that_crashes_natively_leaves_its_stacks_in_its_log(
    ended: tuple[dict[str, int], str],
) -> None:
    """A fatal signal (a segfault in torch or a link thread) kills the stage as it would any
    process, but not without a word: its log holds every thread's stack."""
    codes, stderr = ended
    assert codes["crash"] == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in stderr, stderr[-3000:]
    assert 'File "<string>", line' in stderr and "in run" in stderr


def test_a_stage_that_trains_on_after_its_sigterm_is_ended_with_its_stacks_in_its_log(
    ended: tuple[dict[str, int], str],
) -> None:
    """The pod's SIGTERM reached the stage, but its KeyboardInterrupt was lost on the way
    up and the stage trained on (committing for a plan already replaced). The watcher
    (stopping.py) ends it `STOP_SECONDS` after the signal, with the code of a stop, and the
    log says so and where the main thread was."""
    codes, stderr = ended
    assert codes["ignored"] == StageExit.STOPPED, stderr[-3000:]
    assert "Stage 1 received SIGTERM" in stderr, stderr[-3000:]
    assert "Stage 1 is still running 1 s after SIGTERM: it ends now" in stderr, stderr[-3000:]
    assert "(most recent call first)" in stderr and "in run" in stderr
