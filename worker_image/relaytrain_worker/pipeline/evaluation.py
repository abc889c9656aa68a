"""Held-out evaluation: the loss of `dataset.validation` through the pipeline, forward only.

When: with validation data, after the last step always; with `training.evalEverySteps` N
> 0 also before the first step (the base model's loss, step 0) and after every N-th step
(`due`). Every stage knows the schedule from its config, so no frame announces a pass.

How: stage 0 holds the held-out rows (`load_eval_batches`: the validation file, or the
records `records.split_records` held out of the training file, tokenized, truncated and
packed or padded exactly as training data, in file order, never shuffled) and sends them
as micro-batches of `training.microBatchSize` down the links in frames of kind `eval`
(the first carries the count). Each stage runs its slice under `torch.no_grad()` in eval
mode (no dropout, LoRA's included; each module's mode is restored after), so nothing is
kept for a backward, no optimizer or RNG state moves, and the result is deterministic.
The last stage sums the fp32 token cross-entropy in float64 over the whole set and divides
by the label tokens of the whole set: the token-weighted mean, assistant-only for `chat`
(labels are -100 elsewhere, as in training), the same number the unsplit model gives
(tests/unit/test_eval_pipeline.py). Links compress as in training, so with int8 links the
loss carries the same small error the training loss does.

With several pipelines only the writer's pipeline evaluates (pipeline 0 unless it is out):
every pipeline holds bit-identical weights, so a share per pipeline would give the same
number at the price of a new cross-pipeline reduction; the other pipelines wait for it at
the next step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from relaytrain_contract import DatasetSpec, StageConfig
from torch import nn

from relaytrain_worker.model.model_slice import device_of
from relaytrain_worker.pipeline.boundary import MODE, ROWS
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.schedule import token_loss_sum
from relaytrain_worker.pipeline.transport import Frame
from relaytrain_worker.state.data import MicroBatch, build_rows, check_length, fit, tokenize
from relaytrain_worker.state.records import IGNORE, DataError, read_jsonl, split_records

log = logging.getLogger("relaytrain.evaluation")

EVAL = "eval"
"""Frame kind of a held-out micro-batch's activations."""


def due(cfg: StageConfig, step: int, total: int) -> bool:
    """Whether the held-out loss is evaluated with `step` optimizer steps done: at 0 (before
    training) and every `evalEverySteps` when that is set, and at `total` always."""
    if cfg.dataset.validation is None:
        return False
    every = cfg.training.eval_every_steps
    return step == total or (every > 0 and step % every == 0)


def load_eval_batches(
    spec: DatasetSpec,
    tokenizer: Any,
    *,
    max_positions: int | None,
    micro_batch_size: int,
    seed: int,
    opener: Any = None,
) -> list[MicroBatch]:
    """The held-out micro-batches, in file order (stage 0). DataError names
    `dataset.validation.uri` when its file cannot be used."""
    validation = spec.validation
    if validation is None:
        raise DataError("dataset.validation is not set")
    check_length(spec, max_positions)
    if validation.fraction is not None:
        records = split_records(read_jsonl(spec.uri, opener), validation.fraction, seed)[1]
        source = spec
    else:
        assert validation.uri is not None
        try:
            records = read_jsonl(validation.uri, opener)
        except DataError as exc:
            raise DataError(str(exc).replace("dataset.uri", "dataset.validation.uri", 1)) from None
        source = spec.model_copy(update={"uri": validation.uri})
    examples = tokenize(records, tokenizer, source)
    kept, truncated, dropped = fit(examples, source)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = build_rows(kept, source, int(pad))
    n = int(rows.input_ids.shape[0])
    batches = []
    for start in range(0, n, micro_batch_size):
        part = slice(start, min(start + micro_batch_size, n))
        mask = rows.attention_mask[part]
        labels = rows.labels[part].clone()
        labels[mask == 0] = IGNORE
        batches.append(
            MicroBatch(
                rows.input_ids[part],
                mask,
                rows.position_ids[part].contiguous(),
                labels,
                torch.arange(part.start, part.stop),
            )
        )
    log.info(
        "Held out %d examples (%d truncated, %d dropped) in %d rows, %d micro-batches",
        len(examples), truncated, dropped, n, len(batches),
    )  # fmt: skip
    return batches


def evaluate(
    stage: nn.Module,
    peers: Peers,
    step: int,
    batches: list[MicroBatch] | None,
    *,
    first: bool,
    last: bool,
    compression: str = "none",
) -> float | None:
    """One forward pass over the held-out set through this stage; every stage of the
    pipeline calls it at the same step. Returns the token-mean loss on the last stage
    (None elsewhere, and when the set has no label token)."""
    modes = [(module, module.training) for module in stage.modules()]
    stage.eval()
    try:
        with torch.no_grad():
            return _pass(stage, peers, step, batches, ends=(first, last), compression=compression)
    finally:
        for module, mode in modes:
            module.training = mode


def _pass(
    stage: nn.Module,
    peers: Peers,
    step: int,
    batches: list[MicroBatch] | None,
    *,
    ends: tuple[bool, bool],
    compression: str,
) -> float | None:
    first, last = ends
    device = device_of(stage)
    loss_sum = torch.zeros((), dtype=torch.float64)
    tokens = 0
    count = len(batches) if first and batches is not None else None
    m = 0
    while count is None or m < count:
        if first:
            assert batches is not None
            mb = batches[m]
            x, mask, pos, labels = mb.input_ids, mb.attention_mask, mb.position_ids, mb.labels
            keys = mb.rows if compression == MODE else None
        else:
            assert peers.prev is not None
            frame = peers.prev.recv(EVAL, step, m)
            count = int(frame.meta["count"])
            t = frame.tensors
            x, mask, pos, labels = t["hidden"], t["attention_mask"], t["position_ids"], t["labels"]
            keys = t.get(ROWS)
        x, mask, pos, labels = x.to(device), mask.to(device), pos.to(device), labels.to(device)
        out = stage(x, mask, pos)
        if last:
            loss_sum += token_loss_sum(out, labels).double().cpu()
            tokens += int((labels[:, 1:] != IGNORE).sum())
        else:
            assert peers.next is not None and count is not None
            tensors = {"hidden": out, "attention_mask": mask, "position_ids": pos,
                       "labels": labels}  # fmt: skip
            if keys is not None:
                tensors[ROWS] = keys
            peers.next.send(Frame(EVAL, step, m, tensors, {"count": count}), compression)
        m += 1
    if not last or tokens == 0:
        return None
    return float(loss_sum / tokens)
