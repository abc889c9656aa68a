"""The CRD is generated from the spec and status models (relaytrain_operator.spec.crd): the
committed files (crds/ and the chart's copy) are the generator's output byte for byte, the
schema is structural, every CEL rule is kept, and what it says matches the models read
independently of the generator (same fields both ways, types, required, enums, defaults,
bounds, patterns), with a description on every field for `kubectl explain`."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types as at
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from relaytrain_operator.spec import FineTuneJobSpec, FineTuneJobStatus, patterns
from relaytrain_operator.spec.crd import crd, openapi_schema, render
from relaytrain_operator.spec.openapi import Int64, Rule, cel, int_or_string, list_type

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "finetunejobs.relaytrain.io.yaml"
CHART_COPY = REPO / "charts" / "relaytrain" / "files" / "crds" / CRD_PATH.name
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


@pytest.mark.parametrize("path", [CRD_PATH, CHART_COPY], ids=["crds", "chart"])
def test_the_committed_crd_is_the_generators_output(path: Path) -> None:
    assert path.read_text() == render(), (
        f"{path.relative_to(REPO)} is not what the spec models generate: run `make crds`"
    )


def test_the_file_reads_back_as_the_generated_crd() -> None:
    # The YAML's folded text and flow lists are a spelling only: the content is crd()'s.
    assert yaml.safe_load(render()) == crd()
    assert render().startswith("# The FineTuneJob CRD, generated from the pydantic models")


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """(base type without None/Annotated, constraint metadata found on the way)."""
    meta: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            base, *extra = typing.get_args(annotation)
            for item in extra:
                meta.extend(item.metadata if isinstance(item, FieldInfo) else [item])
            annotation = base
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return annotation, meta
            annotation = members[0]
        else:
            return annotation, meta


def _expected_bounds(meta: list[Any], kind: str) -> dict[str, Any]:
    """The CRD keywords the pydantic constraints correspond to."""
    out: dict[str, Any] = {}
    size = {
        "string": ("minLength", "maxLength"),
        "array": ("minItems", "maxItems"),
        "object": ("minProperties", "maxProperties"),
    }.get(kind)
    for item in meta:
        if isinstance(item, at.Ge):
            out["minimum"] = item.ge
        elif isinstance(item, at.Gt):
            out["minimum"], out["exclusiveMinimum"] = item.gt, True
        elif isinstance(item, at.Le):
            out["maximum"] = item.le
        elif isinstance(item, at.Lt):
            out["maximum"], out["exclusiveMaximum"] = item.lt, True
        elif isinstance(item, at.MinLen) and size:
            out[size[0]] = item.min_length
        elif isinstance(item, at.MaxLen) and size:
            out[size[1]] = item.max_length
        elif getattr(item, "pattern", None):
            out["pattern"] = item.pattern
    return out


_BOUND_KEYS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "pattern",
)


def compare(
    annotation: Any, meta: list[Any], node: dict[str, Any], path: str, problems: list[str]
) -> None:
    """Append to `problems` every way `node` (CRD) differs from `annotation` (pydantic)."""
    base, found = _unwrap(annotation)
    meta = meta + found
    origin = typing.get_origin(base)
    # int or "auto", checked by a PlainValidator and CEL
    if path in ("spec.pipeline.stages", "spec.pipeline.replicas", "spec.pipeline.forwardsAhead"):
        if not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: CRD should be int-or-string")
        return
    if isinstance(base, type) and issubclass(base, BaseModel):
        kind = "object"
        compare_model(base, node, path, problems)
    elif origin is typing.Literal:  # of strings, or of integers (pipeline.gradientBits)
        ints = all(type(a) is int for a in typing.get_args(base))
        kind = "integer" if ints else "string"
        if sorted(map(str, typing.get_args(base))) != sorted(map(str, node.get("enum", []))):
            problems.append(f"{path}: enum {typing.get_args(base)} vs CRD {node.get('enum')}")
    elif origin is list:
        kind = "array"
        compare(typing.get_args(base)[0], [], node.get("items", {}), f"{path}[]", problems)
    elif origin is dict:
        kind = "object"
        compare(
            typing.get_args(base)[1],
            [],
            node.get("additionalProperties") or {},
            f"{path}{{}}",
            problems,
        )
    else:
        kind = _SCALARS.get(base, repr(base))
    if node.get("type") != kind:
        problems.append(f"{path}: pydantic {kind} vs CRD type {node.get('type')}")
    want = _expected_bounds(meta, kind)
    have = {k: node[k] for k in _BOUND_KEYS if k in node}
    if want != have:
        problems.append(f"{path}: pydantic bounds {want} vs CRD {have}")


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return {}  # the CRD defaults the object to {} so its own defaults apply
        return value or PydanticUndefined  # an empty list or map needs no CRD default
    return PydanticUndefined if info.default is None else info.default


def compare_model(
    model: type[BaseModel],
    node: dict[str, Any],
    path: str,
    problems: list[str],
    defaults: bool = True,
) -> None:
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    props = node.get("properties", {})
    for name in sorted(set(fields) - set(props)):
        problems.append(f"{path}.{name}: in pydantic, missing from the CRD")
    for name in sorted(set(props) - set(fields)):
        problems.append(f"{path}.{name}: in the CRD, missing from pydantic")
    required = sorted(n for n, info in fields.items() if info.is_required())
    if required != sorted(node.get("required", [])):
        problems.append(f"{path}: required {required} vs CRD {sorted(node.get('required', []))}")
    for name in sorted(set(fields) & set(props)):
        info, sub = fields[name], props[name]
        compare(info.annotation, list(info.metadata), sub, f"{path}.{name}", problems)
        if defaults and not path.startswith("status"):
            want, have = _default(info), sub.get("default", PydanticUndefined)
            if want != have:
                problems.append(f"{path}.{name}: default {want!r} vs CRD {have!r}")


def test_crd_spec_matches_the_pydantic_spec_both_ways() -> None:
    problems: list[str] = []
    compare_model(FineTuneJobSpec, crd_schema()["properties"]["spec"], "spec", problems)
    assert problems == []


def test_crd_status_matches_the_pydantic_status_both_ways() -> None:
    problems: list[str] = []
    compare_model(FineTuneJobStatus, crd_schema()["properties"]["status"], "status", problems)
    assert problems == []


def test_the_comparison_notices_a_field_missing_from_the_crd() -> None:
    node = crd_schema()["properties"]["spec"]
    del node["properties"]["method"]["properties"]["rank"]
    node["properties"]["training"]["properties"]["extra"] = {"type": "string"}
    node["properties"]["pipeline"]["properties"]["compression"]["enum"].remove("int4")
    problems: list[str] = []
    compare_model(FineTuneJobSpec, node, "spec", problems)
    assert any(p.startswith("spec.method.rank: in pydantic") for p in problems)
    assert any(p.startswith("spec.training.extra: in the CRD") for p in problems)
    assert any(p.startswith("spec.pipeline.compression: enum") for p in problems)


def _walk(node: dict[str, Any], path: str) -> typing.Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict) and node["items"].get("type") == "object":
        yield from _walk(node["items"], f"{path}[]")


def test_every_crd_field_has_a_description_for_kubectl_explain() -> None:
    schema = crd_schema()
    missing = [
        path
        for part in ("spec", "status")
        for path, node in _walk(schema["properties"][part], part)
        if not node.get("description", "").strip()
    ]
    assert missing == []


def test_crd_patterns_are_the_ones_pydantic_uses() -> None:
    spec = crd_schema()["properties"]["spec"]["properties"]
    assert spec["model"]["properties"]["uri"]["pattern"] == patterns.MODEL_URI
    for part in ("dataset", "checkpoint", "output"):
        assert spec[part]["properties"]["uri"]["pattern"] == patterns.STORE_URI
    assert spec["checkpoint"]["properties"]["endpoint"]["pattern"] == patterns.ENDPOINT
    name_rule = crd_schema()["x-kubernetes-validations"][0]["rule"]
    assert f"matches('{patterns.JOB_NAME}')" in name_rule
    assert f"<= {patterns.JOB_NAME_MAX}" in name_rule


def test_crd_names_printer_columns_and_status_subresource() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    assert crd["spec"]["names"]["shortNames"] == ["ftj"]
    assert crd["spec"]["names"]["categories"] == ["relaytrain"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    for name in ("Phase", "Step", "Loss", "Ready", "Restarts", "Checkpoint", "Age"):
        assert name in columns
    # Every printer column reads a field the schema declares, or it would print <none>.
    schema = crd_schema()
    for path in columns.values():
        if path.startswith(".metadata"):
            continue
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]


def _nodes(node: Any, path: str = "") -> typing.Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node under `node`, with its path."""
    if not isinstance(node, dict):
        return
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _nodes(node[key], f"{path}[]")


def test_the_schema_is_structural() -> None:
    # What the API server refuses or prunes in a CRD, and what pydantic's dialect has.
    problems = []
    for path, node in _nodes(crd_schema()):
        for key in ("$ref", "anyOf", "allOf", "oneOf", "title", "const", "nullable"):
            if key in node:
                problems.append(f"{path}: {key}")
        if "additionalProperties" in node and not isinstance(node["additionalProperties"], dict):
            problems.append(f"{path}: additionalProperties {node['additionalProperties']}")
        if "type" not in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: no type")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and node[key] is not True:
                problems.append(f"{path}: {key} {node[key]!r} (OpenAPI v3.0 spells it true)")
        problems += [f"{path}: {key}" for key in node if key.startswith("x-relaytrain")]
    assert problems == []


def test_every_cel_rule_is_kept_where_it_was() -> None:
    # The API server's own checks (tests/k8s/test_crd_api.py runs each): where they sit and
    # which field each names. Losing one in a refactor of the models fails here.
    where = sorted(
        (path or ".", rule.get("fieldPath", ""))
        for path, node in _nodes(crd_schema())
        for rule in node.get("x-kubernetes-validations", [])
    )
    fixed = ("model", "dataset", "method", "training", "pipeline", "checkpoint.uri")
    assert where == sorted(
        [
            (".", ""),  # metadata.name
            *((".", f".spec.{field}") for field in fixed),
            (".spec", ".pipeline.replicas"),
            (".spec", ".pipeline.sync.loraMerge"),
            (".spec", ".training.evalEverySteps"),
            (".spec.dataset.validation", ".uri"),
            (".spec.training", ".steps"),
            (".spec.training", ".warmupSteps"),
            (".spec.training", ".endOfData"),
            (".spec.pipeline", ".gradientTokens"),
            (".spec.pipeline", ".gradientFill"),
            (".spec.pipeline", ".gradientBits"),
            (".spec.pipeline", ".activationError"),
            (".spec.pipeline", ".activationBasis"),
            (".spec.pipeline.stages", ""),
            (".spec.pipeline.replicas", ""),
            (".spec.pipeline.forwardsAhead", ""),
            (".spec.pipeline.sync", ".everySteps"),
            (".spec.pipeline.sync", ".outerCode"),
            (".spec.checkpoint", ".endpoint"),
            (".spec.checkpoint", ".credentialsSecret"),
        ]
    )
    for rule in crd_schema()["x-kubernetes-validations"][1:]:
        assert rule["rule"].startswith("!has(oldSelf.status) || !has(oldSelf.status.startTime)")
        assert rule["reason"] == "FieldValueForbidden"


class _Extra(BaseModel):
    """An object with a rule."""

    model_config = ConfigDict(
        alias_generator=lambda name: name.replace("_c", "C"),
        json_schema_extra=cel(Rule("self.aCount >= 0", "no.", field=".aCount")),
        use_attribute_docstrings=True,
    )

    a_count: Int64 = 3
    """A `count`."""
    size: Annotated[int | Literal["auto"], Field(json_schema_extra=int_or_string())] = "auto"
    """A size."""
    names: Annotated[list[str], Field(json_schema_extra=list_type("map", "x"))] = Field(
        default_factory=lambda: ["a"]
    )
    """Names."""
    limit: Annotated[float, Field(gt=0, lt=1)] | None = None
    """A share."""


def test_a_field_and_what_is_written_on_it_reach_the_schema() -> None:
    # One edit to a model is one edit to the CRD: its type, default, bounds, docstring and the
    # CRD-only facts written on it (spec.openapi).
    schema = openapi_schema(_Extra)
    assert schema == {
        "type": "object",
        "description": "An object with a rule.",
        "x-kubernetes-validations": [
            {"rule": "self.aCount >= 0", "message": "no.", "fieldPath": ".aCount"}
        ],
        "properties": {
            "aCount": {
                "type": "integer",
                "format": "int64",
                "default": 3,
                "description": "A count.",
            },
            "size": {
                "x-kubernetes-int-or-string": True,
                "default": "auto",
                "description": "A size.",
            },
            "names": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["x"],
                "default": ["a"],
                "description": "Names.",
                "items": {"type": "string"},
            },
            "limit": {
                "type": "number",
                "minimum": 0,
                "exclusiveMinimum": True,
                "maximum": 1,
                "exclusiveMaximum": True,
                "description": "A share.",
            },
        },
    }
    assert "default" not in openapi_schema(_Extra, defaults=False)["properties"]["aCount"]
