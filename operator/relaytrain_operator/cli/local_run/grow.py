"""A pipeline added to a running local run (SIGUSR2 while no pipeline is out), as the
operator adds one on GPUs that join: what it is before it starts (`add_pipeline`; for a run
of one pipeline, `grow_one`).

The added pipeline is split as the run's last one, every share is planned again
(`layout.grown_layout`), and its stages get documents that list every pipeline, fresh
loopback ports and certificates from the run's CA. The stages already training learn of it
from names.FLEET_FILE in the job's store (`stage_config.fleet_document`: every pipeline added
so far), link to its stages that share their layers, and admit it at a step boundary with
the state of a pipeline training (docs/worker.md, "A pipeline added to a running job").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relaytrain_operator.cli.local_run.layout import Layout, grown_layout
from relaytrain_operator.cli.local_run.stages import local_choices, loopback_endpoints
from relaytrain_operator.domain.linkcerts import LinkCA
from relaytrain_operator.domain.stage_config import (
    StageEndpoints,
    build_pipeline_configs,
    fleet_document,
)
from relaytrain_operator.spec import FineTuneJob


@dataclass
class Added:
    """One pipeline added to a run, before its stages start."""

    pipeline: int
    layout: Layout
    """The run's layout with it."""
    endpoints: list[StageEndpoints]
    """Where its stages listen."""
    documents: list[dict[str, Any]]
    """Its stages' documents (every pipeline listed)."""
    credentials: dict[str, str]
    """Its stages' certificates and keys, from the run's CA (link Secret file names)."""
    fleet: dict[str, Any]
    """names.FLEET_FILE: every pipeline added to the run so far, this one included."""


def add_pipeline(
    job: FineTuneJob,
    layout: Layout,
    endpoints: list[list[StageEndpoints]],
    ca: LinkCA,
    added_before: list[int],
) -> Added:
    """Pipeline `len(layout.splits)` of a run laid out as `layout` whose stages listen at
    `endpoints` and which added `added_before` already. ValueError saying why when the step
    has no micro-batch for one more."""
    grown = grown_layout(layout, job.spec.training.micro_batches)
    q = len(layout.splits)
    mine = loopback_endpoints([len(grown.splits[q])], first=q)[0]
    every = [*endpoints, mine]
    documents = build_pipeline_configs(
        job, grown.splits, every, grown.shares, **local_choices(job)
    )[q]
    credentials = {name: pem for k in range(len(mine)) for name, pem in ca.issue(q, k).items()}
    fleet = fleet_document(job, grown.splits, every, added=[*added_before, q],
                           shares=grown.shares)  # fmt: skip
    return Added(q, grown, mine, documents, credentials, fleet)


@dataclass
class Regrown:
    """A run of one pipeline grown to two (`grow_one`), before its stages start again."""

    layout: Layout
    endpoints: list[list[StageEndpoints]]
    documents: list[dict[str, Any]]
    """Every stage's document, pipeline after pipeline (both pipelines listed in each)."""
    credentials: dict[str, str]
    """Pipeline 1's stages' certificates and keys, from the run's CA."""
    fleet: dict[str, Any]
    """names.FLEET_FILE: pipeline 1, added."""


def grow_one(
    job: FineTuneJob, layout: Layout, endpoints: list[list[StageEndpoints]], ca: LinkCA
) -> Regrown:
    """A run of one pipeline laid out as `layout`, grown by pipeline 1 (split as the first):
    its stages' documents have no replicas section to grow by, so every stage starts again
    from documents that list both pipelines and restores the last commit, as a job of one
    pipeline grows under the operator (its loop/decide/grow.py, `grow_one`). ValueError
    saying why when the step has no micro-batch for a second pipeline."""
    grown = grown_layout(layout, job.spec.training.micro_batches)
    mine = loopback_endpoints([len(grown.splits[1])], first=1)[0]
    every = [*endpoints, mine]
    rows = build_pipeline_configs(job, grown.splits, every, grown.shares, **local_choices(job))
    credentials = {name: pem for k in range(len(mine)) for name, pem in ca.issue(1, k).items()}
    fleet = fleet_document(job, grown.splits, every, added=[1], shares=grown.shares)
    return Regrown(grown, every, [d for row in rows for d in row], credentials, fleet)
