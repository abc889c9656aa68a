"""The operator's settings: a validated model, read from the command line with
`RELAYTRAIN_*` environment variables as defaults (how the chart sets them).

`python -m relaytrain_operator --help` lists them. They are parsed once, before kopf
starts, and handed to the startup handler in kopf's memo.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class OperatorOptions(BaseModel):
    """How this operator instance runs."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch: names, or globs (`team-*`, `!*-test` to leave some out);
    empty watches the whole cluster."""
    peering: str | None = None
    """kopf peering object name; None runs standalone (one operator replica, the default)."""
    metrics_port: int = Field(8080, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint; 0 turns it off."""
    liveness_endpoint: str | None = None
    """kopf's liveness endpoint, e.g. `http://0.0.0.0:8081/healthz`; None turns it off."""
    resync_seconds: float = Field(10.0, gt=0)
    """Interval of the level-based check of every unfinished job (pods, nodes, progress)."""
    worker_image: str = Field("ghcr.io/relaytrain/worker:0.1.0", min_length=1)
    """Worker image used when a job does not name one."""
    worker_device: Literal["cuda", "cpu", "auto"] = "cuda"
    """Where stage pods compute: `cuda`, the GPU each pod is given (a stage that sees none
    stops and says so); `cpu` where GPUs are only simulated; `auto`, CUDA if the container
    sees a device."""
    default_link_mbps: float = Field(1000.0, gt=0)
    """Link bandwidth assumed for GPU nodes without the relaytrain.io link annotations."""
    default_link_latency_ms: float = Field(10.0, ge=0)
    """Link latency assumed for GPU nodes without the relaytrain.io link annotations."""
    node_lost_seconds: float = Field(60.0, ge=0)
    """How long a node may be NotReady before its stage pods are replaced elsewhere."""
    secret_propagation_seconds: float = Field(90.0, ge=0)
    """How long a changed Secret may take to reach the pods that mount it (the kubelet's
    sync period plus its cache's): the phases of a link certificate renewal wait this
    long for each other."""
    join_seconds: float = Field(120.0, ge=0)
    """What (re)starting a pipeline's stages costs before they add a step (loading their
    slices, taking a peer's state or the last commit): none comes back when the job's
    estimated end is nearer, and a job of one pipeline whose replacement waits this long for
    a GPU is re-split for the GPUs free (domain/resplit.py)."""
    gpu_catalog: str | None = None
    """YAML/JSON file of GPU catalog overrides (the chart mounts one from its values)."""
    debug: bool = False
    """Log every handler run and API request (kopf's debug logging)."""
    kueue: bool = False
    """Watch the jobs' Kueue Workloads, so that an admission or an eviction is acted on at
    once rather than at the next resync (needs list/watch on workloads: the chart's
    `kueue.enabled`)."""
    max_workers: int = Field(8, ge=1)
    """Threads that run reconciliations (API calls, store reads, planning) side by side."""

    @property
    def patterns(self) -> tuple[str, ...]:
        """Each namespace pattern on its own (a comma-separated entry split up)."""
        return tuple(p.strip() for entry in self.namespaces for p in entry.split(",") if p.strip())

    @property
    def globbed(self) -> bool:
        """Whether any pattern is a glob or an exclusion, not a plain name."""
        return any(c in p for p in self.patterns for c in "*?[!")

    def serves(self, namespace: str | None) -> bool:
        """Whether this operator serves objects in `namespace` (a cluster-scoped object,
        None, always): no patterns, or one glob matches and no `!glob` does (only
        exclusions: every other namespace)."""
        if namespace is None or not self.patterns:
            return True
        keep = [p for p in self.patterns if not p.startswith("!")]
        drop = [p[1:] for p in self.patterns if p.startswith("!")]
        included = not keep or any(fnmatch.fnmatchcase(namespace, p) for p in keep)
        return included and not any(fnmatch.fnmatchcase(namespace, p) for p in drop)


# (flag, field, environment variable suffix): the environment gives the default.
_FLAGS = (
    ("--peering", "peering", "PEERING"),
    ("--metrics-port", "metrics_port", "METRICS_PORT"),
    ("--liveness", "liveness_endpoint", "LIVENESS"),
    ("--resync-seconds", "resync_seconds", "RESYNC_SECONDS"),
    ("--worker-image", "worker_image", "WORKER_IMAGE"),
    ("--worker-device", "worker_device", "WORKER_DEVICE"),
    ("--node-lost-seconds", "node_lost_seconds", "NODE_LOST_SECONDS"),
    ("--secret-propagation-seconds", "secret_propagation_seconds", "SECRET_PROPAGATION_SECONDS"),
    ("--join-seconds", "join_seconds", "JOIN_SECONDS"),
    ("--max-workers", "max_workers", "MAX_WORKERS"),
    ("--gpu-catalog", "gpu_catalog", "GPU_CATALOG"),
)


def parse_options(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> OperatorOptions:
    """Options from `argv`, with defaults from RELAYTRAIN_* variables of `environ`
    (default: the process's environment). Invalid values exit with a usage error."""
    env = os.environ if environ is None else environ
    fields = OperatorOptions.model_fields
    parser = argparse.ArgumentParser(
        prog="python -m relaytrain_operator",
        description="Run the relaytrain operator: FineTuneJobs into stage pods.",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NAMESPACE",
        default=[n for n in env.get("RELAYTRAIN_NAMESPACES", "").split(",") if n],
        help=f"{fields['namespaces'].description} Repeatable "
        "(env RELAYTRAIN_NAMESPACES, comma-separated).",
    )
    for flag, name, suffix in _FLAGS:
        parser.add_argument(
            flag,
            dest=name,
            metavar=suffix,
            default=env.get(f"RELAYTRAIN_{suffix}") or None,
            help=f"{fields[name].description} (default {fields[name].default}; "
            f"env RELAYTRAIN_{suffix})",
        )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=env.get("RELAYTRAIN_DEBUG", "") not in ("", "0", "false"),
        help=f"{fields['debug'].description} (env RELAYTRAIN_DEBUG=1)",
    )
    parser.add_argument(
        "--kueue",
        action="store_true",
        default=env.get("RELAYTRAIN_KUEUE", "") not in ("", "0", "false"),
        help=f"{fields['kueue'].description} (env RELAYTRAIN_KUEUE=1)",
    )
    args = vars(parser.parse_args(argv))
    given: dict[str, Any] = {key: value for key, value in args.items() if value is not None}
    try:
        return OperatorOptions.model_validate(given)
    except ValidationError as err:
        problems = "; ".join(
            f"{_flag(str(e['loc'][0]))}: {e['msg']}" for e in err.errors(include_url=False)
        )
        parser.error(problems)


def _flag(name: str) -> str:
    return next((flag for flag, field, _ in _FLAGS if field == name), f"--{name}")
