"""The packages' layers: folders that are layers, small modules, and layer contracts that
catch an import going up a layer from any module.

`lint-imports` (run over the real tree by the lint target) keeps every contract; this proves
the top ones can fail: each package's top contract, as pyproject.toml states it, is run over
a tiny package laid out like it, first clean, then with a module the contract does not name
(as a new module would be) importing a layer above its own. The worker: one pipeline apart
from several; the operator: the domain below the reconcile loop and the command line.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "worker_image" / "relaytrain_worker"
OPERATOR = REPO / "operator" / "relaytrain_operator"
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGE = "layered"


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [dict(c) for c in config["contracts"]]


def _worker_layers() -> dict[str, Any]:
    (top,) = [
        c
        for c in _contracts()
        if c["type"] == "layers" and c.get("containers") == ["relaytrain_worker"]
    ]
    return top


def _operator_layers() -> dict[str, Any]:
    """The operator's top contract, written with full names, as one over its container."""
    (top,) = [
        c
        for c in _contracts()
        if c["type"] == "layers"
        and "containers" not in c
        and all(layer.startswith("relaytrain_operator.") for layer in c["layers"])
    ]
    short = [layer.replace("relaytrain_operator.", "") for layer in top["layers"]]
    return {**top, "layers": short}


def _tree(root: Path, layers: list[str], down: tuple[str, str]) -> None:
    """A package with one subpackage per layer (`__main__` a module), each with a module, and
    one import down a layer (`down`: from, to) as the real package has."""
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for layer in layers:
        for part in layer.replace(":", "|").split("|"):
            name = part.strip()
            if name == "__main__":
                (pkg / "__main__.py").write_text(f"import {PACKAGE}.process.core\n")
                continue
            (pkg / name).mkdir()
            (pkg / name / "__init__.py").write_text("")
            (pkg / name / "core.py").write_text("")
    upper, lower = down
    (pkg / upper / "core.py").write_text(f"import {PACKAGE}.{lower}.core\n")


def _lint(root: Path, contract: dict[str, Any]) -> tuple[int, str]:
    contract = {**contract, "containers": [PACKAGE]}
    layers = ", ".join(f'"{layer}"' for layer in contract["layers"])
    config = root / "contracts.toml"
    config.write_text(
        f'[tool.importlinter]\nroot_packages = ["{PACKAGE}"]\n\n'
        f"[[tool.importlinter.contracts]]\nname = {contract['name']!r}\n"
        f'type = "layers"\ncontainers = ["{PACKAGE}"]\nlayers = [{layers}]\n'
    )
    done = subprocess.run(
        [str(LINT), "--config", str(config), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def test_the_worker_layers_are_the_packages_from_the_process_down_to_the_model() -> None:
    layers = [layer.replace(" ", "") for layer in _worker_layers()["layers"]]
    assert layers == ["__main__", "process", "replicas", "pipeline", "state", "model"]


def test_a_single_pipeline_module_importing_the_replicas_breaks_the_worker_layers(
    tmp_path: Path,
) -> None:
    contract = _worker_layers()
    _tree(tmp_path, contract["layers"], down=("replicas", "pipeline"))  # several use one
    code, out = _lint(tmp_path, contract)
    assert code == 0, out
    assert f"{contract['name']} KEPT" in out

    # A module no contract names, placed in the single pipeline, reaching up a layer.
    fresh = tmp_path / PACKAGE / "pipeline" / "fresh.py"
    fresh.write_text(f"from {PACKAGE}.replicas import core\n")
    code, out = _lint(tmp_path, contract)
    assert code == 1, out
    assert f"{contract['name']} BROKEN" in out
    assert f"{PACKAGE}.pipeline.fresh -> {PACKAGE}.replicas.core" in out


def test_the_operator_layers_are_the_loop_and_cli_over_the_domain_over_the_api() -> None:
    layers = [layer.replace(" ", "") for layer in _operator_layers()["layers"]]
    assert layers == ["cli|loop", "store|domain", "spec"]


def test_a_domain_module_importing_the_loop_breaks_the_operator_layers(tmp_path: Path) -> None:
    contract = _operator_layers()
    _tree(tmp_path, contract["layers"], down=("loop", "domain"))
    code, out = _lint(tmp_path, contract)
    assert code == 0, out
    assert f"{contract['name']} KEPT" in out

    fresh = tmp_path / PACKAGE / "domain" / "fresh.py"
    fresh.write_text(f"from {PACKAGE}.loop import core\n")
    code, out = _lint(tmp_path, contract)
    assert code == 1, out
    assert f"{contract['name']} BROKEN" in out
    assert f"{PACKAGE}.domain.fresh -> {PACKAGE}.loop.core" in out


@pytest.mark.parametrize("package", [WORKER, OPERATOR], ids=["worker", "operator"])
def test_no_module_is_over_500_lines(package: Path) -> None:
    lines = {
        str(p.relative_to(package)): len(p.read_text().splitlines()) for p in package.rglob("*.py")
    }
    assert len(lines) > 30
    assert {name: n for name, n in lines.items() if n > 500} == {}


def test_the_single_pipeline_stage_names_no_replica_group_or_periodic_sync() -> None:
    """pipeline/stage.py reaches other pipelines only through its replication hooks: no
    name in it is of replicas, groups, members or periodic sync (the stage module before
    the split had fifteen)."""
    tree = ast.parse((WORKER / "pipeline" / "stage.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.alias):
            names.add(node.name)
    multi = re.compile(r"replica(?!tion)|group|periodic|member|leader|joined|rejoin", re.I)
    assert "replication" in names
    assert sorted(n for n in names if multi.search(n)) == []
