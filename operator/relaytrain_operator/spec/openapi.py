"""What the CRD's schema says about a field or model beyond its Python type.

The CRD is generated from the spec and status models (relaytrain_operator.spec.crd); most of
it follows from the annotations (types, bounds, patterns, enums, defaults, docstrings).
What does not is written on the model or field itself with these helpers, as pydantic
`json_schema_extra`, so that a field and everything the API server knows about it stay in
one place:

    class SyncSpec(_Model):
        model_config = ConfigDict(json_schema_extra=cel(Rule("...", "...", field=".everySteps")))

    pools: Annotated[list[str], Field(json_schema_extra=list_type("set"))]

None of this changes what pydantic validates: a CEL rule has its pydantic twin (a model
validator) beside it, and both are tested (tests/unit/test_spec*.py, tests/k8s/test_crd_api.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field
from pydantic.config import JsonDict

__all__ = [
    "FIXED_ONCE_STARTED",
    "Int64",
    "Rule",
    "Timestamp",
    "cel",
    "fixed_once_started",
    "int_or_string",
    "list_type",
]

FIXED_ONCE_STARTED = "x-relaytrain-fixed-once-started"
"""Marks a spec field the job may not change once it started; the generator turns each mark
into a transition rule on the whole object (it needs `oldSelf.status`) and removes it."""


@dataclass(frozen=True)
class Rule:
    """One CEL rule of `x-kubernetes-validations`."""

    rule: str
    """The CEL expression; `self` is the object or value the rule is written on."""
    message: str
    """What the API server answers when the rule fails; name the field by its manifest path."""
    field: str | None = None
    """`fieldPath`: the field the refusal names, relative to `self` (`.everySteps`)."""
    reason: str | None = None
    """`reason`, e.g. FieldValueForbidden; empty means FieldValueInvalid."""

    def as_json(self) -> JsonDict:
        """The rule as the CRD spells it."""
        out: JsonDict = {"rule": self.rule, "message": self.message}
        if self.field is not None:
            out["fieldPath"] = self.field
        if self.reason is not None:
            out["reason"] = self.reason
        return out


def cel(*rules: Rule) -> JsonDict:
    """`json_schema_extra` of a model or field validated by CEL `rules`."""
    return {"x-kubernetes-validations": [rule.as_json() for rule in rules]} if rules else {}


def int_or_string(*rules: Rule) -> JsonDict:
    """`json_schema_extra` of a field that is an integer or a string (`3` or `"auto"`), which
    a structural schema cannot type otherwise; `rules` say which values are valid."""
    return {"x-kubernetes-int-or-string": True, **cel(*rules)}


def list_type(kind: Literal["atomic", "set", "map"], *keys: str) -> JsonDict:
    """`json_schema_extra` of a list: `set` (no repeats), `map` (items keyed by `keys`, merged
    by key on server-side apply) or `atomic` (replaced whole)."""
    out: JsonDict = {"x-kubernetes-list-type": kind}
    if keys:
        out["x-kubernetes-list-map-keys"] = list(keys)
    return out


def fixed_once_started(why: str = "create a new FineTuneJob") -> JsonDict:
    """`json_schema_extra` of a spec field that may not change once the job started
    (status.startTime set); `why` ends the API server's refusal."""
    return {FIXED_ONCE_STARTED: why}


Int64 = Annotated[int, Field(json_schema_extra={"format": "int64"})]
"""An integer the API server stores as int64 (generations, byte counts)."""
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
"""An RFC 3339 time, as Kubernetes writes them (`2026-11-22T05:00:00Z`)."""
