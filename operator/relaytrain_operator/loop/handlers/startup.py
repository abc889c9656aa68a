"""The one startup handler: every kopf setting, the API client, the metrics endpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import kopf
import yaml
from kubernetes import config

from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.domain.planner import DEFAULT_CATALOG, Catalog
from relaytrain_operator.loop import metrics
from relaytrain_operator.loop.apply import ClusterApi
from relaytrain_operator.loop.options import OperatorOptions
from relaytrain_operator.loop.runner import Runner

logger = logging.getLogger(__name__)

FINALIZER = "relaytrain.io/finalizer"
"""kopf adds a finalizer to unfinished jobs because of their daemon; this is its name."""
ANNOTATION_PREFIX = "relaytrain.io"


def _api_client() -> Any:
    """In a pod: the service account; elsewhere: KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        from kubernetes import client

        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()  # type: ignore[no-untyped-call]


def _catalog(path: str | None) -> Catalog | None:
    """The built-in GPU catalog with the file's overrides (None: the built-in one)."""
    if not path:
        return None
    doc = yaml.safe_load(Path(path).read_text())
    return DEFAULT_CATALOG.with_overrides(doc or {})


def post_event(job: dict[str, Any], type: str, reason: str, message: str) -> None:
    """Post an Event on `job` through kopf (and log a Warning's)."""
    kopf.event(kopf.Body(cast(kopf.RawBody, job)), type=type, reason=reason, message=message)
    if type == "Warning":
        meta = job["metadata"]
        logger.warning(
            "FineTuneJob %s/%s: %s: %s", meta["namespace"], meta["name"], reason, message
        )


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    opts: OperatorOptions = memo.options
    settings.persistence.finalizer = FINALIZER
    # Keep kopf's bookkeeping in our own annotations, out of status (which the CRD
    # declares field by field).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.enabled = True
    settings.posting.reporting_component = "relaytrain-operator"
    settings.posting.level = logging.WARNING
    # Watch only the pods the operator owns, filtered by the API server.
    settings.watching.label_selectors["pods"] = JOB_LABEL
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    # Named namespaces are watched directly, whether they exist yet or not: no namespace
    # scan. kopf's (1.45) lists namespaces, then starts a watch that lists them again and
    # ignores that listing: a namespace made in between is never served. With globs the
    # operator watches the cluster and filters (handlers/filters.py).
    settings.scanning.disabled = bool(opts.patterns) and not opts.globbed
    settings.peering.standalone = opts.peering is None
    if opts.peering is not None:
        settings.peering.name = opts.peering
        settings.peering.mandatory = True
    # An unexpected error is retried soon: state comes from the cluster, so a retry is safe.
    settings.execution.default_backoff = max(1.0, opts.resync_seconds)
    api = ClusterApi(_api_client())
    memo.runner = Runner(api, opts, _catalog(opts.gpu_catalog), post_event)
    metrics.serve(opts.metrics_port)
