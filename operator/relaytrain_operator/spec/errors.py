"""SpecError: a rejected FineTuneJob, each problem named by its field path.

pydantic's own messages say what is wrong; relaytrain_contract.errors says *where*
(`spec.placement.tolerations[0].effect`), as for a stage document; this module adds, for
unknown fields, which names would be valid and, for patterns, what they mean — the things a
user needs to fix the YAML.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from relaytrain_contract.errors import field_error, field_path, problem

from relaytrain_operator.spec.patterns import HINTS

__all__ = ["SpecError", "field_error", "format_errors"]


class SpecError(ValueError):
    """A FineTuneJob that is not valid; `problems` lists (field path, what is wrong)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__(
            "; ".join(f"{path}: {message}" if path else message for path, message in problems)
        )

    @property
    def paths(self) -> list[str]:
        """The field paths named, in order (e.g. `spec.method.rank`)."""
        return [path for path, _ in self.problems]


def format_errors(exc: ValidationError, root: type[BaseModel]) -> list[tuple[str, str]]:
    """Turn pydantic's errors into (path, message) pairs in manifest terms."""
    problems: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc, message = problem(err)
        if err["type"] == "extra_forbidden":
            valid = _field_names(_model_at(root, loc[:-1]))
            message += f"; valid fields here: {', '.join(valid)}" if valid else ""
        elif err["type"] == "string_pattern_mismatch":
            pattern = str((err.get("ctx") or {}).get("pattern", ""))
            message = HINTS.get(pattern, str(err["msg"])) + f" (got {err.get('input')!r})"
        problems.append((field_path(loc), message))
    return problems


def _field_names(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return sorted(info.alias or name for name, info in model.model_fields.items())


def _model_at(root: type[BaseModel], loc: list[Any]) -> type[BaseModel] | None:
    """The model class that validates the object at `loc` (None if not a model)."""
    current: Any = root
    for part in loc:
        if isinstance(part, int):
            current = _element(current)
            continue
        model = _as_model(current)
        if model is None:
            return None
        info = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if info is None:
            return None
        current = info.annotation
    return _as_model(current)


def _unwrap(annotation: Any) -> list[Any]:
    """Members of a union / Optional, with Annotated metadata stripped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _unwrap(arg)]
    return [annotation]


def _as_model(annotation: Any) -> type[BaseModel] | None:
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _element(annotation: Any) -> Any:
    for member in _unwrap(annotation):
        if typing.get_origin(member) is list:
            return typing.get_args(member)[0]
    return None
