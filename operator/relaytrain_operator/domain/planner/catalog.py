"""The GPU catalog: what each `nvidia.com/gpu.product` value can do.

Keys are the exact strings NVIDIA's GPU feature discovery (GFD) writes to the node label
``nvidia.com/gpu.product`` (the name nvidia-smi reports, spaces replaced by dashes).
Numbers are the vendor's published *dense* figures (no 2:4 sparsity):

- ``tflops``: tensor-core bf16/fp16 throughput with fp32 accumulation, which is what
  PyTorch's matmuls use when training. GeForce cards run fp32-accumulate at half their
  advertised fp16-accumulate rate, so they are listed at that lower number.
- ``fp32_tflops``: plain fp32 (non-tensor) throughput, used for ``float32`` jobs
  (PyTorch does not use TF32 for matmuls unless told to).
- ``memory_mib``: memory as GFD reports it in ``nvidia.com/gpu.memory``; a node's own
  label wins over this value when present.
- ``memory_bandwidth_gbs``: HBM/GDDR bandwidth, which bounds QLoRA's dequantisation.

Two optional fields say what a card measured, not what its datasheet says, and are unset in
the built-in entries: ``efficiency``, the fraction of that peak the card's stages reach (its
model FLOPs utilisation, e.g. the MFU `make gpu-check` reports for one stage), and
``layer_overhead_ms``, a fixed time per decoder layer and micro-batch that FLOPs do not see.
Unset, the cost model's own settings price the card (``CostSettings.efficiency``, 0.45, and
``CostSettings.layer_overhead_seconds``, 0). In a mixed fleet a card that reaches a smaller
share of its peak than the others is otherwise given too many layers.

The catalog is data, so users override or extend it: :meth:`Catalog.with_overrides` takes a
mapping (from a YAML/JSON file for the CLI, or a ConfigMap / chart values for the operator).
An unknown product is an error that lists the known ones, never a guess.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from relaytrain_operator.domain.planner.result import PlanError

#: GFD appends this to the product when GPUs are time-sliced; the hardware is the same.
_SHARED_SUFFIX = "-SHARED"


class UnknownGpuError(PlanError):
    """A GPU product label that the catalog does not know (a PlanError: nothing to plan on)."""


@dataclass(frozen=True)
class GpuSpec:
    """What the planner needs to know about one GPU model."""

    product: str
    """The `nvidia.com/gpu.product` label value, e.g. ``NVIDIA-H100-80GB-HBM3``."""
    tflops: float
    """Dense bf16/fp16 tensor-core TFLOPS with fp32 accumulation."""
    fp32_tflops: float
    """Dense fp32 (non-tensor) TFLOPS, used when the job trains in float32."""
    memory_mib: int
    """Memory per GPU in MiB (the node label ``nvidia.com/gpu.memory`` overrides it)."""
    memory_bandwidth_gbs: float
    """Memory bandwidth in GB/s (bounds 4-bit dequantisation under QLoRA)."""
    bf16: bool
    """Whether the GPU computes in bfloat16 natively (Ampere and newer)."""
    efficiency: float | None = None
    """Measured fraction of the peak this card's stages reach, in (0, 1]; None: the cost
    model's (``CostSettings.efficiency``)."""
    layer_overhead_ms: float | None = None
    """Measured fixed milliseconds per decoder layer and micro-batch, at least 0; None: the
    cost model's (``CostSettings.layer_overhead_seconds``)."""

    def __post_init__(self) -> None:
        for name in ("tflops", "fp32_tflops", "memory_mib", "memory_bandwidth_gbs"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ValueError(
                    f"GPU {self.product!r}: {_camel(name)} must be a positive number, got {value!r}"
                )
        if not isinstance(self.bf16, bool):
            raise ValueError(f"GPU {self.product!r}: bf16 must be true or false, got {self.bf16!r}")
        eff = self.efficiency
        if eff is not None and not (_is_number(eff) and 0 < eff <= 1):
            raise ValueError(
                f"GPU {self.product!r}: efficiency must be a number above 0 and at most 1 (the "
                f"share of the card's peak its stages reach, e.g. 0.3), got {eff!r}"
            )
        overhead = self.layer_overhead_ms
        if overhead is not None and not (_is_number(overhead) and overhead >= 0):
            raise ValueError(
                f"GPU {self.product!r}: layerOverheadMs must be a number of milliseconds, at "
                f"least 0, got {overhead!r}"
            )

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (``bfloat16``, ``float16`` or ``float32``)."""
        return (self.fp32_tflops if dtype == "float32" else self.tflops) * 1e12

    def supports(self, dtype: str) -> bool:
        """Whether the GPU can train in ``dtype`` at its listed speed."""
        return self.bf16 or dtype != "bfloat16"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _gpu(
    product: str, tflops: float, fp32: float, mib: int, gbs: float, *, bf16: bool = True
) -> GpuSpec:
    return GpuSpec(product, tflops, fp32, mib, gbs, bf16)


#: Published dense figures (vendor datasheets). Memory in MiB as GFD reports it.
BUILTIN_GPUS: tuple[GpuSpec, ...] = (
    _gpu("NVIDIA-H200", 989.0, 67.0, 143771, 4800.0),
    _gpu("NVIDIA-H200-NVL", 835.0, 60.0, 143771, 4800.0),
    _gpu("NVIDIA-H100-80GB-HBM3", 989.0, 67.0, 81559, 3350.0),
    _gpu("NVIDIA-H100-PCIe", 756.0, 51.0, 81559, 2000.0),
    _gpu("NVIDIA-H100-NVL", 835.0, 60.0, 95830, 3900.0),
    _gpu("NVIDIA-A100-SXM4-80GB", 312.0, 19.5, 81920, 2039.0),
    _gpu("NVIDIA-A100-SXM4-40GB", 312.0, 19.5, 40960, 1555.0),
    _gpu("NVIDIA-A100-80GB-PCIe", 312.0, 19.5, 81920, 1935.0),
    _gpu("NVIDIA-A100-PCIE-40GB", 312.0, 19.5, 40960, 1555.0),
    _gpu("NVIDIA-L40S", 362.0, 91.6, 46068, 864.0),
    _gpu("NVIDIA-L40", 181.0, 90.5, 46068, 864.0),
    _gpu("NVIDIA-A40", 149.7, 37.4, 46068, 696.0),
    _gpu("NVIDIA-A10", 125.0, 31.2, 23028, 600.0),
    _gpu("NVIDIA-A10G", 70.0, 31.2, 23028, 600.0),
    _gpu("NVIDIA-L4", 121.0, 30.3, 23034, 300.0),
    _gpu("NVIDIA-RTX-A6000", 154.8, 38.7, 49140, 768.0),
    _gpu("NVIDIA-RTX-6000-Ada-Generation", 364.2, 91.1, 49140, 960.0),
    _gpu("NVIDIA-GeForce-RTX-5090", 209.5, 104.8, 32607, 1792.0),
    _gpu("NVIDIA-GeForce-RTX-4090", 165.2, 82.6, 24564, 1008.0),
    _gpu("NVIDIA-GeForce-RTX-3090", 71.0, 35.6, 24576, 936.0),
    _gpu("Tesla-V100-SXM2-32GB", 125.0, 15.7, 32768, 900.0, bf16=False),
    _gpu("Tesla-V100-SXM2-16GB", 125.0, 15.7, 16384, 900.0, bf16=False),
    _gpu("Tesla-V100-PCIE-32GB", 112.0, 14.0, 32768, 900.0, bf16=False),
    _gpu("Tesla-V100-PCIE-16GB", 112.0, 14.0, 16384, 900.0, bf16=False),
    _gpu("Tesla-T4", 65.0, 8.1, 15360, 320.0, bf16=False),
)

_FIELD_ALIASES = {
    "tflops": "tflops",
    "fp32Tflops": "fp32_tflops",
    "memoryMiB": "memory_mib",
    "memoryBandwidthGBs": "memory_bandwidth_gbs",
    "bf16": "bf16",
    "efficiency": "efficiency",
    "layerOverheadMs": "layer_overhead_ms",
}
#: The fields a new GPU must give (the measured ones may be left out).
_REQUIRED = tuple(f.name for f in fields(GpuSpec) if f.name != "product" and f.default is MISSING)


def _number(value: Any) -> Any:
    """`value`, or the number a string spells: YAML 1.1 readers (PyYAML) take `1e-05`, as
    Helm's toYaml writes a small float, for a string. Anything else is left for GpuSpec to
    refuse, naming the field."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _camel(snake: str) -> str:
    for camel, name in _FIELD_ALIASES.items():
        if name == snake:
            return camel
    return snake


class Catalog(Mapping[str, GpuSpec]):
    """An immutable mapping from GPU product label to :class:`GpuSpec`."""

    def __init__(self, gpus: Mapping[str, GpuSpec] | None = None) -> None:
        self._gpus: dict[str, GpuSpec] = (
            dict(gpus) if gpus is not None else {g.product: g for g in BUILTIN_GPUS}
        )

    def __getitem__(self, product: str) -> GpuSpec:
        if product in self._gpus:
            return self._gpus[product]
        if product.endswith(_SHARED_SUFFIX) and product[: -len(_SHARED_SUFFIX)] in self._gpus:
            return self._gpus[product[: -len(_SHARED_SUFFIX)]]
        raise UnknownGpuError(
            f"unknown GPU product {product!r} (label nvidia.com/gpu.product); known: "
            f"{', '.join(sorted(self._gpus))}. Add it with a catalog override "
            f"(tflops, fp32Tflops, memoryMiB, memoryBandwidthGBs, bf16; optionally the measured "
            f"efficiency and layerOverheadMs)."
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._gpus)

    def __len__(self) -> int:
        return len(self._gpus)

    def with_overrides(self, doc: Mapping[str, Any]) -> Catalog:
        """Return a new catalog with ``doc`` applied on top of this one.

        ``doc`` is ``{"gpus": {PRODUCT: {field: value}}}`` or just ``{PRODUCT: {...}}``,
        with camelCase fields ``tflops``, ``fp32Tflops``, ``memoryMiB``,
        ``memoryBandwidthGBs``, ``bf16`` and the measured ``efficiency`` and
        ``layerOverheadMs``. A known product takes the given fields and keeps the rest (a
        measured field set to null is unset again); a new product must give all but the
        measured ones.
        """
        entries = doc.get("gpus", doc) if isinstance(doc, Mapping) else None
        if not isinstance(entries, Mapping):
            raise ValueError("catalog override must be a mapping of GPU product -> fields")
        gpus = dict(self._gpus)
        for product, raw in entries.items():
            if not isinstance(raw, Mapping):
                raise ValueError(f"catalog override for {product!r} must be a mapping")
            unknown = sorted(set(raw) - set(_FIELD_ALIASES))
            if unknown:
                raise ValueError(
                    f"catalog override for {product!r}: unknown field(s) {', '.join(unknown)}; "
                    f"valid: {', '.join(_FIELD_ALIASES)}"
                )
            values = {_FIELD_ALIASES[k]: _number(v) for k, v in raw.items()}
            base = gpus.get(str(product))
            if base is not None:
                gpus[str(product)] = replace(base, **values)
                continue
            missing = [_camel(n) for n in _REQUIRED if n not in values]
            if missing:
                raise ValueError(
                    f"catalog override adds new GPU {product!r} but lacks {', '.join(missing)}"
                )
            gpus[str(product)] = GpuSpec(product=str(product), **values)
        return Catalog(gpus)


DEFAULT_CATALOG = Catalog()
