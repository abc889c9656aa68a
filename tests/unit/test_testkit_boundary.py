"""The test toolkit stays out of the product: the wheel's packages (setuptools' find, as
pyproject.toml configures it) leave relaytrain_testkit out, and nothing in bench/, hack/ or
a test module imports from tests/ (what they share is relaytrain_testkit's; conftest.py
fixtures aside). Tests build FineTuneJobs with one builder (relaytrain_testkit.jobs): no test
or testkit module spells a job manifest out."""

from __future__ import annotations

import ast
import tomllib

import pytest
from relaytrain_testkit import REPO
from setuptools import find_packages

pytestmark = pytest.mark.unit


def wheel_packages(where: list[str] | None = None) -> set[str]:
    """The packages `pip wheel .` puts in the wheel: pyproject.toml's
    `[tool.setuptools.packages.find]`, run over its folders (or over `where`)."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found: set[str] = set()
    for folder in where or find["find"]["where"]:
        found.update(find_packages(where=str(REPO / folder), include=find["find"]["include"]))
    return found


def imports_of(source: str, filename: str = "<source>") -> set[str]:
    """Every module `source` imports, at any depth (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imports_tests(source: str, filename: str = "<source>") -> list[str]:
    return sorted(n for n in imports_of(source, filename) if n.split(".")[0] == "tests")


def test_the_wheel_holds_the_product_packages_and_not_the_testkit() -> None:
    packages = wheel_packages()
    assert {"relaytrain_contract", "relaytrain_operator", "relaytrain_worker"} <= packages
    assert not [p for p in packages if p.split(".")[0] == "relaytrain_testkit"]
    assert "relaytrain_worker.testing" not in packages
    assert not list((REPO / "worker_image" / "relaytrain_worker").rglob("testing.py"))


def test_the_wheel_check_would_see_the_testkit_if_it_were_found() -> None:
    # The include list is what keeps it out: run over testkit/ itself, it finds nothing,
    # where an include pattern for it finds it.
    assert (REPO / "testkit" / "relaytrain_testkit" / "__init__.py").is_file()
    assert wheel_packages(["testkit"]) == set()
    assert "relaytrain_testkit" in find_packages(where=str(REPO / "testkit"))


@pytest.mark.parametrize("folder", ["bench", "hack"])
def test_bench_and_hack_never_import_tests(folder: str) -> None:
    files = sorted((REPO / folder).rglob("*.py"))
    assert files
    offenders = {
        str(f.relative_to(REPO)): found
        for f in files
        if (found := imports_tests(f.read_text(), str(f)))
    }
    assert offenders == {}


def test_no_test_module_imports_another() -> None:
    files = [f for f in sorted((REPO / "tests").rglob("*.py")) if f.name != "conftest.py"]
    assert len(files) > 50
    offenders = {
        str(f.relative_to(REPO)): found
        for f in files
        if (found := imports_tests(f.read_text(), str(f)))
    }
    assert offenders == {}


def test_the_import_reader_sees_imports_at_any_depth() -> None:
    source = "import os\n\ndef f():\n    from tests.unit.x import y\n    import tests.harness\n"
    assert imports_tests(source) == ["tests.harness", "tests.unit.x"]
    assert imports_tests("from relaytrain_testkit import tiny_models\nimport testsuite\n") == []


def _keys(node: ast.Dict) -> dict[str, ast.expr]:
    return {
        k.value: v
        for k, v in zip(node.keys, node.values, strict=True)
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


def manifest_literals(source: str, filename: str = "<source>") -> list[int]:
    """The lines where `source` spells a FineTuneJob out as a dict: a literal with kind
    FineTuneJob and a metadata or spec, or a literal spec naming a model, dataset or
    training."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Dict):
            continue
        fields = _keys(node)
        kind, spec = fields.get("kind"), fields.get("spec")
        a_job = isinstance(kind, ast.Constant) and kind.value == "FineTuneJob"
        a_spec = isinstance(spec, ast.Dict) and {"model", "dataset", "training"} & set(_keys(spec))
        if (a_job and {"metadata", "spec"} & fields.keys()) or a_spec:
            found.append(node.lineno)
    return found


def test_tests_build_jobs_with_the_one_builder() -> None:
    builder = REPO / "testkit" / "relaytrain_testkit" / "jobs.py"
    files = sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "testkit").rglob("*.py")])
    assert builder in files
    offenders = {
        str(f.relative_to(REPO)): found
        for f in files
        if f != builder and (found := manifest_literals(f.read_text(), str(f)))
    }
    assert offenders == {}


def test_the_builder_check_sees_a_job_spelt_out() -> None:
    job = '{"apiVersion": "relaytrain.io/v1alpha1", "kind": "FineTuneJob", "metadata": {}}'
    spec = '{"spec": {"model": {"uri": "s3://m/"}}}'
    owner = '{"apiVersion": "relaytrain.io/v1alpha1", "kind": "FineTuneJob", "name": "j"}'
    pod = '{"spec": {"containers": []}}'
    assert manifest_literals(f"a = {job}\nb = {spec}\nc = {owner}\nd = {pod}\n") == [1, 2]
