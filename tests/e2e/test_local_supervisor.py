"""`relaytrain run --local` as a supervisor: stopping leaves no stage behind (also while a
stage crash-loops), so does killing it (SIGKILL; whether the stages were forked by the
run's own prefork server or by the one the test session shares), a second run of a live
job is refused, and each job keeps its own state.

Tiny random Llama models (no downloads); real `python -m relaytrain_worker` processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml
from relaytrain_contract import PLAN_FILE
from relaytrain_contract.prefork import SOCKET_ENV
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.local_jobs import (
    NAMESPACE,
    STACK_MARK,
    alive,
    local_job,
    make_workspace,
    progress,
    run_state,
    stage_processes,
    stage_stacks,
    stages_left,
    start_run,
    started_pids,
    wait_until_no_stage_is_left,
    wait_while_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("supervisor"), layers=2, records=16)


def _job(root: Path, name: str, steps: int) -> Job:
    """The local job `name`, `steps` steps long, a checkpoint every 2 steps under
    `root/ckpt`."""
    return local_job(root, name).training(steps=steps).checkpoint(str(root / "ckpt"), every_steps=2)


def _crash_looping_job(root: Path, name: str) -> Job:
    """Stage 0 cannot write its first record (its checkpoint directory would be under a
    plain file) and crashes at start-up, again and again (100 restarts allowed: a crash may
    pass, unlike bad input, which stops a stage for good); stage 1 waits."""
    (root / "a-file").write_text("not a directory")
    return (
        local_job(root, name)
        .training(steps=500)
        .checkpoint(str(root / "a-file" / "ckpt"), every_steps=2)
        .failure_policy(max_stage_restarts=100)
    )


def _stage_0_restarted(workdir: Path, times: int) -> bool:
    state = run_state(workdir)
    return bool(state) and state["stages"][0]["restarts"] >= times  # type: ignore[index]


def test_sigterm_mid_run_stops_every_stage(workspace: Path) -> None:
    workdir = workspace / "wd-term"
    proc = start_run(_job(workspace, "term", 500).write(workspace), workdir)
    wait_while_running("a step finished", lambda: progress(workspace / "ckpt", "term"), proc)
    assert len(stage_processes(workdir)) == 2  # the scan sees the stages while they run
    # SIGUSR1 to a stage writes every thread's stack to its log (where a hung stage waits),
    # and the stage trains on: the same processes reach a later step.
    pids = started_pids(workdir)
    stacks = stage_stacks(proc.pid)
    for k in range(2):
        assert f"--- stage process {pids[k]} (stage-{k}.log)" in stacks, stacks
    assert stacks.count(f"{STACK_MARK}):") >= 2 and "relaytrain_worker" in stacks, stacks
    at = progress(workspace / "ckpt", "term")["step"]
    wait_while_running("a later step", lambda: progress(workspace / "ckpt", "term")["step"] > at,
                       proc)  # fmt: skip
    if started_pids(workdir) != pids:  # a stage restarted: say why (its log, the run's output)
        proc.kill()
        logs = "\n".join(p.read_text(errors="replace")[-6000:] for p in workdir.glob("*.log"))
        pytest.fail(f"{started_pids(workdir)} != {pids}\n{proc.communicate()[0]}\n{logs}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopping every stage" in out
    # The supervisor waited for its stages before it exited: none is left, not even briefly.
    assert stages_left(workdir) == []


def test_sigterm_while_a_stage_crash_loops_restarts_nothing(workspace: Path) -> None:
    # The supervisor is stopped while it restarts stage 0, after a back-off of 1 s.
    workdir = workspace / "wd-loop"
    job = _crash_looping_job(workspace, "loop").failure_policy(backoff_seconds=1)
    proc = start_run(job.write(workspace), workdir)
    wait_while_running("stage 0 restarted", lambda: _stage_0_restarted(workdir, 1), proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert stages_left(workdir) == []  # of every process it ever started


@pytest.mark.parametrize("server", ["shared", "own"])
def test_a_killed_supervisor_takes_its_stages_along(workspace: Path, server: str) -> None:
    from relaytrain_operator.cli.local_run import lock_workdir
    from relaytrain_operator.spec import parse_job

    # SIGKILL: the supervisor cannot stop anything. Stages forked by the run's own prefork
    # server die with it (death signals: supervisor, server, stage); those forked by the
    # session's shared server are killed by that server when the supervisor's connections
    # close.
    name = f"kill9-{server}"
    workdir = workspace / f"wd-{name}"
    job = _job(workspace, name, 500).write(workspace)
    proc = start_run(job, workdir, env={SOCKET_ENV: ""} if server == "own" else None)
    wait_while_running("a step finished", lambda: progress(workspace / "ckpt", name), proc)
    pids = wait_while_running("both stages started", lambda: started_pids(workdir), proc)
    assert sorted(pid for pid, _ in stage_processes(workdir)) == sorted(pids)
    forked_by = {_parent(_parent(pid)) for pid in pids}  # the prefork server's parent
    assert forked_by == ({os.getpid()} if server == "shared" else {proc.pid})
    assert (workdir / "prefork.log").exists() == (server == "own")
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    assert "of its own" not in out  # the shared server served the run (or was not asked)
    wait_until_no_stage_is_left(workdir)
    # The kernel dropped the run's lock with it: the job may be run again in that directory.
    os.close(lock_workdir(workdir, parse_job(yaml.safe_load(job.read_text()))))


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_supervisor_leaves_no_stage_of_a_crash_loop(workspace: Path) -> None:
    # Killed while it restarts stage 0 as fast as it can (no back-off): a stage started just
    # before the supervisor died goes too, and none is started after.
    workdir = workspace / "wd-kill9-loop"
    job = _crash_looping_job(workspace, "kill9loop").failure_policy(backoff_seconds=0)
    proc = start_run(job.write(workspace), workdir)
    wait_while_running("stage 0 restarted", lambda: _stage_0_restarted(workdir, 1), proc)
    proc.kill()
    proc.communicate(timeout=30)
    wait_until_no_stage_is_left(workdir)


def test_a_second_run_of_a_live_job_is_refused(workspace: Path) -> None:
    workdir = workspace / "wd-twice"
    job = _job(workspace, "twice", 500).write(workspace)
    first = start_run(job, workdir)
    pids = wait_while_running("the stages started", lambda: started_pids(workdir), first)
    documents = {p.name: p.stat().st_mtime_ns for p in (workdir / "stages").glob("*.json")}
    second = start_run(job, workdir)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2, out
    holder = f"(PID {first.pid})"
    assert f"job default/twice is already running in {workdir.resolve()} {holder}" in out
    # The refused run wrote nothing and started nothing; the first one runs on.
    assert {p.name: p.stat().st_mtime_ns for p in (workdir / "stages").glob("*.json")} == (
        documents
    )
    assert first.poll() is None and started_pids(workdir) == pids
    assert all(alive(pid) for pid in pids)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 130, out
    assert stages_left(workdir) == []


def test_two_jobs_started_from_one_directory_keep_their_own_state(
    workspace: Path, tmp_path: Path
) -> None:
    names = ("alpha", "beta")
    jobs = {n: local_job(workspace, n).training(steps=2).write(workspace) for n in names}
    runs = {n: start_run(jobs[n], None, cwd=tmp_path) for n in names}  # side by side
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, out)
    for name in names:
        other = next(n for n in names if n != name)
        state_dir = tmp_path / "relaytrain-local" / "default" / name
        documents = [p.read_text() for p in (state_dir / "stages").glob("stage-*.json")]
        assert len(documents) == 2
        assert all(f"/default/{name}/" in d and f"/{other}/" not in d for d in documents)
        assert json.loads((state_dir / "summary.json").read_text())["job"] == name
        # The default checkpoint store is the job's own directory too.
        output = state_dir / "checkpoints" / "default" / name / "output"
        assert (output / "adapter_model.safetensors").is_file()


def test_a_stage_of_a_replaced_plan_commits_nothing_more(workspace: Path) -> None:
    """The job's store comes to name a later plan's stages as its writers (plan.json, as an
    operator writes it once it replaced every stage, while these, on a node cut off, train
    on): each stage stops before its next checkpoint, saying why, and no step is committed
    from then on — the restarted ones, of the same plan, stop there too, and the run ends
    once their restarts are spent, with the stage's own words."""
    workdir = workspace / "wd-replaced"
    proc = start_run(_job(workspace, "replaced", 500).write(workspace), workdir)
    store = workspace / "ckpt" / NAMESPACE / "replaced"
    try:
        wait_while_running(
            "a commit",
            lambda: (progress(workspace / "ckpt", "replaced") or {}).get("lastCommittedStep"),
            proc,
        )
        (store / PLAN_FILE).write_text(json.dumps({"uid": "", "epoch": 1}))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    refused = re.findall(r"it stops without writing step (\d+): every stage of the job was "
                         r"replaced by plan 1's \(this stage is of plan 0\)", out)  # fmt: skip
    assert refused, out
    committed = [
        int(m.parent.name.removeprefix("step-")) for m in store.glob("step-*/manifest.json")
    ]
    assert committed and max(committed) < min(int(s) for s in refused), (committed, out)
