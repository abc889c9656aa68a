"""Loading a stage: what it reads once, before it links (`load_stage`).

In this order, so that the cheapest refusal comes first: the device it computes on
(`device.stage_device`: DeviceError when it was told `cuda` and sees none), its link
credentials (AuthError before any model is read), its checkpoint store, the model's files
(`s3://` models: the shards this stage needs), its slice of the model with the training
method applied (moved to the device), and on stage 0 (on every stage with `epochs` or
`endOfData: stop`) the training data and the held-out micro-batches.
Everything else a stage holds is built from these without I/O (`stage.StageRuntime`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaytrain_contract import StageConfig, TrainingSpec
from torch import nn

from relaytrain_worker.model.methods import lora_config, setup_method
from relaytrain_worker.model.model_slice import SliceSpec, StageModel, build_stage_model
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.device import describe, stage_device
from relaytrain_worker.pipeline.evaluation import load_eval_batches
from relaytrain_worker.pipeline.linkauth import AuthError
from relaytrain_worker.state.data import MicroBatch, StepData, load_step_data
from relaytrain_worker.state.modelfiles import resolve_model_dir
from relaytrain_worker.state.store import Store, open_job_store

log = logging.getLogger("relaytrain.stage")


def link_credentials(cfg: StageConfig) -> LinkCredentials:
    """This stage's link credentials from the folder its config names (`credentialsDir`),
    which it re-reads before each new link (renewed certificates need no restart), and the
    plan it is of (`job.planEpoch`), which its links check.

    AuthError, before any model is loaded, when they are missing, do not load, expired, or
    name another stage than the config says (a Secret wired to the wrong pod).
    """
    links = cfg.links
    tls = LinkCredentials.from_folder(links.credentials_dir)
    if tls.identity != links.identity:
        raise AuthError(
            f"the link certificate in {links.credentials_dir} is {tls.identity}, but this "
            f"stage is {links.identity}"
        )
    tls.check_valid()
    tls.plan = cfg.job.plan_epoch
    return tls


@dataclass
class Loaded:
    """What a stage read before it links."""

    tls: LinkCredentials
    """This stage's link certificate, key and the CAs it trusts (re-read for new links)."""
    store: Store
    """The job's checkpoint store."""
    model_dir: Path
    """A local directory with the model's config, tokenizer and this stage's shards."""
    stage: StageModel
    """This stage's slice of the model."""
    trainable: list[tuple[str, nn.Parameter]]
    """The parameters the method trains, by global name, in the optimizer's order."""
    data: StepData | None
    """The training data (stage 0; every stage with `epochs`, to count the steps)."""
    eval_batches: list[MicroBatch] | None
    """The held-out micro-batches (every stage 0 with `dataset.validation`)."""
    training: TrainingSpec
    """The training settings with `steps` resolved (from `epochs` when that is given)."""

    @property
    def total_steps(self) -> int:
        assert self.training.steps is not None  # resolved by `load_stage`
        return self.training.steps


def job_prefix(cfg: StageConfig) -> str:
    """The job's prefix in its store (`<namespace>/<name>`)."""
    return f"{cfg.job.namespace}/{cfg.job.name}"


def opener(cfg: StageConfig) -> Callable[[str], Store]:
    """Opens a store of this job by URI, with the job's store settings."""
    return lambda uri: open_job_store(uri, cfg.checkpoint)


def load_stage(cfg: StageConfig) -> Loaded:
    """Read what this stage needs before it links. DeviceError (no GPU where one was asked
    for), AuthError (credentials), ModelLoadError (the model's files) or DataError (the
    dataset) name what cannot be used. The slice ends on the stage's device."""
    device = stage_device()
    tls = link_credentials(cfg)
    open_store = opener(cfg)
    store = open_store(cfg.checkpoint.uri)
    model_dir = resolve_model_dir(cfg, open_store)
    spec = SliceSpec(
        cfg.stage.layer_start, cfg.stage.layer_end, cfg.stage.is_first, cfg.stage.is_last
    )
    stage = build_stage_model(model_dir, spec, cfg.model.dtype)
    method = cfg.method
    lora = (
        None
        if method.type == "full"
        else lora_config(method.rank, method.alpha, method.dropout, method.target_modules)
    )
    trainable = setup_method(stage, method.type, lora, cfg.training.seed, device)
    log.info("Stage %d computes on %s", cfg.stage.index, describe(device))
    # With `epochs`, or a run that stops at the end of the data, every stage reads the
    # dataset to derive the same step count.
    stop = cfg.training.end_of_data == "stop"
    need_data = cfg.stage.is_first or cfg.training.steps is None or stop
    data = _load_data(cfg, model_dir, stage, open_store) if need_data else None
    eval_batches = (
        _load_data(cfg, model_dir, stage, open_store, load_eval_batches)
        if cfg.stage.is_first and cfg.dataset.validation is not None
        else None
    )
    steps = cfg.training.steps
    if steps is None:
        assert data is not None and cfg.training.epochs is not None
        steps = data.steps_for_epochs(cfg.training.epochs)
    elif stop and data is not None and data.steps_for_epochs(1) < steps:
        log.info("The data runs out after %d of training.steps %d (one pass over its %d rows): "
                 "the run stops there (training.endOfData: stop)", data.steps_for_epochs(1),
                 steps, data.rows.input_ids.shape[0])  # fmt: skip
        steps = data.steps_for_epochs(1)
    training = cfg.training.model_copy(update={"steps": steps, "epochs": None})
    return Loaded(tls, store, model_dir, stage, trainable, data, eval_batches, training)


def _load_data(
    cfg: StageConfig,
    model_dir: Path,
    stage: StageModel,
    open_store: Callable[[str], Store],
    held_out: Any = None,
) -> Any:
    """The training data, or with `held_out` (evaluation.load_eval_batches) that."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    t = cfg.training
    max_pos = getattr(stage.config, "max_position_embeddings", None)
    if held_out is not None:
        return held_out(
            cfg.dataset, tokenizer, max_positions=max_pos,
            micro_batch_size=t.micro_batch_size, seed=t.seed, opener=open_store,
        )  # fmt: skip
    return load_step_data(
        cfg.dataset,
        tokenizer,
        max_positions=max_pos,
        micro_batch_size=t.micro_batch_size,
        micro_batches=t.micro_batches,
        seed=t.seed,
        opener=open_store,
    )
