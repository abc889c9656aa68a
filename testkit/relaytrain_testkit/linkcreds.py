"""Link credentials for tests and benchmarks: minted as the operator mints them, loaded as
a stage loads them (the two packages never import each other; tests may use both)."""

from __future__ import annotations

from datetime import UTC, datetime

from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_worker.pipeline.credentials import LinkCredentials


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
