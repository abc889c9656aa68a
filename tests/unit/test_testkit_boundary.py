"""The test toolkit stays out of the product: the wheel's packages (setuptools' find, as
pyproject.toml configures it) leave relaytrain_testkit out, and nothing in bench/, hack/ or
a test module imports from tests/ (what they share is relaytrain_testkit's; conftest.py
fixtures aside)."""

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
