"""The stage processes of a local run before they start: what each one is (`StageProc`),
its stage document, loopback ports and link credentials, and the environment it runs in.

`build_stages` is what the operator does when it builds a job's pods, for processes: the
same stage documents (`stage_config.build_pipeline_configs`) and link certificates
(`linkcerts`). `write_link_folder` writes a stage's credentials where its document's
`links.credentialsDir` points, as the operator's Secret volume does in a pod: into a
private folder (`private_folder`: in memory where the OS offers one, removed when the run
ends), never into the run's directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from relaytrain_contract import DEVICE_ENV, LINK_CA_FILE, LINK_CERT_FILE, LINK_KEY_FILE
from relaytrain_contract.prefork import ForkedProcess

from relaytrain_operator.cli.local_run.layout import Layout
from relaytrain_operator.domain.linkcerts import LinkCA, StagePem, mint_link_authority
from relaytrain_operator.domain.planner import AUTO, AUTO_ORDER
from relaytrain_operator.domain.stage_config import StageEndpoints, build_pipeline_configs
from relaytrain_operator.spec import FineTuneJob

DATA_LINK = "..data"
"""The link in a stage's credentials folder to the set of files it shows now."""


@dataclass
class StageProc:
    """One supervised stage process."""

    index: int
    config_path: Path
    log_path: Path
    pipeline: int = 0
    name: str = ""
    """How messages name it: `stage K`, or `stage pP/sK` with several pipelines."""
    proc: subprocess.Popen[bytes] | ForkedProcess | None = None
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    failed_at: datetime | None = None
    """When its last failure was counted, while its successor waits out the back-off."""
    link_dir: Path | None = None
    """The private folder holding its link certificate, key and the run's CA (`tls.crt`,
    `tls.key`, `ca.crt`), its document's `links.credentialsDir`; None until the run writes
    them (`LocalRun.write_stage_files`) and again once it removed them."""
    gpu: str | None = None
    """The GPU it computes on (`CUDA_VISIBLE_DEVICES` of its process), None: the run's own."""

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` (the run's `stage_env`) with this stage's GPU, when it has one."""
        return base if self.gpu is None else {**base, "CUDA_VISIBLE_DEVICES": self.gpu}


def stage_procs(
    workdir: Path, layout: Layout, gpus: Sequence[str] | None = None
) -> list[StageProc]:
    """One StageProc a stage, pipeline after pipeline, with its files under
    `workdir/stages`: `stage-K.{json,log}`, or `pP-stage-K.{json,log}` with several
    pipelines; the n-th on GPU ``gpus[n mod len(gpus)]`` (default: `local_gpus()`), as a
    cluster gives each stage pod a GPU of its own."""
    stages_dir = workdir / "stages"
    several = len(layout.splits) > 1
    places = [(p, k) for p, split in enumerate(layout.splits) for k in range(len(split))]
    gpus = local_gpus() if gpus is None else gpus
    stages = []
    for n, (p, k) in enumerate(places):
        base = f"p{p}-stage-{k}" if several else f"stage-{k}"
        stages.append(
            StageProc(
                k,
                stages_dir / f"{base}.json",
                stages_dir / f"{base}.log",
                pipeline=p,
                name=f"stage p{p}/s{k}" if several else f"stage {k}",
                gpu=gpus[n % len(gpus)] if gpus else None,
            )
        )
    return stages


def local_gpus(
    environ: dict[str, str] | None = None, listing: Callable[[], str | None] | None = None
) -> list[str]:
    """The GPUs this machine offers the run's stages, as `CUDA_VISIBLE_DEVICES` names them:
    those it lists (up to the first invalid entry, as CUDA reads it), else each GPU of
    `nvidia-smi -L` (`listing`) by its UUID (CUDA numbers GPUs fastest first unless told
    otherwise, nvidia-smi by PCI bus: a UUID is the same GPU to both); none when the stages
    are told to use the CPU (`RELAYTRAIN_DEVICE=cpu`) or nothing lists a GPU."""
    env = os.environ if environ is None else environ
    if env.get(DEVICE_ENV, "").strip().lower() == "cpu":
        return []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for entry in (e.strip() for e in visible.split(",")):
            if not entry or entry.startswith("-"):
                break
            ids.append(entry)
        return ids
    text = (listing or _nvidia_smi)()
    gpus = []
    for line in (text or "").splitlines():
        if line.startswith("GPU "):
            uuid = re.search(r"\(UUID: ([^)\s]+)\)", line)
            gpus.append(uuid.group(1) if uuid else line[4:].split(":", 1)[0].strip())
    return gpus


def _nvidia_smi() -> str | None:
    """`nvidia-smi -L`'s output, or None where it is missing or fails (no driver)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass
class Built:
    """A local run's stages before they start (`build_stages`)."""

    documents: list[dict[str, Any]]
    """Every stage's document, pipeline after pipeline."""
    credentials: dict[str, str]
    """The run's link credentials, as the files of the operator's link Secret."""
    endpoints: list[list[StageEndpoints]]
    """Where each stage of each pipeline listens."""
    ca: LinkCA
    """The run's link CA, kept in memory to add a pipeline (`grow.add_pipeline`)."""


def build_stages(job: FineTuneJob, layout: Layout) -> Built:
    """Every stage's document (free loopback ports, the operator's stage documents), and
    the run's link credentials from a fresh CA (`linkcerts.stage_pem` gives each stage its
    share; nothing is written)."""
    counts = [len(split) for split in layout.splits]
    endpoints = loopback_endpoints(counts)
    configs = build_pipeline_configs(
        job, layout.splits, endpoints, layout.shares, **local_choices(job)
    )
    meta = job.metadata
    lifetime = timedelta(seconds=job.spec.link_certificates.lifetime_seconds)
    pki, ca = mint_link_authority(
        meta.namespace, meta.name, counts, now=datetime.now(UTC), lifetime=lifetime
    )
    documents = [doc for pipeline_docs in configs for doc in pipeline_docs]
    return Built(documents, pki, endpoints, ca)


def local_choices(job: FineTuneJob) -> dict[str, Any]:
    """What the documents take where the spec says `auto` (`build_pipeline_configs`'s
    `compression` and `forwards_ahead`; None: the spec's). Local links are loopback: every
    code is as fast, so the exact one, and no round trip is there to hide, so none ahead."""
    pipeline = job.spec.pipeline
    return {
        "compression": AUTO_ORDER[0] if pipeline.compression == AUTO else None,
        "forwards_ahead": 0 if pipeline.forwards_ahead == AUTO else None,
    }


def loopback_endpoints(counts: list[int], first: int = 0) -> list[list[StageEndpoints]]:
    """Free loopback ports for pipelines `first`, `first` + 1, ... of `counts[i]` stages,
    three a stage (any fixed port may be taken): its pipeline listener, /metrics, and its
    listener for the stages of lower pipelines (none on pipeline 0)."""
    ports = iter(free_ports(3 * sum(counts)))
    endpoints = []
    for p, count in enumerate(counts, start=first):
        listen = [f"127.0.0.1:{next(ports)}" for _ in range(count)]
        replica = [f"127.0.0.1:{next(ports)}" if p > 0 else None for _ in range(count)]
        endpoints.append(
            [
                StageEndpoints(
                    listen=None if k == 0 else listen[k],
                    next=None if k == count - 1 else listen[k + 1],
                    metrics_port=next(ports),
                    replica_listen=replica[k],
                    replica_address=replica[k],
                )
                for k in range(count)
            ]
        )
    return endpoints


def private_folder() -> Path:
    """A new folder only this user can enter (mode 0700) for a run's link credentials: in
    /dev/shm where there is one (memory, so no private key reaches a disk), else in the
    temporary directory. The run removes it when it ends."""
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None
    return Path(tempfile.mkdtemp(prefix="relaytrain-link-", dir=parent))


def write_link_folder(folder: Path, pem: StagePem) -> None:
    """Show one stage's credentials in `folder` (made 0700 when new) under the names a stage
    reads, the way a kubelet updates a mounted Secret, so that a renewal is read whole: the
    files (each created 0600) go to a new hidden folder, a `..data` link is swapped to it in
    one rename (a stage resolves `..data` once and reads one set, old or new), the names are
    links through `..data`, and the set before is removed."""
    folder.mkdir(mode=0o700, exist_ok=True)
    data = folder / DATA_LINK
    old = os.readlink(data) if data.is_symlink() else None
    new = Path(tempfile.mkdtemp(prefix="..", dir=folder))
    files = {LINK_CERT_FILE: pem.cert, LINK_KEY_FILE: pem.key, LINK_CA_FILE: pem.ca}
    for name, text in files.items():
        fd = os.open(new / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w") as f:
            f.write(text)
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"{DATA_LINK}/{name}")
    swap = folder / f"{DATA_LINK}_tmp"
    swap.unlink(missing_ok=True)
    swap.symlink_to(new.name)
    os.replace(swap, data)
    if old is not None:
        shutil.rmtree(folder / old, ignore_errors=True)


def free_ports(n: int) -> list[int]:
    """`n` loopback ports free right now (bound at once, so all different)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def stage_env(count: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment `count` stage processes of a supervisor whose own is `environ` start
    in."""
    env = dict(environ)
    # The stages share this machine's cores: without a cap each one starts a thread per
    # core and they spin against each other (several times slower on a small machine).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    spec = importlib.util.find_spec("relaytrain_worker")
    if spec is not None and spec.submodule_search_locations:
        root = str(Path(next(iter(spec.submodule_search_locations))).parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def last_line(log_path: Path) -> str:
    """The last line a stage wrote (its one line on why it stopped), or where its log is."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line]
    except OSError:
        lines = []
    return lines[-1] if lines else f"see {log_path}"


def end_stages(live: Sequence[subprocess.Popen[bytes] | ForkedProcess], grace: float) -> None:
    """SIGTERM to each of the `live` stages' process groups, SIGKILL to what is left after
    `grace` seconds; each reaped."""
    live = [proc for proc in live if proc.poll() is None]  # an ended one's group may be gone
    for proc in live:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    stuck = []
    for proc in live:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stuck.append(proc)
    for proc in stuck:  # ignored SIGTERM for the whole grace period
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def signal_group(pgid: int, sig: int) -> None:
    """Signal a stage's process group; one that is gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


PREFORK_ENV = "RELAYTRAIN_PREFORK"
"""`0`: each stage starts as a program of its own (`python -m relaytrain_worker`), importing
the worker itself, instead of being forked from the prefork server."""


def forks_stages(environ: Mapping[str, str], method: str, stages: Sequence[StageProc]) -> bool:
    """Whether a run's stages are forked from the prefork server: not with
    `RELAYTRAIN_PREFORK=0`, nor for a QLoRA job whose stages compute on GPUs, since the
    server of a QLoRA job imports bitsandbytes (peft does), which initialises CUDA on a GPU
    host, and a process forked after that cannot use CUDA (the server refuses to serve then
    too, `relaytrain_worker.prefork`; this spares starting it)."""
    if environ.get(PREFORK_ENV, "1") == "0":
        return False
    return not (method == "qlora" and any(stage.gpu is not None for stage in stages))


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the kernel sends the caller when its parent dies (Linux)."""


def die_with_supervisor(supervisor: int) -> Callable[[], None] | None:
    """What a stage process runs between fork and exec so that it dies with `supervisor`
    (the PID of the process starting it): on Linux it asks the kernel for SIGKILL when its
    parent dies (PR_SET_PDEATHSIG, kept across exec), then checks that its parent is still
    `supervisor`; a supervisor that died before that (a restart racing the supervisor's
    death) gets the same SIGKILL from the stage itself. None elsewhere (nothing to ask for).

    The kernel's "parent" is the thread that forked: stages are started from the
    supervisor's main thread, which lives as long as the supervisor does.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cannot fail for a valid signal
        if os.getppid() != supervisor:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
