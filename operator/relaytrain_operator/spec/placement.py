"""The placement section of a FineTuneJob's spec: which nodes may run the stages (the
other sections are in sections.py; job.py assembles them). As there, the docstrings are the
CRD's descriptions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from relaytrain_operator.spec.errors import field_error
from relaytrain_operator.spec.openapi import list_type
from relaytrain_operator.spec.sections import SpecModel


class Toleration(SpecModel):
    """A Kubernetes toleration copied onto every stage pod."""

    key: Annotated[str, Field(max_length=316)] | None = None
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """`Equal` matches key and value; `Exists` matches any value."""
    value: Annotated[str, Field(max_length=63)] | None = None
    """Taint value to match (operator Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated before eviction; empty means forever."""


class PlacementSpec(SpecModel):
    """Which nodes may run the stages."""

    gpu_label: Annotated[str, Field(min_length=1, max_length=316)] = "nvidia.com/gpu.product"
    """Node label whose value names the GPU type; nodes sharing a value form a pool."""
    pools: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=63)]],
        Field(max_length=64, json_schema_extra=list_type("set")),
    ] = Field(default_factory=list)
    """Allowed pools (values of gpuLabel); empty allows every pool."""
    tolerations: Annotated[
        list[Toleration], Field(max_length=32, json_schema_extra=list_type("atomic"))
    ] = Field(default_factory=list)
    """Tolerations added to every stage pod."""
    priority_class_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """PriorityClass of the stage pods."""
    runtime_class_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """RuntimeClass of the stage pods, e.g. `nvidia` where the NVIDIA container runtime is not
    the nodes' default; empty uses the default runtime."""
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32
    )
    """Extra node labels every stage node must carry."""

    @model_validator(mode="after")
    def _unique_pools(self) -> PlacementSpec:
        if len(set(self.pools)) != len(self.pools):
            raise field_error("pools", "must not repeat a pool")
        return self
