"""Single-process references: the unsplit model trained with the arithmetic the
pipelines must reproduce (one global batch per step; or periodic synchronisation as its
definition says)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from relaytrain_contract import TrainingSpec
from relaytrain_worker.model.methods import lora_config
from relaytrain_worker.model.model_slice import load_config
from relaytrain_worker.model.training import make_optimizer, optimizer_step
from relaytrain_worker.replicas.arithmetic import micro_ranges
from relaytrain_worker.state.data import MicroBatch
from torch import nn

from relaytrain_testkit.pipelines import PipelineRun, synchronize

ModelBuilder = Callable[[], nn.Module]
"""Builds the unsplit model, frozen and in training mode (instead of loading it from a model
directory): relaytrain_testkit.random_models.random_model."""


def run_reference(
    model: Path | ModelBuilder,
    steps: list[list[MicroBatch]],
    training: TrainingSpec,
    *,
    method: Literal["lora", "full"] = "lora",
    lora: dict[str, Any] | None = None,
    warmup: int = 0,
    grads: Literal["every", "last"] = "every",
) -> PipelineRun:
    """Single-process training of the unsplit model with the same arithmetic.

    ``model``: the model directory (loaded in float32), or a function that builds the
    model. ``warmup`` and ``grads`` as in `run_pipeline_threads`: the first ``warmup`` steps
    are not timed; ``grads="last"`` keeps only the last step's gradients.
    """
    built, trainable, optimizer, scheduler = _reference_model(model, training, method, lora)
    device = next(built.parameters()).device
    run = PipelineRun()
    started = time.perf_counter()
    for s, micros in enumerate(steps):
        if warmup and s == warmup:
            synchronize(device)
            started = time.perf_counter()
        loss_sum, items, norm = _reference_step(built, trainable, micros, training)
        if norm is not None:
            run.grad_norms.append(norm)
        run.losses.append(loss_sum / items)
        keep = grads == "every" or s == len(steps) - 1
        run.grads.append(
            {n: p.grad.detach().clone() for n, p in trainable if keep and p.grad is not None}
        )
        optimizer_step(optimizer, scheduler)
    synchronize(device)
    run.seconds = time.perf_counter() - started
    run.params = {n: p.detach().clone() for n, p in trainable}
    return run


def run_periodic_reference(
    model_dir: Path,
    shares: list[int],
    steps: list[list[MicroBatch]],
    training: TrainingSpec,
    every: int,
    *,
    method: Literal["lora", "full"] = "lora",
    lora: dict[str, Any] | None = None,
    code: str = "float64",
    merge: Literal["average", "exact"] = "average",
) -> PipelineRun:
    """Periodic synchronisation as its definition says, in one process: one unsplit model
    and optimizer per pipeline, each stepping on its share of every step with its loss
    normalised by its share's label tokens; every `every` steps and after the last, every
    model's trainable weights set to the mean of theirs weighted by the label tokens each
    trained since the previous average (float64, rounded once). Returns the whole step's
    losses (every share's loss sum over every share's tokens) and the weights at the end
    (`step_params`: after each step's average, as a pipeline holds them).

    With a low-bit `code` (`sync.outerCode`) the average is instead: every replica's update
    since the last average plus its residual, coded (`outer_codec.encode`, the rotation of
    the step), and every weight set to the last average plus the token-weighted mean of the
    decoded updates; each replica keeps what its code left out.

    With `merge="exact"` (`sync.loraMerge`) every LoRA layer of every replica becomes the
    token-weighted mean of the replicas' layers (of their decoded values, with a code): B
    and A their means, and the rest of ``mean(B_q @ A_q)``, times the scaling, added to the
    frozen weight as it was before the first step, accumulated in float32 and rounded once
    (`_exact_outer`)."""
    from relaytrain_worker.replicas import outer_codec

    replicas = [_reference_model(model_dir, training, method, lora) for _ in shares]
    ranges = micro_ranges(shares)
    run = PipelineRun()
    weights = [0] * len(shares)
    bits = None if code == "float64" else outer_codec.bits_of(code)
    anchor = {n: p.detach().to(torch.float32, copy=True) for n, p in replicas[0][1]}
    residual = [{n: torch.zeros_like(a) for n, a in anchor.items()} for _ in shares]
    folds: dict[str, torch.Tensor] = {}
    for s, micros in enumerate(steps):
        loss_total, items_total = 0.0, 0
        for q, (model, trainable, optimizer, scheduler) in enumerate(replicas):
            share = [micros[i] for i in ranges[q]]
            loss_sum, items, _ = _reference_step(model, trainable, share, training)
            optimizer_step(optimizer, scheduler)
            loss_total, items_total = loss_total + loss_sum, items_total + items
            weights[q] += items
        run.losses.append(loss_total / items_total)
        if (s + 1) % every == 0 or s + 1 == len(steps):
            with torch.no_grad():
                if merge == "exact":
                    _exact_outer(replicas, weights, anchor, residual, bits, s + 1, folds)
                    weights = [0] * len(shares)
                    run.step_params.append({n: p.detach().clone() for n, p in replicas[0][1]})
                    continue
                for name, _ in replicas[0][1]:
                    held = [dict(r[1])[name] for r in replicas]
                    if bits is not None:
                        codes = []
                        for q, param in enumerate(held):
                            update = param.detach().float() - anchor[name] + residual[q][name]
                            c, residual[q][name] = outer_codec.encode(
                                update, weights[q], bits, s + 1
                            )
                            codes.append(c)
                        mean = outer_codec.weighted_mean(codes, anchor[name].numel(), bits, s + 1)
                        anchor[name] = anchor[name] + mean.reshape(anchor[name].shape)
                        for param in held:
                            param.copy_(anchor[name].to(param.dtype))
                        continue
                    acc = torch.zeros_like(held[0], dtype=torch.float64)
                    for w, param in zip(weights, held, strict=True):  # in pipeline order
                        acc += param.detach().to(torch.float64) * float(w)
                    mean = (acc / sum(weights)).to(held[0].dtype)
                    for param in held:
                        param.copy_(mean)
            weights = [0] * len(shares)
        run.step_params.append({n: p.detach().clone() for n, p in replicas[0][1]})
    run.params = dict(run.step_params[-1])
    return run


def _exact_outer(
    replicas: list[Any],
    weights: list[int],
    anchor: dict[str, torch.Tensor],
    residual: list[dict[str, torch.Tensor]],
    bits: int | None,
    step: int,
    folds: dict[str, torch.Tensor],
) -> None:
    """`run_periodic_reference`'s outer step with the exact LoRA merge (see there)."""
    from relaytrain_worker.model.lora_merge import exact_merge
    from relaytrain_worker.replicas import outer_codec

    values: dict[str, list[torch.Tensor]] = {}
    for name, _ in replicas[0][1]:
        held = [dict(r[1])[name].detach() for r in replicas]
        if bits is None:
            values[name] = [h.to(torch.float64) for h in held]
            continue
        values[name] = []
        for q, h in enumerate(held):
            update = h.float() - anchor[name] + residual[q][name]
            code, residual[q][name] = outer_codec.encode(update, weights[q], bits, step)
            decoded = outer_codec.decode(code, anchor[name].numel(), bits, step)[1]
            values[name].append(anchor[name] + decoded.reshape(anchor[name].shape))
    new: dict[str, torch.Tensor] = {}
    for name, bs in values.items():
        if ".lora_B." not in name:
            continue
        a_name = name.replace(".lora_B.", ".lora_A.")
        factors = [(float(w), b, a) for w, b, a in zip(weights, bs, values[a_name], strict=True)
                   if w > 0]  # fmt: skip
        new[name], new[a_name], fold = exact_merge(factors)
        module = name.split(".lora_B.")[0]
        first = replicas[0][0].get_submodule(module)
        delta = (fold.T if getattr(first, "fan_in_fan_out", False) else fold) * float(
            first.scaling["default"]
        )
        folds[module] = delta if module not in folds else folds[module] + delta
        for model, _, _, _ in replicas:
            layer = model.get_submodule(module)
            weight = layer.base_layer.weight
            if not hasattr(layer, "_reference_w0"):  # the weight before any fold
                layer._reference_w0 = weight.detach().clone()
            w0 = layer._reference_w0
            weight.copy_((w0.float() + folds[module]).to(w0.dtype))
    for name, vs in values.items():
        if name not in new:
            acc = torch.zeros_like(vs[0], dtype=torch.float64)
            for w, v in zip(weights, vs, strict=True):  # in pipeline order
                acc += float(w) * v.to(torch.float64)
            new[name] = acc / sum(weights)
    for name, value in new.items():
        if bits is not None:
            anchor[name] = value.to(torch.float32)
        for r in replicas:
            param = dict(r[1])[name]
            param.copy_(value.reshape(param.shape).to(param.dtype))


def _reference_model(
    source: Path | ModelBuilder,
    training: TrainingSpec,
    method: Literal["lora", "full"],
    lora: dict[str, Any] | None,
) -> tuple[Any, list[tuple[str, nn.Parameter]], Any, Any]:
    """The unsplit model in training mode, its trainable parameters and their optimizer."""
    from relaytrain_worker.model.methods import apply_lora
    from transformers import AutoModelForCausalLM

    model: Any
    if isinstance(source, Path):
        # The stages' config: the same attention implementation (sdpa, or eager where needed).
        config = load_config(source)
        model = AutoModelForCausalLM.from_pretrained(
            str(source), config=config, dtype=torch.float32
        )
    else:
        model = source()
    model.train()
    lcfg = lora or {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    trainable: list[tuple[str, nn.Parameter]]
    if method == "full":
        trainable = list(model.named_parameters())
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        cfg = lora_config(lcfg["rank"], lcfg["alpha"], lcfg["dropout"], lcfg["targets"])
        trainable = apply_lora(model, cfg, training.seed)
    optimizer, scheduler = make_optimizer(trainable, training)
    return model, trainable, optimizer, scheduler


def _reference_step(
    model: Any,
    trainable: list[tuple[str, nn.Parameter]],
    micros: list[MicroBatch],
    training: TrainingSpec,
) -> tuple[float, int, float | None]:
    """Forward and backward `micros` as one step (the token-mean loss over their label
    tokens), then clip: (summed token loss, label tokens, norm before clipping or None).

    The micro-batches go where the model is. Packed rows without padding go in without an
    attention mask: transformers then finds the documents where positions restart, as the
    slices do (`families.document_ids`); given a mask, it would not look."""
    from relaytrain_worker.model import families
    from relaytrain_worker.pipeline.schedule import count_items, token_loss_sum

    items = count_items(micros)
    total = torch.zeros((), dtype=torch.float64)
    device = next(model.parameters()).device
    for mb in micros:
        mask, pos = mb.attention_mask.to(device), mb.position_ids.to(device)
        packed = bool(mask.all()) and families.document_ids(pos) is not None
        logits = model(
            input_ids=mb.input_ids.to(device),
            attention_mask=None if packed else mask,
            position_ids=pos,
            use_cache=False,
        ).logits
        part = token_loss_sum(logits, mb.labels.to(device))
        total += float(part.detach())
        (part / items).backward()  # type: ignore[no-untyped-call]
    norm = None
    if training.max_grad_norm > 0:
        params = [p for _, p in trainable]
        norm = float(torch.nn.utils.clip_grad_norm_(params, training.max_grad_norm))
    return float(total), items, norm
