"""Link credentials for tests and benchmarks: minted as the operator mints them, loaded as
a stage loads them (the two packages never import each other; tests may use both)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.transport import Link, connect, listen


def stage_credentials(
    count: int,
    *,
    namespace: str = "test",
    job: str = "pipeline",
    now: datetime | None = None,
) -> list[LinkCredentials]:
    """Credentials of stages 0..count-1 of pipeline 0 of a job, under a fresh CA."""
    files = mint_link_credentials(namespace, job, [count], now=now or datetime.now(UTC))
    return [LinkCredentials(*stage_pem(files, 0, k)) for k in range(count)]


def pipeline_credentials(
    stages: list[int], *, namespace: str = "test", job: str = "replicas"
) -> list[list[LinkCredentials]]:
    """Credentials of every stage of every pipeline (`stages[p]`: pipeline p's stage count)
    of a job, under one fresh CA: [pipeline][stage]."""
    files = mint_link_credentials(namespace, job, stages, now=datetime.now(UTC))
    return [
        [LinkCredentials(*stage_pem(files, p, k)) for k in range(n)] for p, n in enumerate(stages)
    ]


def link_pair(credentials: list[LinkCredentials], job: str) -> tuple[Link, Link]:
    """A fresh loopback connection between stages 0 and 1 of pipeline 0 of `job` (whose
    `credentials` are `stage_credentials(2, job=job)`): (stage 0's link down, stage 1's up)."""
    s0, s1 = (f"relaytrain://test/{job}/p0/s{k}" for k in range(2))
    lst = listen("127.0.0.1:0", credentials=credentials[1], expect=s0)
    got: dict[str, Link] = {}
    t = threading.Thread(target=lambda: got.setdefault("down", lst.accept(timeout=10)))
    t.start()
    up = connect(f"127.0.0.1:{lst.address[1]}", credentials=credentials[0], expect=s1, retry_for=5)
    t.join(10)
    lst.close()
    return up, got["down"]


@contextmanager
def linked(job: str) -> Iterator[tuple[Link, Link]]:
    """A `link_pair` of a job of its own (`stage_credentials`), both ends closed after."""
    up, down = link_pair(stage_credentials(2, job=job), job)
    try:
        yield up, down
    finally:
        up.close()
        down.close()
