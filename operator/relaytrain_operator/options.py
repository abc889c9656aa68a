"""The operator's command-line options (with environment-variable defaults, for the chart).

`python -m relaytrain_operator --help` lists them. They are parsed once, before kopf
starts, and kept here so the startup handler and the handlers' decorators read the
same values.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorOptions:
    """How this operator instance runs."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty watches the whole cluster."""
    peering: str | None = None
    """kopf peering object name; None runs standalone (one operator replica, the default)."""
    metrics_port: int = 8080
    """Port of the Prometheus /metrics endpoint; 0 turns it off."""
    liveness_endpoint: str | None = None
    """kopf's liveness endpoint, e.g. `http://0.0.0.0:8081/healthz`; None turns it off."""
    resync_seconds: float = 10.0
    """Interval of the level-based check of every job (pods, nodes, progress)."""
    worker_image: str = "ghcr.io/relaytrain/worker:0.1.0"
    """Worker image used when a job does not name one."""
    default_link_mbps: float = 1000.0
    """Link bandwidth assumed for GPU nodes without the relaytrain.io link annotations."""
    default_link_latency_ms: float = 10.0
    """Link latency assumed for GPU nodes without the relaytrain.io link annotations."""
    node_lost_seconds: float = 60.0
    """How long a node may be NotReady before its stage pods are replaced elsewhere."""
    gpu_catalog: str | None = None
    """YAML/JSON file of GPU catalog overrides (the chart mounts one from its values)."""
    debug: bool = False
    """Log every handler run and API request (kopf's debug logging)."""
    max_workers: int = 8
    """Threads running handlers (each reconciles one job at a time)."""


def _env(name: str, default: str) -> str:
    return os.environ.get(f"RELAYTRAIN_{name}", default)


def parse_options(argv: Sequence[str] | None = None) -> OperatorOptions:
    """Options from `argv` (defaults from RELAYTRAIN_* environment variables)."""
    defaults = OperatorOptions()
    parser = argparse.ArgumentParser(
        prog="python -m relaytrain_operator",
        description="Run the relaytrain operator: FineTuneJobs into stage pods.",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[n for n in _env("NAMESPACES", "").split(",") if n],
        help="watch only this namespace (repeatable; default: the whole cluster; "
        "env RELAYTRAIN_NAMESPACES, comma-separated)",
    )
    parser.add_argument(
        "--peering",
        default=_env("PEERING", "") or None,
        help="kopf peering name for several replicas (default: standalone; env RELAYTRAIN_PEERING)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(_env("METRICS_PORT", str(defaults.metrics_port))),
        help="Prometheus /metrics port, 0 to disable (env RELAYTRAIN_METRICS_PORT)",
    )
    parser.add_argument(
        "--liveness",
        default=_env("LIVENESS", "") or None,
        help="liveness endpoint URL, e.g. http://0.0.0.0:8081/healthz (env RELAYTRAIN_LIVENESS)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=float(_env("RESYNC_SECONDS", str(defaults.resync_seconds))),
        help="interval of the periodic check of each job (env RELAYTRAIN_RESYNC_SECONDS)",
    )
    parser.add_argument(
        "--worker-image",
        default=_env("WORKER_IMAGE", defaults.worker_image),
        help="default worker image (env RELAYTRAIN_WORKER_IMAGE)",
    )
    parser.add_argument(
        "--node-lost-seconds",
        type=float,
        default=float(_env("NODE_LOST_SECONDS", str(defaults.node_lost_seconds))),
        help="NotReady time after which a node's stages are replaced "
        "(env RELAYTRAIN_NODE_LOST_SECONDS)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=int(_env("MAX_WORKERS", str(defaults.max_workers))),
        help="handler threads (env RELAYTRAIN_MAX_WORKERS)",
    )
    parser.add_argument(
        "--gpu-catalog",
        default=_env("GPU_CATALOG", "") or None,
        help="GPU catalog overrides, YAML or JSON (env RELAYTRAIN_GPU_CATALOG)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=_env("DEBUG", "") not in ("", "0", "false"),
        help="debug logging (env RELAYTRAIN_DEBUG=1)",
    )
    args = parser.parse_args(argv)
    if args.resync_seconds <= 0:
        parser.error("--resync-seconds must be > 0")
    return OperatorOptions(
        namespaces=tuple(args.namespace),
        peering=args.peering,
        metrics_port=args.metrics_port,
        liveness_endpoint=args.liveness,
        resync_seconds=args.resync_seconds,
        worker_image=args.worker_image,
        node_lost_seconds=max(0.0, args.node_lost_seconds),
        max_workers=max(1, args.max_workers),
        gpu_catalog=args.gpu_catalog,
        debug=args.debug,
    )


_current = OperatorOptions()


def current() -> OperatorOptions:
    """The options this process runs with (defaults until `use` is called)."""
    return _current


def use(options: OperatorOptions) -> None:
    """Make `options` the process's options (called by __main__ before kopf starts)."""
    global _current  # noqa: PLW0603 - one process, one set of options, set once at start
    _current = options
