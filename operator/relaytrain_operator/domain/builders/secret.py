"""The per-job Secret that holds the link PKI: the CA certificate, each stage's cert and key."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from relaytrain_operator.domain.builders.labels import child_metadata, link_secret_name


def build_link_secret(
    job: dict[str, Any],
    files: Mapping[str, str],
    annotations: Mapping[str, str],
    resource_version: str | None = None,
) -> dict[str, Any]:
    """A Secret holding `files` (file name -> PEM, from `linkcerts.mint_link_credentials` or
    `linkcerts.renewed_files`, minted by the caller so this stays pure), with `annotations`
    (`linkcerts.state_annotations`: where a renewal stands).

    Created once per job: a second create answers 409 and the first certificates stay, so
    every stage of one job, replacements included, shares one CA. A renewal replaces it
    with `resource_version`, the version it was read at: a Secret changed since is not
    overwritten (the API server answers 409 and the next pass reads it again).
    """
    metadata = child_metadata(job, link_secret_name(job["metadata"]["name"]))
    metadata["annotations"] = dict(annotations)
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "data": {name: base64.b64encode(pem.encode()).decode() for name, pem in files.items()},
    }


def secret_files(secret: Mapping[str, Any]) -> dict[str, str]:
    """The files of a Secret as read from the API server (base64 decoded)."""
    data = secret.get("data") or {}
    return {name: base64.b64decode(value).decode() for name, value in data.items()}
