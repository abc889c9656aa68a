"""The Helm chart without helm: its CRD copy, its values and their schema, its templates.

Rendering, `helm lint` and applying the rendered RBAC are in tests/k8s/test_chart_rbac.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "relaytrain"


def test_chart_crd_copy_equals_the_source() -> None:
    # `make crds` writes both from the spec models (tests/unit/test_crd_schema.py).
    sources = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    copies = sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml"))
    assert copies == sources
    for name in sources:
        source = (REPO / "crds" / name).read_text()
        assert (CHART / "files" / "crds" / name).read_text() == source, (
            f"charts/relaytrain/files/crds/{name} differs from crds/{name}: run make crds"
        )


def test_chart_has_no_crds_folder_that_helm_would_install_unconditionally() -> None:
    # Helm installs crds/ on every install, ignoring crds.enabled and crds.keep.
    assert not (CHART / "crds").exists()


def _check_documented(values: Any, schema: dict[str, Any], path: str, problems: list[str]) -> None:
    if not schema.get("description"):
        problems.append(f"{path or '<root>'}: no description")
    props = schema.get("properties")
    if props is None:
        return  # a free-form map (annotations, resources, ...)
    if schema.get("additionalProperties") is not False:
        problems.append(f"{path or '<root>'}: additionalProperties must be false")
    assert isinstance(values, dict), path
    for key in sorted(set(values) - set(props)):
        problems.append(f"{path}.{key}: in values.yaml, missing from values.schema.json")
    for key in sorted(set(props) - set(values)):
        problems.append(f"{path}.{key}: in values.schema.json, missing from values.yaml")
    for key in sorted(set(values) & set(props)):
        _check_documented(values[key], props[key], f"{path}.{key}" if path else key, problems)


def test_every_value_is_in_the_schema_with_a_description() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    schema.setdefault("description", "values")
    problems: list[str] = []
    _check_documented(values, schema, "", problems)
    assert problems == []


def test_crd_switches_default_to_install_and_keep() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["crds"] == {"enabled": True, "keep": True}
    template = (CHART / "templates" / "crd.yaml").read_text()
    assert "helm.sh/resource-policy" in template and "files/crds/" in template


def test_one_resource_kind_per_template_file() -> None:
    for path in sorted((CHART / "templates").glob("*.yaml")):
        kinds = set(re.findall(r"^kind: (\w+)", path.read_text(), flags=re.MULTILINE))
        assert len(kinds) <= 1, f"{path.name} declares {sorted(kinds)}"


def test_helpers_are_prefixed_with_the_chart_name() -> None:
    names: list[str] = []
    for path in (CHART / "templates").glob("*.tpl"):
        names += re.findall(r'define "([^"]+)"', path.read_text())
    assert names
    assert [n for n in names if not n.startswith("relaytrain.")] == []


def test_the_operator_runs_as_the_python_module_non_root() -> None:
    text = (CHART / "templates" / "deployment.yaml").read_text()
    assert 'command: ["python", "-m", "relaytrain_operator"]' in text
    assert "runAsNonRoot: true" in text and "readOnlyRootFilesystem: true" in text
    assert "type: Recreate" in text  # never two standalone operators at once
