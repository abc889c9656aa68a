"""Validation errors in the words a user fixes a document by: `field.path: what is wrong`.

pydantic says what is wrong; `problem` says where, as a dotted field path (`training.steps`,
`tolerations[0].effect`). The stage contract raises ConfigError with it; the operator's
FineTuneJob errors (relaytrain_operator.spec.errors) build on the same two functions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

FIELD_ERROR = "relaytrain_field"
"""pydantic error type of `field_error`."""


class ConfigError(ValueError):
    """A stage document (or progress record) that is not valid; the message names each field
    path (`training.steps: ...`) and what is wrong with it."""


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error of a cross-field check, reported at `<model path>.<field>`."""
    return PydanticCustomError(
        FIELD_ERROR, "{field}: {message}", {"field": field, "message": message}
    )


def problem(err: ErrorDetails) -> tuple[list[str | int], str]:
    """Where one pydantic error is (its location, a `field_error`'s field included) and what
    it says: `required`, `unknown field`, or pydantic's message with the value it got."""
    loc = list(err["loc"])
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    if err["type"] == FIELD_ERROR:
        return [*loc, str(ctx["field"])], str(ctx["message"])
    if err["type"] == "missing":
        return loc, "required"
    if err["type"] == "extra_forbidden":
        return loc, "unknown field"
    message = str(err["msg"]).removeprefix("Value error, ").replace("Input should be", "should be")
    value = err.get("input")
    if isinstance(value, str | int | float | bool) and "got" not in message:
        message += f" (got {value!r})"
    return loc, message


def field_path(loc: Sequence[str | int]) -> str:
    """`("tolerations", 0, "effect")` → `tolerations[0].effect`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def config_error(exc: ValidationError, what: str) -> ConfigError:
    """pydantic's errors as one ConfigError: `path: message` for each, `; `-joined (`what`
    stands for the path of an error about the whole document)."""
    problems = []
    for err in exc.errors(include_url=False):
        loc, message = problem(err)
        problems.append(f"{field_path(loc) or what}: {message}")
    return ConfigError("; ".join(problems))


M = TypeVar("M", bound=BaseModel)


def parse_json(model: type[M], document: str | bytes | dict[str, Any], what: str) -> M:
    """`document` (JSON text, or a dict as parsed from it) validated as `model`; one
    ConfigError naming the field of every problem (`what` for the whole document)."""
    text = json.dumps(document) if isinstance(document, dict) else document
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise config_error(exc, what) from None
