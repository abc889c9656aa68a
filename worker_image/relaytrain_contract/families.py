"""The model families a stage can slice, named once for both sides.

The planner refuses any other `model_type` before a pod exists (`planner.model_shape`), the
worker before it builds a slice (`model_slice`); both read this one list. Per family it also
says how the LoRA target names a job gives map onto the family's modules: jobs name the
seven Llama linears (`q_proj` ... `down_proj`, the default `q_proj, k_proj, v_proj, o_proj`);
a family that fuses some of them (Phi-3's `qkv_proj`, `gate_up_proj`) adapts the fused
module instead, and MoE experts, held as 3-D parameters, are adapted only when named
(`experts.gate_up_proj`, `experts.down_proj`; peft's `target_parameters`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder layer's linears under their Llama names: what `targetModules` names."""
ALL_LINEAR = ("all-linear", "all_linear")
"""Spellings of "every linear of the decoder layer" (peft's shorthand)."""
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""LoRA targets of a job that names none: the attention projections (fused where fused)."""

_FUSED_PHI3 = MappingProxyType(
    {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
)
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class Family:
    """One `model_type` the worker slices and the planner plans."""

    model_type: str
    """`model_type` in the model's config.json."""
    name: str
    """The family as people call it (docs, messages)."""
    fused: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Llama linear name -> the module of this family that holds it (Phi-3: q_proj -> qkv_proj)."""
    expert_parameters: tuple[str, ...] = ()
    """The 3-D expert weights of an MoE layer, by their path in a decoder layer."""
    qk_norm: Literal["", "head", "width"] = ""
    """Whether q and k are normed before attention: per head (Qwen3, Gemma 3) or over their
    whole width (OLMo 2). The planner prices what those norms keep for backward."""
    post_norms: bool = False
    """Whether attention's and the MLP's outputs are normed too (Gemma 2 and 3: four norms
    a layer)."""

    @property
    def moe(self) -> bool:
        """Whether the family's MLP is a mixture of experts."""
        return bool(self.expert_parameters)


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama (and SmolLM)"),
    Family("mistral", "Mistral"),
    Family("qwen2", "Qwen2 / Qwen2.5"),
    Family("qwen3", "Qwen3", qk_norm="head"),
    Family("gemma", "Gemma"),
    Family("gemma2", "Gemma 2", post_norms=True),
    Family("gemma3_text", "Gemma 3 (text)", qk_norm="head", post_norms=True),
    Family("phi3", "Phi-3 / Phi-4", fused=_FUSED_PHI3),
    Family("mixtral", "Mixtral", expert_parameters=_EXPERTS),
    Family("qwen2_moe", "Qwen2-MoE", expert_parameters=_EXPERTS),
    Family("qwen3_moe", "Qwen3-MoE", expert_parameters=_EXPERTS, qk_norm="head"),
    Family("gpt_oss", "GPT-OSS", expert_parameters=_EXPERTS),
    Family("olmo2", "OLMo 2", qk_norm="width"),
    Family("granite", "Granite"),
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES)
"""Every `model_type` a job may train, in the order the docs list them."""

_BY_TYPE = {f.model_type: f for f in FAMILIES}


class UnsupportedModelError(ValueError):
    """A `model_type` no stage can slice; the message names it and the supported ones."""


def unsupported_message(model_type: object) -> str:
    """The one sentence both sides refuse an unsupported model with."""
    return (
        f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def family(model_type: object) -> Family:
    """The family of `model_type`; UnsupportedModelError when there is none."""
    found = _BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise UnsupportedModelError(unsupported_message(model_type))
    return found


@dataclass(frozen=True)
class LoraTargets:
    """What peft adapts for a job's `targetModules` on one family."""

    modules: tuple[str, ...]
    """Module names (peft's `target_modules`)."""
    parameters: tuple[str, ...]
    """3-D expert parameters (peft's `target_parameters`)."""


def lora_targets(model_type: str, requested: Sequence[str]) -> LoraTargets:
    """Map a job's target names onto the modules and parameters of `model_type`'s layers.

    A Llama name a family fuses becomes the fused module (q_proj, k_proj or v_proj on Phi-3:
    `qkv_proj`, which carries all three); a name with a dot that ends an expert parameter's
    path (`experts.down_proj`) targets that parameter; `all-linear` stands for the seven
    Llama names; anything else is passed to peft as a module name. Order is kept, repeats
    dropped, so mapping twice gives what mapping once gave.
    """
    fam = family(model_type)
    names = [n for name in requested for n in (LINEAR_NAMES if name in ALL_LINEAR else (name,))]
    modules: list[str] = []
    parameters: list[str] = []
    for name in names:
        expert = [p for p in fam.expert_parameters if "." in name and _ends(p, name)]
        if expert:
            parameters.extend(p for p in expert if p not in parameters)
            continue
        module = fam.fused.get(name, name)
        if module not in modules:
            modules.append(module)
    return LoraTargets(tuple(modules), tuple(parameters))


def _ends(path: str, name: str) -> bool:
    """Whether dotted `path` ends with the whole components of `name`."""
    return path == name or path.endswith("." + name)
