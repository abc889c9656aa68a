"""Jobs for `relaytrain run --local` tests: a workspace with a tiny model and data, jobs on
it (built with relaytrain_testkit.jobs), the run as a child process, and waits on what the
run leaves observable (its state.json, progress.json, the stage processes in /proc).

Tiny random Llama models (no downloads); every stage a real `python -m relaytrain_worker`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from relaytrain_contract.prefork import SERVER_MODULE, SOCKET_ENV, PreforkServer

from relaytrain_testkit import REPO
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.tiny_models import CORPUS, tiny_model_dir

NAMESPACE = "default"


def make_workspace(root: Path, *, layers: int, records: int) -> Path:
    """`root/model` (a tiny Llama of `layers` layers) and `root/data.jsonl` (`records`
    prompt-completion pairs); returns `root`."""
    tiny_model_dir(root / "model", layers=layers)
    with (root / "data.jsonl").open("w") as f:
        for i in range(records):
            record = {"prompt": f"q{i}: {CORPUS[i % 5][:12]}", "completion": CORPUS[(i + 1) % 5]}
            f.write(json.dumps(record) + "\n")
    return root


def local_job(root: Path, name: str) -> Job:
    """A FineTuneJob `name` on the workspace at `root`: two stages, no link compression, a
    LoRA of rank 2 on q_proj, 16-token sequences, 4 steps of 2 micro-batches of 1, up to 2
    restarts without back-off, no checkpoint section (run --local's default store)."""
    return (
        Job(name)
        .model(str(root / "model"), dtype="float32")
        .dataset(str(root / "data.jsonl"), format="prompt-completion", sequence_length=16)
        .method("lora", rank=2, alpha=4, target_modules=["q_proj"])
        .training(steps=4, micro_batch_size=1, micro_batches=2)
        .pipeline(stages=2, compression="none")
        .failure_policy(max_stage_restarts=2, backoff_seconds=0)
        .unset("spec.checkpoint")
    )


def fleet(root: Path, name: str, *, replicas: int, steps: int, every: int) -> Job:
    """The several-pipeline tests' and benchmarks' job on the workspace at `root`:
    `replicas` pipelines of two stages, LoRA r4 on q/v, 3 micro-batches of 2 x 24 tokens per
    step, a checkpoint every `every` steps under `root/ckpt`."""
    return (
        local_job(root, name)
        .dataset(sequence_length=24)
        .method(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
        .training(steps=steps, micro_batch_size=2, micro_batches=3, learning_rate=0.01,
                  warmup_steps=1)
        .pipeline(replicas=replicas)
        .checkpoint(str(root / "ckpt"), every_steps=every, keep=2)
    )  # fmt: skip


def fleet_job(root: Path, name: str, *, replicas: int, steps: int, every: int) -> Path:
    """`fleet(...)` written to `root/<name>.yaml`; returns the path."""
    return fleet(root, name, replicas=replicas, steps=steps, every=every).write(root)


def write_job(root: Path, manifest: dict[str, Any]) -> Path:
    """`manifest` as `root/<name>.yaml`; returns the path."""
    return Job.of(manifest).write(root)


def run_env() -> dict[str, str]:
    """This environment, with the repository's packages importable (first on the path;
    what the environment's own PYTHONPATH adds stays after them: the GPU host's packages)."""
    env = dict(os.environ)
    paths = [str(REPO / "operator"), str(REPO / "worker_image"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


@contextlib.contextmanager
def shared_prefork(folder: Path) -> Iterator[PreforkServer]:
    """A prefork server for every run a test session starts (in the environment a run's
    stages get from `run_env()`, its output in `folder/prefork.log`; it dies with this
    process): while it runs, SOCKET_ENV names it in this process's environment, which
    `start_run` passes on, and each run forks its stages from it instead of starting a server
    and importing torch, transformers and peft again (about 7 s of a core each here). A run
    it cannot serve (one in a network namespace of its own, a QLoRA job) starts its own
    server, as a run without it does."""
    from relaytrain_operator.cli.local_run.stages import die_with_supervisor, stage_env

    env = stage_env(1, run_env())  # a run's stages', whose PYTHONPATH attach compares
    with (folder / "prefork.log").open("ab") as log:
        server = PreforkServer.start(env, die_with_supervisor(os.getpid()), log, qlora=False)
    os.environ[SOCKET_ENV] = str(server.socket_path)
    try:
        yield server
    finally:
        os.environ.pop(SOCKET_ENV, None)
        server.stop()


def start_run(
    job: Path,
    workdir: Path | None,
    cwd: Path | None = None,
    *,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """`relaytrain run JOB --local --no-progress [--workdir WORKDIR] [FLAGS...]`, output
    piped; `env` is added to `run_env()`; `wrap` goes before the command (one that execs
    it, so the process is the run's: `own_network`)."""
    cmd = [*wrap, sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
           "--no-progress"]  # fmt: skip
    if workdir is not None:
        cmd += ["--workdir", str(workdir)]
    cmd += list(flags)
    proc = subprocess.Popen(
        cmd,
        env={**run_env(), **(env or {})},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc


OWN_NETWORK = ("unshare", "--user", "--map-root-user", "--net", "sh", "-c",
               'ip link set lo up && exec "$@"', "sh")  # fmt: skip
"""A `wrap` for `start_run`: the run in a network namespace of its own (loopback only), so
a test can cut its links with iptables (`in_network`) without touching the machine's."""


def in_network(pid: int, *command: str) -> subprocess.CompletedProcess[str]:
    """Run `command` (e.g. iptables) in the network namespace of process `pid`; raises
    CalledProcessError with its output when it fails."""
    return subprocess.run(["nsenter", "--target", str(pid), "--net", *command],
                          check=True, capture_output=True, text=True)  # fmt: skip


def pin_pipelines(state: dict[str, Any] | None) -> None:
    """Pin each pipeline's stage processes of a run (its state.json, `run_state`) to a core
    of their own, pipeline p on core p mod the cores there are, every thread of each: a
    pipeline stands for its own GPUs in the benchmarks. Call it while the run goes on, so
    replacements are pinned too."""
    cores = sorted(os.sched_getaffinity(0))
    for stage in (state or {}).get("stages", []):
        if stage["pid"] is None:
            continue
        core = {cores[stage["pipeline"] % len(cores)]}
        with contextlib.suppress(OSError):  # exited meanwhile
            for task in Path(f"/proc/{stage['pid']}/task").iterdir():
                if os.sched_getaffinity(int(task.name)) != core:
                    os.sched_setaffinity(int(task.name), core)


def wait_while_running(
    what: str,
    probe: Callable[[], Any],
    proc: subprocess.Popen[str],
    timeout: float = 300,
    interval: float = 0.2,
) -> Any:
    """Calls `probe` until it returns something truthy and returns that; fails (with the
    run's output) when the run ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}: {proc.communicate()[0]}")
        time.sleep(interval)
    stacks = stage_stacks(proc.pid)
    proc.kill()
    pytest.fail(
        f"timed out after {timeout:.0f}s waiting for {what}: {proc.communicate()[0]}\n{stacks}"
    )


def _children(pid: int) -> list[int]:
    """PIDs of the live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and alive(int(entry.name)):
                found.append(int(entry.name))
    return sorted(found)


def _run_workdir(supervisor: int) -> Path | None:
    """The working folder a live run's command line names (`--workdir DIR`, as `start_run`
    writes it, against the process's working directory), or None."""
    try:
        args = [
            os.fsdecode(a) for a in Path(f"/proc/{supervisor}/cmdline").read_bytes().split(b"\0")
        ]
        cwd = Path(os.readlink(f"/proc/{supervisor}/cwd"))
    except OSError:  # gone
        return None
    return next((cwd / value for flag, value in pairwise(args) if flag == "--workdir"), None)


def _stage_processes(supervisor: int) -> list[int]:
    """The run's stage processes: the supervisor's children, and those of its prefork
    server (relaytrain_contract/prefork.py) in its place; for a run with a `--workdir`,
    those of that folder too (forked by a server the session shares)."""
    found = set()
    for pid in _children(supervisor):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found |= set(_children(pid)) if SERVER_MODULE.encode() in command else {pid}
    if (workdir := _run_workdir(supervisor)) is not None:
        found |= set(stages_left(workdir))
    return sorted(found)


STACK_MARK = "most recent call first"
"""What Python's faulthandler writes at the head of each thread's stack."""


def stage_stacks(supervisor: int, wait: float = 10, lines: int = 80) -> str:
    """Every thread's stack in each stage process of the run `supervisor`: SIGUSR1 makes a
    stage write them to its log (relaytrain_worker's faulthandler); returns each log's last
    `lines` once the dump is there, so that a test timing out on a hung run says where every
    stage waits."""
    logs: dict[int, Path] = {}
    for pid in _stage_processes(supervisor):
        with contextlib.suppress(OSError):
            logs[pid] = Path(os.readlink(f"/proc/{pid}/fd/2"))
    before = {pid: _read(path).count(STACK_MARK) for pid, path in logs.items()}
    for pid in logs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(
        _read(path).count(STACK_MARK) <= before[pid] and alive(pid) for pid, path in logs.items()
    ):
        time.sleep(0.1)
    return "\n".join(
        f"--- stage process {pid} ({path.name}), last {lines} lines ---\n"
        + "\n".join(_read(path).splitlines()[-lines:])
        for pid, path in logs.items()
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def read_json(path: Path) -> Any:
    """The JSON at `path`, or None while it does not exist (or is being replaced)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_state(workdir: Path) -> dict[str, Any] | None:
    """The supervisor's state.json: its PID and each stage's PIDs and restarts."""
    state = read_json(workdir / "state.json")
    return state if isinstance(state, dict) else None


def started_pids(workdir: Path) -> list[int] | None:
    """The PID of each stage's current process once every stage has one (else None)."""
    state = run_state(workdir)
    pids = [s["pid"] for s in state["stages"]] if state else []
    return pids if pids and None not in pids else None


def progress(ckpt: Path, name: str) -> dict[str, Any] | None:
    """The job's progress.json under the checkpoint directory `ckpt`."""
    record = read_json(ckpt / NAMESPACE / name / "progress.json")
    return record if isinstance(record, dict) else None


def stage_processes(workdir: Path) -> list[tuple[int, str]]:
    """Every live process (PID, command line) running one of `workdir`'s stage documents:
    one started with it on its command line, or one forked by the run's prefork server
    (whose command line is the server's) writing to a stage's log.

    A zombie (dead, not yet reaped) has no command line and is not listed.
    """
    stages = str(workdir.resolve() / "stages") + os.sep
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            forked = SERVER_MODULE.encode() in args and os.readlink(entry / "fd" / "1")
        except OSError:  # gone meanwhile
            continue
        named = [a.decode(errors="replace") for a in args] + [forked or ""]
        if any(a.startswith(stages) for a in named):
            found.append((int(entry.name), b" ".join(args).decode(errors="replace")))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stages_left(workdir: Path) -> list[int]:
    """PIDs of `workdir`'s stage processes still running: those /proc shows running a stage
    document, and those of state.json (every process the supervisor started) not yet dead.
    """
    state = run_state(workdir) or {"stages": []}
    started = {pid for stage in state["stages"] for pid in stage["pids"]}
    return sorted({pid for pid, _ in stage_processes(workdir)} | set(filter(alive, started)))


def wait_until_no_stage_is_left(workdir: Path, timeout: float = 30) -> None:
    """Waits until `stages_left` is empty; fails naming those still there after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while (left := stages_left(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"stage processes still running after {timeout:.0f}s: {left}"
