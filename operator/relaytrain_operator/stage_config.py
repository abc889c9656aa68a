"""Build the per-stage JSON documents of docs/stage-contract.md from a job and its plan.

Pure: a parsed FineTuneJob, the planner's layer ranges and each stage's link addresses in,
plain dicts out. The operator puts a document into each stage pod's environment;
`relaytrain run --local` writes one file per stage. tests/contract/ checks that the worker's
StageConfig.from_json parses every document built here.

Secrets never enter a document: it names the environment variables that hold them
(LINK_CERT_ENV, LINK_KEY_ENV, LINK_CA_ENV, ACCESS_KEY_ENV, SECRET_KEY_ENV), and whoever
starts the stage fills those. It does name each stage's link identity and its neighbours'
(`link_identity`): what their TLS certificates must carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relaytrain_operator.spec import FineTuneJob

__all__ = [
    "ACCESS_KEY_ENV",
    "CONFIG_ENV",
    "LINK_CA_ENV",
    "LINK_CERT_ENV",
    "LINK_KEY_ENV",
    "LINK_PORT",
    "METRICS_PORT",
    "SECRET_KEY_ENV",
    "StageEndpoints",
    "build_stage_configs",
    "layer_ranges",
    "link_identity",
    "local_endpoints",
    "output_uri",
    "pod_endpoints",
    "stage_address",
    "stage_hostname",
]

CONTRACT_API_VERSION = "relaytrain.io/v1alpha1"
CONTRACT_KIND = "StageConfig"
CONFIG_ENV = "RELAYTRAIN_STAGE_CONFIG"
"""Environment variable that carries a stage's document in a pod."""
LINK_CERT_ENV = "RELAYTRAIN_LINK_CERT"
"""Environment variable holding the stage's link certificate (PEM)."""
LINK_KEY_ENV = "RELAYTRAIN_LINK_KEY"
"""Environment variable holding the private key of that certificate (PEM)."""
LINK_CA_ENV = "RELAYTRAIN_LINK_CA"
"""Environment variable holding the job's link CA certificate (PEM)."""
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
"""Environment variable holding the S3 access key id."""
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
"""Environment variable holding the S3 secret access key."""
LINK_PORT = 29500
"""Port a stage listens on for its predecessor's activations (in pods)."""
METRICS_PORT = 9400
"""Port of a stage's /metrics and /healthz (in pods)."""


@dataclass(frozen=True)
class StageEndpoints:
    """Where one stage listens and whom it sends to."""

    listen: str | None
    """`host:port` this stage accepts its predecessor on; None for stage 0."""
    next: str | None
    """`host:port` of the next stage; None for the last stage."""
    metrics_port: int = METRICS_PORT
    """Port of this stage's /metrics and /healthz."""


def link_identity(namespace: str, job_name: str, pipeline: int, stage: int) -> str:
    """Who a stage is on the links: the URI SAN of its certificate, checked by its neighbours.

    Pipeline `pipeline` (0 while a job has one) and stage `stage` of the job; see
    docs/stage-contract.md.
    """
    return f"relaytrain://{namespace}/{job_name}/p{pipeline}/s{stage}"


def stage_hostname(job_name: str, index: int) -> str:
    """The pod hostname of stage `index` (also the pod's name)."""
    return f"{job_name}-stage-{index}"


def stage_address(job_name: str, namespace: str, index: int, port: int = LINK_PORT) -> str:
    """Stable DNS address of stage `index` under the job's headless Service (named as the job)."""
    return f"{stage_hostname(job_name, index)}.{job_name}.{namespace}.svc:{port}"


def pod_endpoints(
    job_name: str,
    namespace: str,
    count: int,
    port: int = LINK_PORT,
    metrics_port: int = METRICS_PORT,
) -> list[StageEndpoints]:
    """Endpoints of `count` stage pods: every pod listens on all interfaces at `port`."""
    return [
        StageEndpoints(
            listen=None if k == 0 else f"0.0.0.0:{port}",
            next=None if k == count - 1 else stage_address(job_name, namespace, k + 1, port),
            metrics_port=metrics_port,
        )
        for k in range(count)
    ]


def local_endpoints(
    count: int, base_port: int, metrics_base_port: int, host: str = "127.0.0.1"
) -> list[StageEndpoints]:
    """Endpoints of `count` local processes: stage k listens on base_port + k."""
    return [
        StageEndpoints(
            listen=None if k == 0 else f"{host}:{base_port + k}",
            next=None if k == count - 1 else f"{host}:{base_port + k + 1}",
            metrics_port=metrics_base_port + k,
        )
        for k in range(count)
    ]


def output_uri(job: FineTuneJob) -> str:
    """Where the result goes: spec.output.uri, else `<checkpoint>/<namespace>/<job>/output/`."""
    if job.spec.output is not None:
        return job.spec.output.uri
    base = job.spec.checkpoint.uri.rstrip("/")
    return f"{base}/{job.metadata.namespace}/{job.metadata.name}/output/"


def layer_ranges(plan: Any) -> list[tuple[int, int]]:
    """Half-open layer ranges, in stage order, from a plan.

    Accepts the planner's Plan (`.stages`, each with `layer_start`/`layer_end`), a status-style
    mapping (`{"stages": [{"layerStart": .., "layerEnd": ..}]}`), or a plain sequence of
    (start, end) pairs — so this module needs nothing of the planner but those two numbers.
    """
    stages = plan["stages"] if isinstance(plan, Mapping) else getattr(plan, "stages", plan)
    ranges: list[tuple[int, int]] = []
    for stage in stages:
        if isinstance(stage, Mapping):
            start, end = stage["layerStart"], stage["layerEnd"]
        elif isinstance(stage, Sequence):
            start, end = stage
        else:
            start, end = stage.layer_start, stage.layer_end
        ranges.append((int(start), int(end)))
    return ranges


def _check(
    job: FineTuneJob, ranges: list[tuple[int, int]], endpoints: Sequence[StageEndpoints]
) -> None:
    if not ranges:
        raise ValueError("the plan has no stages")
    if len(endpoints) != len(ranges):
        raise ValueError(f"{len(endpoints)} endpoints for {len(ranges)} stages")
    wanted = job.spec.pipeline.stages
    if wanted != "auto" and wanted != len(ranges):
        raise ValueError(f"spec.pipeline.stages is {wanted} but the plan has {len(ranges)}")
    expected_start = 0
    for k, (start, end) in enumerate(ranges):
        if start != expected_start or end <= start:
            raise ValueError(
                f"stage {k} has layers [{start}, {end}); stages must cover contiguous, "
                f"non-empty ranges from layer 0 (expected start {expected_start})"
            )
        expected_start = end
    if endpoints[0].listen is not None or endpoints[-1].next is not None:
        raise ValueError("stage 0 must not listen and the last stage must not send")


def build_stage_configs(
    job: FineTuneJob, plan: Any, endpoints: Sequence[StageEndpoints]
) -> list[dict[str, Any]]:
    """One stage-contract document per stage, in stage order.

    `plan`: anything layer_ranges accepts. `endpoints`: one StageEndpoints per stage
    (pod_endpoints for a cluster, local_endpoints for local processes).
    Raises ValueError when the plan and endpoints do not describe one pipeline.
    """
    ranges = layer_ranges(plan)
    _check(job, ranges, endpoints)
    spec = job.spec
    ns, name = job.metadata.namespace, job.metadata.name
    count = len(ranges)
    documents: list[dict[str, Any]] = []
    for k, ((start, end), ends) in enumerate(zip(ranges, endpoints, strict=True)):
        # Built afresh per stage (model_dump returns new dicts), so that a caller editing
        # one stage's document cannot change another's. Key order follows the contract doc.
        documents.append(
            {
                "apiVersion": CONTRACT_API_VERSION,
                "kind": CONTRACT_KIND,
                "job": {"namespace": ns, "name": name, "uid": job.metadata.uid or ""},
                "stage": {"index": k, "count": count, "layerStart": start, "layerEnd": end},
                "model": spec.model.model_dump(mode="json"),
                "dataset": spec.dataset.model_dump(mode="json"),
                "method": spec.method.model_dump(mode="json"),
                "training": _training(job),
                "pipeline": {
                    "schedule": spec.pipeline.schedule,
                    "compression": spec.pipeline.compression,
                },
                "links": {
                    "listen": ends.listen,
                    "next": ends.next,
                    "identity": link_identity(ns, name, 0, k),
                    "prevIdentity": link_identity(ns, name, 0, k - 1) if k > 0 else None,
                    "nextIdentity": link_identity(ns, name, 0, k + 1) if k < count - 1 else None,
                    "certEnv": LINK_CERT_ENV,
                    "keyEnv": LINK_KEY_ENV,
                    "caEnv": LINK_CA_ENV,
                },
                "checkpoint": {
                    "uri": spec.checkpoint.uri,
                    "endpoint": spec.checkpoint.endpoint,
                    "accessKeyEnv": ACCESS_KEY_ENV,
                    "secretKeyEnv": SECRET_KEY_ENV,
                    "everySteps": spec.checkpoint.every_steps,
                    "keep": spec.checkpoint.keep,
                },
                "output": {"uri": output_uri(job)},
                "observability": {"port": ends.metrics_port},
            }
        )
    return documents


def _training(job: FineTuneJob) -> dict[str, Any]:
    # `epochs` travels only when the job counts epochs (then `steps` is null), so a
    # steps-based document carries no field a worker might not know.
    training = job.spec.training.model_dump(mode="json")
    if training["epochs"] is None:
        del training["epochs"]
    return training
