"""The FineTuneJob CustomResourceDefinition, generated from the spec and status models.

The API is defined once, by the pydantic models in this package: `crd()` turns their JSON
schema into the structural OpenAPI v3 schema the API server wants ($refs inlined, titles
dropped, optional fields simply not required, bounds in OpenAPI 3.0's spelling, docstrings as
descriptions for `kubectl explain`) and adds what belongs to the CRD rather than to a field:
names, printer columns, the status subresource. What a field's type cannot say (CEL rules,
list types, int-or-string, formats) is written on the model or field (spec.openapi).

`make crds` (`python -m relaytrain_operator.spec.crd CRD_FILE CHART_COPY`) writes
crds/finetunejobs.relaytrain.io.yaml and the chart's copy; tests/unit/test_crd_schema.py
checks the committed files are this output, byte for byte.

Defaults: a field's default is the CRD's, so the API server stores what parse_job would
fill in; a section that defaults to its model (`method`, `pipeline`...) defaults to `{}`
(the server then applies the section's own defaults), and an empty list or map needs none.
The status is written whole by the operator, so its schema carries no defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, NoDefault
from pydantic_core import core_schema

from relaytrain_operator.spec.job import API_VERSION, KIND, FineTuneJob
from relaytrain_operator.spec.openapi import FIXED_ONCE_STARTED, Rule
from relaytrain_operator.spec.status import FineTuneJobStatus

__all__ = ["crd", "openapi_schema", "render"]

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "finetunejobs"
HEADER = """\
# The FineTuneJob CRD, generated from the pydantic models in operator/relaytrain_operator/spec/
# by `make crds` (python -m relaytrain_operator.spec.crd): do not edit; change the models and
# run `make crds`, which also writes the chart's copy (charts/relaytrain/files/crds/).
"""

# What `kubectl get ftj` shows (`-o wide` adds the priority-1 columns).
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Phase",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "Pending, Planning, Running, Recovering, Succeeded, Failed or Suspended.",
    },
    {
        "name": "Step",
        "type": "string",
        "jsonPath": ".status.progress.stepOfTotal",
        "description": "Finished optimizer steps of the total.",
    },
    {
        "name": "Loss",
        "type": "number",
        "jsonPath": ".status.progress.loss",
        "description": "Training loss at the last step.",
    },
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": ".status.readyStages",
        "description": "Ready stage pods of all stages.",
    },
    {
        "name": "Pipelines",
        "type": "string",
        "jsonPath": ".status.readyPipelines",
        "description": "Training pipelines of all pipelines (jobs that train several).",
    },
    {
        "name": "Epoch",
        "type": "number",
        "jsonPath": ".status.progress.epoch",
        "description": "Passes over the training data so far (1.5: halfway through the second).",
    },
    {
        "name": "Eval Loss",
        "type": "number",
        "jsonPath": ".status.progress.evalLoss",
        "description": "Held-out loss at the last evaluation (jobs with dataset.validation).",
    },
    {
        "name": "Restarts",
        "type": "integer",
        "jsonPath": ".status.restarts",
        "description": "Stage pod replacements, all stages together.",
    },
    {
        "name": "Checkpoint",
        "type": "integer",
        "jsonPath": ".status.progress.lastCommittedStep",
        "description": "Step of the newest committed checkpoint.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Tokens/s",
        "type": "number",
        "jsonPath": ".status.progress.tokensPerSecond",
        "description": "Measured training throughput.",
        "priority": 1,
    },
    {
        "name": "Method",
        "type": "string",
        "jsonPath": ".spec.method.type",
        "description": "lora, qlora or full.",
        "priority": 1,
    },
    {
        "name": "Model",
        "type": "string",
        "jsonPath": ".spec.model.uri",
        "description": "The base model.",
        "priority": 1,
    },
]

# The order keys are written in, so the file reads: what a value is, then its parts.
_KEY_ORDER = [
    "type",
    "format",
    "x-kubernetes-int-or-string",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "default",
    "description",
    "required",
    "x-kubernetes-validations",
    "properties",
    "items",
    "additionalProperties",
    FIXED_ONCE_STARTED,  # removed again by root_schema
]


class _Generator(GenerateJsonSchema):
    """pydantic's JSON schema, its keys in the order written (not sorted)."""

    def sort(self, value: JsonSchemaValue, parent_key: str | None = None) -> JsonSchemaValue:
        return value


class _WithDefaults(_Generator):
    """pydantic's JSON schema with the CRD's defaults: a default factory's value too (a
    model's as `{}`, an empty container as none), and no `null` default."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        if "default_factory" in schema:
            value = schema["default_factory"]()  # type: ignore[call-arg]
            if isinstance(value, BaseModel):
                return {}
            return value if value else NoDefault
        default = schema.get("default", NoDefault)
        return NoDefault if default is None else default


class _WithoutDefaults(_Generator):
    """pydantic's JSON schema without defaults (the status)."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        return NoDefault


def openapi_schema(model: type[BaseModel], *, defaults: bool = True) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of `model` as a manifest spells it (camelCase)."""
    generator = _WithDefaults if defaults else _WithoutDefaults
    raw = model.model_json_schema(by_alias=True, schema_generator=generator)
    definitions = raw.pop("$defs", {})
    return _structural(raw, definitions)


def _structural(node: JsonSchemaValue, definitions: dict[str, Any]) -> dict[str, Any]:
    """One JSON Schema node (pydantic's dialect) as a structural OpenAPI v3 node."""
    node = dict(node)
    if "$ref" in node:
        resolved = definitions[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**resolved, **node}  # the field's description wins over the model's
    if node.get("x-kubernetes-int-or-string"):
        node.pop("anyOf", None)  # int | str: the one union a structural schema has
    if "anyOf" in node:
        members = [m for m in node.pop("anyOf") if m != {"type": "null"}]
        if len(members) != 1:
            raise ValueError(f"a union other than X | None has no structural schema: {members}")
        node = {**members[0], **node}
        return _structural(node, definitions)  # the member may be a $ref
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "additionalProperties") and not isinstance(value, dict):
            continue  # no titles; `additionalProperties: false` is structural's default
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "description":
            out[key] = describe(value)
        elif key == "properties":
            out[key] = {name: _structural(sub, definitions) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, definitions)
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if "type" not in out and not out.get("x-kubernetes-int-or-string"):
        raise ValueError(f"a schema node without a type: {out}")
    return {key: out[key] for key in sorted(out, key=_KEY_ORDER.index)}


def describe(text: str) -> str:
    """A docstring as a `kubectl explain` description: one paragraph, no Markdown quotes."""
    return " ".join(text.replace("`", "").split())


def _fixed_once_started(node: dict[str, Any], path: str) -> list[Rule]:
    """The transition rules of the fields marked `fixed_once_started` under `node` (at
    `path`), each mark removed."""
    rules: list[Rule] = []
    for name, sub in node.get("properties", {}).items():
        field = f"{path}.{name}"
        why = sub.pop(FIXED_ONCE_STARTED, None)
        if why is not None:
            rules.append(
                Rule(
                    f"!has(oldSelf.status) || !has(oldSelf.status.startTime) || "
                    f"self{field} == oldSelf{field}",
                    f"{field[1:]} cannot change once the job has started (status.startTime "
                    f"is set); {why}.",
                    field=field,
                    reason="FieldValueForbidden",
                )
            )
        rules += _fixed_once_started(sub, field)
    return rules


def root_schema() -> dict[str, Any]:
    """The schema of a whole FineTuneJob object: the envelope the API server owns, the spec,
    the status, and the rules that see several of them."""
    schema = openapi_schema(FineTuneJob)
    properties = schema["properties"]
    for key in ("apiVersion", "kind"):
        properties[key] = {"type": "string", "description": properties[key]["description"]}
    properties["metadata"] = {"type": "object"}  # the API server's own schema applies
    properties["status"] = openapi_schema(FineTuneJobStatus, defaults=False)
    schema["required"] = ["spec"]  # the envelope is the API server's to require
    rules = [rule.as_json() for rule in _fixed_once_started(properties["spec"], ".spec")]
    schema["x-kubernetes-validations"] = schema.get("x-kubernetes-validations", []) + rules
    return schema


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition, as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {
                "app.kubernetes.io/name": "relaytrain",
                "app.kubernetes.io/component": "crd",
            },
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["ftj"],
                "categories": ["relaytrain"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root_schema()},
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """YAML as people write it: lists indented under their key, lists of plain values on
    one line, long text folded."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = ">" if len(value) > 50 and "\n" not in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.Node:
    flow = all(not isinstance(item, dict | list) for item in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_Dumper.add_representer(str, _text)
_Dumper.add_representer(list, _list)


def render() -> str:
    """The CRD file: a header saying how it is made, then the CRD as YAML."""
    body = yaml.dump(crd(), Dumper=_Dumper, sort_keys=False, width=96, allow_unicode=True)
    return HEADER + body


def main(argv: list[str]) -> int:
    """Write the CRD to every path named (`make crds`)."""
    if not argv:
        print("usage: python -m relaytrain_operator.spec.crd FILE...", file=sys.stderr)
        return 2
    text = render()
    for name in argv:
        path = Path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
