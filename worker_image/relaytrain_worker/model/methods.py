"""What trains on a stage: LoRA or QLoRA adapters through peft, or the slice's own weights.

LoRA weights are initialised from a generator seeded by (job seed, global parameter
name), not from the process's RNG stream: every split of the model (and the unsplit
reference) then starts from the same adapter, which is what makes a P-stage pipeline
reproduce single-process training exactly.

Target names are a job's (the seven Llama linears, `all-linear`, `experts.*`), mapped onto
the family's own modules before peft sees them (`relaytrain_contract.families.lora_targets`:
Phi-3's fused `qkv_proj` and `gate_up_proj`, MoE expert weights as peft's
`target_parameters`); the exported adapter_config.json names what was adapted.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Literal

import torch
from peft import LoraConfig, inject_adapter_in_model
from relaytrain_contract.families import lora_targets
from torch import nn

from relaytrain_worker.model.model_slice import StageModel, device_of

ADAPTER = "default"
TIED_NAME = "model.embed_tokens.weight"
"""Global name of the weight that tied models share between embedding and head."""
TIED_HEAD_NAME = "lm_head.weight"
"""The head's own name for that weight: the key of the head's half of its gradient when
pipelines reduce it (replicas/arithmetic.py)."""


def lora_config(
    rank: int, alpha: float, dropout: float, targets: tuple[str, ...] | list[str]
) -> LoraConfig:
    """The peft LoRA config of a job (also written into adapter_config.json)."""
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type] # peft scales by alpha/r; floats work
        lora_dropout=dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def for_family(config: LoraConfig, model_type: str) -> LoraConfig:
    """`config` with its targets mapped onto `model_type`'s modules and expert parameters
    (mapping an already mapped config changes nothing)."""
    targets = config.target_modules or ()
    requested = [targets] if isinstance(targets, str) else sorted(targets)
    mapped = lora_targets(model_type, requested)
    parameters = [*(config.target_parameters or ()), *mapped.parameters]
    return dataclasses.replace(
        config,
        target_modules=list(mapped.modules),
        target_parameters=sorted(set(parameters)) or None,
    )


def apply_lora(
    model: nn.Module, config: LoraConfig, seed: int, quantized: bool = False
) -> list[tuple[str, nn.Parameter]]:
    """Inject LoRA into `model` (a slice's model or the full model, a transformers
    PreTrainedModel) for its family; return (global name, param)."""
    model_type = str(model.config.model_type)  # type: ignore[union-attr]
    inject_adapter_in_model(for_family(config, model_type), model, adapter_name=ADAPTER)
    if quantized:
        _fix_cpu_4bit(model)
    init_lora(model, seed)
    trainable = []
    for name, param in model.named_parameters():
        is_lora = ".lora_" in name
        param.requires_grad_(is_lora)
        if is_lora:
            trainable.append((name, param))
    return trainable


def init_lora(model: nn.Module, seed: int) -> None:
    """Re-initialise lora_A (kaiming-uniform, peft's default) and zero lora_B, by name.

    lora_A is drawn on the CPU and copied to wherever the adapter lives, so a stage on a
    GPU starts from the numbers a stage on the CPU does."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                gen = torch.Generator().manual_seed(_name_seed(seed, name))
                drawn = torch.empty(param.shape, dtype=param.dtype)
                nn.init.kaiming_uniform_(drawn, a=math.sqrt(5), generator=gen)
                param.copy_(drawn)
            elif ".lora_B." in name:
                param.zero_()


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _fix_cpu_4bit(model: nn.Module) -> None:
    """bitsandbytes' CPU path drops gradients unless the avx512-bf16 kernel is off."""
    import bitsandbytes as bnb

    linear4bit = bnb.nn.Linear4bit  # type: ignore[attr-defined]
    for module in model.modules():
        if isinstance(module, linear4bit) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def full_trainable(stage: StageModel) -> list[tuple[str, nn.Parameter]]:
    """Every weight of the slice trains; a tied head is named after the embedding it shares."""
    out = []
    for name, param in stage.model.named_parameters():
        param.requires_grad_(True)
        out.append((_tied_name(stage, name), param))
    return out


def _tied_name(stage: StageModel, name: str) -> str:
    tied = bool(getattr(stage.config, "tie_word_embeddings", False))
    if tied and name == TIED_HEAD_NAME:
        return TIED_NAME
    return name


def setup_method(
    stage: StageModel,
    method: Literal["lora", "qlora", "full"],
    lora: LoraConfig | None,
    seed: int,
    device: torch.device | str | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """Make the slice trainable per the job's method on `device` (where it is moved;
    default: where its weights are); return its trainable parameters. QLoRA quantises each
    layer as it moves it, so the full-precision layers never all sit on the device."""
    device = torch.device(device) if device is not None else device_of(stage)
    if method == "full":
        stage.to(device)
        return full_trainable(stage)
    if lora is None:
        raise ValueError(f"method {method} needs a LoRA config")
    if method == "qlora":
        from relaytrain_worker.model.quant import quantize_slice

        quantize_slice(stage, str(device))
    stage.to(device)  # the rest (embedding, norms, head; every layer but QLoRA's)
    return apply_lora(stage.model, lora, seed, quantized=method == "qlora")


def peft_key(name: str) -> str:
    """A slice parameter name as PEFT writes it in adapter_model.safetensors."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")
