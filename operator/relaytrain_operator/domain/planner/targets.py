"""Which LoRA targets a model's family has, and what each adds to a decoder layer.

A job names targets once (`spec.method.targetModules`, `TrainingShape.lora_targets`); the
worker maps them onto the family's modules (`relaytrain_contract.families.lora_targets`) and
peft adapts what matches. peft 0.21 (the worker's) adapts ``nn.Linear`` modules by name and,
through ``target_parameters``, the 3-D expert weights of an MoE layer (``ParamWrapper``:
``lora_A`` in x r·E, ``lora_B`` r·E x out; no dropout, no DoRA). A name that matches nothing
in a family is silently skipped by peft when another name matches, so the planner refuses
it here, before any pod starts, naming what the family does have:

- expert weights (``experts.gate_up_proj``, ``experts.down_proj``) on a dense family;
- the MLP's Llama names on Mixtral and GPT-OSS, and on Qwen3-MoE without dense layers: their
  MLP is the experts, 3-D parameters that no module name reaches (Qwen2-MoE's shared expert
  is a Llama MLP, so there they adapt it). ``all-linear`` stays valid: as in peft, it means
  the linears that exist, which on those families leaves the experts alone;
- Phi-3's fused ``qkv_proj``/``gate_up_proj`` on a family that does not fuse.
"""

from __future__ import annotations

from relaytrain_contract.families import family

from relaytrain_operator.domain.planner.model_shape import (
    EXPERT_NAMES,
    FUSED_NAMES,
    LINEAR_NAMES,
    ModelShape,
)
from relaytrain_operator.domain.planner.result import PlanError
from relaytrain_operator.domain.planner.training import TrainingShape

_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


class LoraTargetError(PlanError):
    """LoRA targets the model's family cannot take; the message names the field and the
    valid targets. A `PlanError`, so the operator reports it as the job's condition."""


def has_mlp_linears(model: ModelShape) -> bool:
    """Whether some decoder layer has a Llama MLP as ``nn.Linear`` modules."""
    return not model.moe or bool(model.shared_expert_size or model.dense_layers)


def valid_targets(model: ModelShape) -> tuple[str, ...]:
    """The target names that adapt something in ``model``'s decoder layers."""
    names: tuple[str, ...] = LINEAR_NAMES if has_mlp_linears(model) else LINEAR_NAMES[:4]
    if family(model.model_type).fused:
        names += FUSED_NAMES if has_mlp_linears(model) else FUSED_NAMES[:1]
    if model.moe:
        names += EXPERT_NAMES
    return names


def check_lora_targets(model: ModelShape, training: TrainingShape) -> None:
    """Refuse targets ``model``'s family does not have (LoraTargetError)."""
    if training.method == "full":
        return
    targets = training.lora_targets
    all_linear = set(LINEAR_NAMES) <= set(targets)
    valid = valid_targets(model)
    bad = [
        t
        for t in targets
        if t not in valid and not (all_linear and t in LINEAR_NAMES and t in _MLP_NAMES)
    ]
    if not bad:
        return
    fam = family(model.model_type)
    why = []
    experts = [t for t in bad if t in EXPERT_NAMES]
    if experts:
        why.append(f"{fam.name} has no experts")
    mlp = [t for t in bad if t in _MLP_NAMES and t not in experts]
    if mlp and model.moe:
        why.append(
            f"{fam.name}'s MLP is its experts, 3-D weights that peft adapts only as "
            f"{' and '.join(EXPERT_NAMES)}"
        )
    fused = [t for t in bad if t in FUSED_NAMES and t not in mlp]
    if fused:
        why.append(f"{fam.name} has no fused projections")
    raise LoraTargetError(
        f"spec.method.targetModules names {', '.join(bad)}, which match nothing in "
        f"{model.model_type} ({'; '.join(why)}); valid for {model.model_type}: "
        f"{', '.join(valid)} (or 'all-linear')"
    )


def lora_params_per_layer(model: ModelShape, training: TrainingShape) -> int:
    """LoRA parameters (A and B) added to one decoder layer (the largest)."""
    if training.method == "full":
        return 0
    return sum(training.lora_rank * sum(_shape(model, t)) * _copies(model, t)
               for t in training.lora_targets)  # fmt: skip


def expert_lora_weights(model: ModelShape, training: TrainingShape) -> list[int]:
    """Per targeted expert weight, its size (experts x in x out) in one MoE layer."""
    if training.method == "full" or not model.moe:
        return []
    out = []
    for t in training.lora_targets:
        if t in EXPERT_NAMES:
            a, b = model.linear_shape(t)
            out.append(model.num_experts * a * b)
    return out


def _copies(model: ModelShape, name: str) -> int:
    """How many adapters of ``name``'s shape one layer gets: one per expert for an expert
    weight (peft's lora_A and lora_B carry r per expert), none where nothing matches."""
    if name in EXPERT_NAMES:
        return model.num_experts
    if name in _MLP_NAMES and not has_mlp_linears(model):
        return 0
    return 1


def _shape(model: ModelShape, name: str) -> tuple[int, int]:
    """(in, out) of the module ``name`` adapts: on an MoE model a Llama MLP name adapts the
    shared expert (Qwen2-MoE) or the dense layers' MLP (Qwen-MoE ``mlp_only_layers``)."""
    if not model.moe or name not in _MLP_NAMES:
        return model.linear_shape(name)
    h = model.hidden_size
    width = model.shared_expert_size or model.dense_intermediate_size or model.intermediate_size
    if name == "down_proj":
        return width, h
    return h, width * (2 if name == "gate_up_proj" else 1)
