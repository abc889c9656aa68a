"""Which tests need torch: `make test-fast` runs every test that needs no cluster, no MinIO
and no torch. The tier markers (k8s, e2e) say the first two; tests/conftest.py puts `torch` on
every test whose module imports torch, transformers or peft, directly or through the
project's own modules. Their sources are read, not imported, so collection stays fast.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from relaytrain_testkit import REPO

_HEAVY = frozenset({"torch", "transformers", "peft", "bitsandbytes", "accelerate"})
_ROOTS = [REPO / "operator", REPO / "worker_image", REPO / "testkit", REPO]


def _module_file(name: str) -> Path | None:
    for root in _ROOTS:
        base = root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.cache
def _imports(path: Path, *, everywhere: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    root = next(r for r in _ROOTS if path.is_relative_to(r))
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*parts, *(node.module or "").split(".")]).strip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


_heavy_modules: dict[str, bool] = {}


def _pulls_torch(name: str, seen: set[str]) -> bool:
    if name in _heavy_modules:
        return _heavy_modules[name]
    if name.split(".", maxsplit=1)[0] in _HEAVY:
        return True
    path = _module_file(name)
    if path is None or name in seen:
        return False
    seen.add(name)
    found = any(_pulls_torch(dep, seen) for dep in _imports(path, everywhere=False))
    _heavy_modules[name] = found
    return found


@functools.cache
def needs_torch(test_file: Path) -> bool:
    """Whether a test module imports torch (anywhere in it, or through what it imports)."""
    return any(_pulls_torch(dep, set()) for dep in _imports(test_file, everywhere=True))


@functools.cache
def can_select(markexpr: str, marker: str) -> bool:
    """Whether the `-m` expression `markexpr` selects some test that carries `marker`, whatever
    other markers it carries too. `make test-fast`'s "... and not torch" selects none, so the
    session need not import (collect) a module that needs torch: 12 of its 30 s of collection.
    """
    if not markexpr:
        return True
    # pytest has no public parser of -m expressions; this is the one `-m` itself uses.
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    named = sorted(set(re.findall(r"[A-Za-z_][\w.]*", markexpr)) - {"and", "or", "not", marker})
    for bits in range(2 ** len(named)):
        carried = {marker} | {name for i, name in enumerate(named) if bits >> i & 1}
        if expression.evaluate(functools.partial(_carries, carried)):
            return True
    return False


def _carries(carried: set[str], name: str, /, **_: object) -> bool:
    return name in carried
