"""The one spelling of every document the two sides share: camelCase keys, snake_case
attributes.

The FineTuneJob spec and status models (relaytrain_operator.spec), the stage document and
progress.json (this package) all use it: every field has its camelCase alias, Python code
reads and builds a model by the snake_case names (`cfg.stage.layer_start`), JSON is read by
the aliases (`stage.layerStart`), and a model dumps by alias, so the JSON a log or a test
shows is what travels. Error paths name the aliases, the document's own words.
"""

from __future__ import annotations

from pydantic import ConfigDict
from pydantic.alias_generators import to_camel

__all__ = ["CAMEL_CASE"]

CAMEL_CASE = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    serialize_by_alias=True,
)
"""Merged into a model's config: `ConfigDict(**CAMEL_CASE, extra="forbid", ...)`."""
