"""The stage processes of a local run before they start: what each one is (`StageProc`),
its stage document, loopback ports and link credentials, and the environment it runs in.

`build_stages` is what the operator does when it builds a job's pods, for processes: the
same stage documents (`stage_config.build_pipeline_configs`) and link certificates
(`linkcerts`, handed to each process in its environment, never written to disk).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relaytrain_contract import LINK_CA_ENV, LINK_CERT_ENV, LINK_KEY_ENV

from relaytrain_operator.cli.local_run.layout import Layout
from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_operator.domain.stage_config import StageEndpoints, build_pipeline_configs
from relaytrain_operator.spec import FineTuneJob


@dataclass
class StageProc:
    """One supervised stage process."""

    index: int
    config_path: Path
    log_path: Path
    pipeline: int = 0
    name: str = ""
    """How messages name it: `stage K`, or `stage pP/sK` with several pipelines."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    failed_at: datetime | None = None
    """When its last failure was counted, while its successor waits out the back-off."""
    link_env: dict[str, str] = field(default_factory=dict)
    """This stage's link certificate, key and the job's CA, by env var name."""


def stage_procs(workdir: Path, layout: Layout, link_envs: list[dict[str, str]]) -> list[StageProc]:
    """One StageProc a stage, pipeline after pipeline, with its files under
    `workdir/stages`: `stage-K.{json,log}`, or `pP-stage-K.{json,log}` with several
    pipelines."""
    stages_dir = workdir / "stages"
    several = len(layout.splits) > 1
    places = [(p, k) for p, split in enumerate(layout.splits) for k in range(len(split))]
    stages = []
    for (p, k), env in zip(places, link_envs, strict=True):
        base = f"p{p}-stage-{k}" if several else f"stage-{k}"
        stages.append(
            StageProc(
                k,
                stages_dir / f"{base}.json",
                stages_dir / f"{base}.log",
                pipeline=p,
                name=f"stage p{p}/s{k}" if several else f"stage {k}",
                link_env=env,
            )
        )
    return stages


def build_stages(
    job: FineTuneJob, layout: Layout
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every stage's document and link environment, pipeline after pipeline: free loopback
    ports, the operator's stage documents, and link credentials from a fresh CA (nothing is
    written)."""
    counts = [len(split) for split in layout.splits]
    # Free ports, three a stage (any fixed port may be taken): its pipeline listener,
    # /metrics, and its listener for the stages of lower pipelines.
    ports = iter(free_ports(3 * sum(counts)))
    endpoints = []
    for p, count in enumerate(counts):
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
    configs = build_pipeline_configs(job, layout.splits, endpoints, layout.shares)
    meta = job.metadata
    pki = mint_link_credentials(meta.namespace, meta.name, counts, now=datetime.now(UTC))
    link_envs = []
    for p, count in enumerate(counts):
        for k in range(count):
            cert, key, ca = stage_pem(pki, p, k)
            link_envs.append({LINK_CERT_ENV: cert, LINK_KEY_ENV: key, LINK_CA_ENV: ca})
    documents = [doc for pipeline_docs in configs for doc in pipeline_docs]
    return documents, link_envs


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


def stage_env(count: int) -> dict[str, str]:
    """The environment `count` stage processes start in (before each one's link env)."""
    env = dict(os.environ)
    # The stages share this machine's cores: without a cap each one starts a thread per
    # core and they spin against each other (several times slower on a small machine).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    spec = importlib.util.find_spec("relaytrain_worker")
    if spec is not None and spec.submodule_search_locations:
        root = str(Path(next(iter(spec.submodule_search_locations))).parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
