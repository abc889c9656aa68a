"""The per-job Secret that holds the link PKI: the CA certificate, each stage's cert and key."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from relaytrain_operator.domain.builders.labels import child_metadata, link_secret_name


def build_link_secret(job: dict[str, Any], files: Mapping[str, str]) -> dict[str, Any]:
    """A Secret holding `files` (file name -> PEM, from `linkcerts.mint_link_credentials`,
    minted by the caller so this stays pure).

    It is created once and never rewritten: a second create answers 409 and the first
    certificates stay, so every stage of one job, replacements included, shares one CA.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(job, link_secret_name(job["metadata"]["name"])),
        "data": {name: base64.b64encode(pem.encode()).decode() for name, pem in files.items()},
    }
