"""QLoRA's frozen base: the slice's decoder Linear layers as bitsandbytes NF4 Linear4bit.

Done after the slice's own weights are loaded, so only this stage's layers are ever
quantised (and held in full precision only one layer at a time). The embedding, norms
and the output head stay in the model dtype, as in QLoRA.
"""

from __future__ import annotations

import torch
from torch import nn

from relaytrain_worker.model.model_slice import StageModel


def quantize_slice(stage: StageModel, device: str | None = None) -> int:
    """Replace every nn.Linear inside the decoder layers by NF4 Linear4bit; returns how many."""
    import bitsandbytes as bnb

    target = device or ("cuda" if torch.cuda.is_available() else "cpu")
    replaced = 0
    for _, layer in stage.layer_items():
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                dtype = child.weight.dtype
                q = bnb.nn.Linear4bit(  # type: ignore[attr-defined,no-untyped-call]
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=dtype,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(  # type: ignore[attr-defined]
                    child.weight.data.to(torch.float32 if dtype == torch.float32 else dtype),
                    requires_grad=False,
                    quant_type="nf4",
                )
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, child_name, q.to(target))  # quantises on the move
                replaced += 1
    return replaced
