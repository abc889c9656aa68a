"""The exact merge of several pipelines' LoRA adapters (no aggregation bias).

A LoRA layer's weight is ``W + s * B @ A``. Averaging pipelines' adapters factor by factor,
as periodic sync does today (`periodic.py`), gives ``W + s * mean(B) @ mean(A)``, and that is
not the mean of the pipelines' weights ``W + s * mean(B @ A)``: the difference is

    mean(B_q @ A_q) - mean(B) @ mean(A) = sum_q w_q (B_q - mean(B)) @ (A_q - mean(A)) / sum_q w_q

(token-weighted means), zero only when the pipelines' factors agree. FedEx-LoRA and LoRA-FAIR
call it the aggregation bias; it grows with how far the pipelines drift apart between outer
steps, so with sparse, delayed outer updates it grows most. The exact merge keeps the
averaged factors as the adapter and folds that difference, times ``s``, into the frozen
weight ``W`` of every replica (FedEx-LoRA): then every replica's layer is exactly the
weighted mean of the pipelines' layers, in float64 then rounded once.

Its cost is state: a replica's frozen weight is no longer the model file's, so the folded
sum must travel with the adapter wherever the adapter goes (a checkpoint, a rejoining
pipeline, the exported result), as a dense delta of every adapted weight. That is why
`bench/bench_outer_sync.py` measures it against the naive average before periodic sync
makes it its default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def exact_merge(
    factors: Sequence[tuple[float, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For pipelines' ``(weight, B, A)`` (B: out x r, A: r x in): ``(mean B, mean A, fold)``
    with ``mean B @ mean A + fold == sum_q w_q B_q @ A_q / sum_q w_q`` (token-weighted,
    float64, folded in the order given); the means in the factors' dtype, `fold` float32."""
    total = sum(w for w, _, _ in factors)
    if not factors or total <= 0:
        raise ValueError("an exact merge needs at least one pipeline with a positive weight")
    _, b0, a0 = factors[0]
    b_sum = torch.zeros(b0.shape, dtype=torch.float64)
    a_sum = torch.zeros(a0.shape, dtype=torch.float64)
    product = torch.zeros((b0.shape[0], a0.shape[1]), dtype=torch.float64)
    for w, b, a in factors:  # in the order given
        b64, a64 = b.to(torch.float64), a.to(torch.float64)
        b_sum += w * b64
        a_sum += w * a64
        product += w * (b64 @ a64)
    b_mean, a_mean = b_sum / total, a_sum / total
    fold = (product / total - b_mean @ a_mean).to(torch.float32)
    dtype = factors[0][1].dtype
    return b_mean.to(dtype), a_mean.to(dtype), fold


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers of a peft model by module name (those with an active adapter)."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and module.lora_A
    }


def layer_factors(layer: nn.Module, adapter: str = "default") -> tuple[nn.Parameter, nn.Parameter]:
    """A LoRA layer's (B, A) parameters."""
    return layer.lora_B[adapter].weight, layer.lora_A[adapter].weight  # type: ignore[index,union-attr]


def fold_into(layer: nn.Module, fold: torch.Tensor, adapter: str = "default") -> None:
    """Add ``s * fold`` to the layer's frozen weight (transposed for a fan-in-fan-out
    layer, GPT-2's Conv1D), so its output gains exactly that term."""
    scaling = float(layer.scaling[adapter])  # type: ignore[index]
    delta = fold.T if getattr(layer, "fan_in_fan_out", False) else fold
    weight: torch.Tensor = layer.base_layer.weight  # type: ignore[union-attr,assignment]
    with torch.no_grad():
        weight.add_((delta * scaling).to(weight.dtype))


def effective_weight(layer: nn.Module, adapter: str = "default") -> torch.Tensor:
    """``W + s * B @ A`` of a LoRA layer in float64 (its base weight's orientation)."""
    b, a = layer_factors(layer, adapter)
    scaling = float(layer.scaling[adapter])  # type: ignore[index]
    delta = b.detach().to(torch.float64) @ a.detach().to(torch.float64) * scaling
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    weight: torch.Tensor = layer.base_layer.weight  # type: ignore[union-attr,assignment]
    return weight.detach().to(torch.float64) + delta
