"""The per-job Secret that authenticates the links between stages."""

from __future__ import annotations

import base64
from typing import Any

from relaytrain_operator.builders.labels import LINK_SECRET_KEY, child_metadata, link_secret_name


def build_link_secret(job: dict[str, Any], key: str) -> dict[str, Any]:
    """A Secret holding `key` (random, chosen by the caller so this stays pure).

    It is created once and never rewritten: a second create answers 409 and the first
    key stays, so every stage of one job, replacements included, shares it.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(job, link_secret_name(job["metadata"]["name"])),
        "data": {LINK_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }
