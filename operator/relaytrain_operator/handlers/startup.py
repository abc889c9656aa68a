"""The one startup handler: every kopf setting, the API client, the metrics endpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import kopf
import yaml
from kubernetes import config

from relaytrain_operator import metrics, options
from relaytrain_operator.apply import ClusterApi
from relaytrain_operator.builders.labels import JOB_LABEL
from relaytrain_operator.planner import DEFAULT_CATALOG, Catalog
from relaytrain_operator.reconcile import Reconciler

FINALIZER = "relaytrain.io/finalizer"
"""kopf adds a finalizer to jobs because of the periodic check; this is its name."""
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


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    opts = options.current()
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
    settings.peering.standalone = opts.peering is None
    if opts.peering is not None:
        settings.peering.name = opts.peering
        settings.peering.mandatory = True
    settings.execution.max_workers = opts.max_workers
    # An unexpected error is retried soon: state comes from the cluster, so a retry is safe.
    settings.execution.default_backoff = max(1.0, opts.resync_seconds)
    memo.reconciler = Reconciler(ClusterApi(_api_client()), opts, _catalog(opts.gpu_catalog))
    metrics.serve(opts.metrics_port)
