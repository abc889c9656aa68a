"""A stage process put together (`load_runtime`): what it reads before it links
(`pipeline.loading.load_stage`), how it takes part in the job — alone, or as one stage of
several pipelines (`replicas.membership.Replicated`) — and its runtime over both.
`__main__` runs it."""

from __future__ import annotations

from relaytrain_contract import StageConfig

from relaytrain_worker.pipeline.loading import load_stage
from relaytrain_worker.pipeline.replication import Alone, Replication
from relaytrain_worker.pipeline.stage import StageRuntime
from relaytrain_worker.replicas.membership import Replicated


def load_runtime(cfg: StageConfig) -> StageRuntime:
    """Load the stage `cfg` describes and build its runtime (which then does no I/O until
    `run`). AuthError, ModelLoadError or DataError as loading raises them."""
    loaded = load_stage(cfg)
    replication: Replication = (
        Alone(cfg) if cfg.replicas is None else Replicated(cfg, loaded.tls, loaded.store)
    )
    return StageRuntime(cfg, loaded, replication)
