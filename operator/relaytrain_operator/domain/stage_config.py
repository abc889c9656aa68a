"""Build the per-stage documents of docs/stage-contract.md from a job and its plan.

Pure: a parsed FineTuneJob, the planner's layer ranges and each stage's link addresses in,
one `relaytrain_contract.StageConfig` per stage out, as the plain dict that travels. The
operator puts a document into each stage pod's environment; `relaytrain run --local` writes
one file per stage; the worker parses it with the same model (tests/contract/ checks it).

Secrets never enter a document: it names where they are, the folder of the stage's link
credentials (LINK_CREDENTIALS_DIR in a pod, where the link Secret is mounted) and the
environment variables of the store's (ACCESS_KEY_ENV, SECRET_KEY_ENV when the job names a
credential Secret; without one, null: AWS's standard credential chain), and whoever starts
the stage fills those. It does name each stage's link identity and its neighbours'
(`link_identity`): what their TLS certificates must carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from relaytrain_contract import (
    ACCESS_KEY_ENV,
    API_VERSION,
    GRADIENT_BITS,
    LINK_CREDENTIALS_DIR,
    LINK_PORT,
    METRICS_PORT,
    REPLICA_PORT,
    SECRET_KEY_ENV,
    STAGE_CONFIG_KIND,
    AddedPipeline,
    CheckpointSpec,
    DatasetSpec,
    FleetDocument,
    JobRef,
    LinksSpec,
    MethodSpec,
    ModelSpec,
    ObservabilitySpec,
    OutputSpec,
    PipelineSpec,
    ReplicaPeer,
    ReplicasSpec,
    StageConfig,
    StageRef,
    SyncSpec,
    TrainingSpec,
    link_identity,
)

from relaytrain_operator.domain.builders.labels import stage_dns_name
from relaytrain_operator.spec import FineTuneJob

__all__ = [
    "ACCESS_KEY_ENV",
    "LINK_CREDENTIALS_DIR",
    "LINK_PORT",
    "METRICS_PORT",
    "SECRET_KEY_ENV",
    "StageEndpoints",
    "build_pipeline_configs",
    "build_stage_configs",
    "job_pod_endpoints",
    "layer_ranges",
    "link_identity",
    "local_endpoints",
    "output_uri",
    "pod_endpoints",
    "stage_address",
    "stage_config",
]


Part = TypeVar("Part", bound=BaseModel)


@dataclass(frozen=True)
class StageEndpoints:
    """Where one stage listens and whom it sends to."""

    listen: str | None
    """`host:port` this stage accepts its predecessor on; None for stage 0."""
    next: str | None
    """`host:port` of the next stage; None for the last stage."""
    metrics_port: int = METRICS_PORT
    """Port of this stage's /metrics and /healthz."""
    replica_listen: str | None = None
    """`host:port` this stage accepts the stages of lower pipelines on (several pipelines
    only; None on pipeline 0, which dials every peer)."""
    replica_address: str | None = None
    """`host:port` at which the stages of lower pipelines reach `replica_listen`."""


def stage_address(
    job_name: str,
    namespace: str,
    index: int,
    port: int = LINK_PORT,
    pipeline: int | None = None,
) -> str:
    """Stable DNS address of stage `index` (of `pipeline`: see `stage_pod_name`) under the
    job's headless Service (named as the job)."""
    return f"{stage_dns_name(job_name, namespace, index, pipeline)}:{port}"


def pod_endpoints(
    job_name: str,
    namespace: str,
    count: int,
    port: int = LINK_PORT,
    metrics_port: int = METRICS_PORT,
    *,
    pipeline: int | None = None,
    replica_port: int = REPLICA_PORT,
) -> list[StageEndpoints]:
    """Endpoints of `count` stage pods: every pod listens on all interfaces at `port`.

    `pipeline` None: the job's only pipeline. With several, the pods of pipeline p are
    named for it, and on every pipeline but 0 each also accepts the lower pipelines' stages
    on `replica_port`.
    """
    replicas = pipeline is not None and pipeline > 0
    return [
        StageEndpoints(
            listen=None if k == 0 else f"0.0.0.0:{port}",
            next=None
            if k == count - 1
            else stage_address(job_name, namespace, k + 1, port, pipeline),
            metrics_port=metrics_port,
            replica_listen=f"0.0.0.0:{replica_port}" if replicas else None,
            replica_address=stage_address(job_name, namespace, k, replica_port, pipeline)
            if replicas
            else None,
        )
        for k in range(count)
    ]


def job_pod_endpoints(
    job_name: str, namespace: str, counts: Sequence[int]
) -> list[list[StageEndpoints]]:
    """Endpoints of the stage pods of every pipeline, `[p][k]`, for `counts[p]` stages each
    (one pipeline: its pods keep the one-pipeline names)."""
    several = len(counts) > 1
    return [
        pod_endpoints(job_name, namespace, count, pipeline=p if several else None)
        for p, count in enumerate(counts)
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
    job: FineTuneJob,
    plan: Any,
    endpoints: Sequence[StageEndpoints],
    *,
    renewal_grace: float = 0.0,
    compression: str | None = None,
    forwards_ahead: int | None = None,
    plan_epoch: int = 0,
) -> list[dict[str, Any]]:
    """One stage-contract document per stage, in stage order (each a fresh dict).

    `plan`: anything layer_ranges accepts. `endpoints`: one StageEndpoints per stage
    (pod_endpoints for a cluster, local_endpoints for local processes). `renewal_grace`:
    how long a link refused on its certificate chain is tried again (a renewal reaches the
    two ends of a link within this; 0 where the certificates are never renewed).
    `plan_epoch`: the job's `status.planEpoch` (`JobRef.plan_epoch`).
    Raises ValueError when the plan and endpoints do not describe one pipeline.
    """
    ranges = layer_ranges(plan)
    _check(job, ranges, endpoints)
    count = len(ranges)
    return [
        stage_config(
            job,
            k,
            count,
            layers,
            ends,
            renewal_grace=renewal_grace,
            compression=compression,
            forwards_ahead=forwards_ahead,
            plan_epoch=plan_epoch,
        ).to_dict()
        for k, (layers, ends) in enumerate(zip(ranges, endpoints, strict=True))
    ]


def build_pipeline_configs(
    job: FineTuneJob,
    plans: Sequence[Any],
    endpoints: Sequence[Sequence[StageEndpoints]],
    shares: Sequence[int],
    *,
    renewal_grace: float = 0.0,
    compression: str | None = None,
    forwards_ahead: int | None = None,
    plan_epoch: int = 0,
) -> list[list[dict[str, Any]]]:
    """The documents of every stage of R pipelines that train as one job: `[p][k]`.

    `plans[p]`: anything layer_ranges accepts (pipelines may split the layers differently);
    `endpoints[p]`: one StageEndpoints per stage of pipeline p, with `replica_listen` and
    `replica_address` set on every pipeline but 0; `shares[p]`: pipeline p's micro-batches
    per step (they add up to spec.training.microBatches, or more where pipelines out of the
    job keep theirs as weights: ReplicasSpec.shares). With one pipeline the documents
    are `build_stage_configs`'s, without a replicas section. Each stage's `replicas.peers`
    are the stages of the other pipelines whose layers overlap its own (the embedding and
    the head go with the first and last layer). `renewal_grace`, `plan_epoch`: as
    `build_stage_configs`'s.
    Raises ValueError when they do not fit.
    """
    micro = job.spec.training.micro_batches
    if not plans or len(endpoints) != len(plans) or len(shares) != len(plans):
        raise ValueError(
            f"{len(plans)} pipelines, {len(endpoints)} endpoint lists and {len(shares)} shares"
        )
    if sum(shares) < micro or min(shares) < 1:
        raise ValueError(
            f"shares {list(shares)} must give every pipeline at least one micro-batch and add "
            f"up to at least spec.training.microBatches ({micro})"
        )
    if len(plans) == 1:
        return [
            build_stage_configs(
                job,
                plans[0],
                endpoints[0],
                renewal_grace=renewal_grace,
                compression=compression,
                forwards_ahead=forwards_ahead,
                plan_epoch=plan_epoch,
            )
        ]
    splits = [layer_ranges(plan) for plan in plans]
    for ranges, ends in zip(splits, endpoints, strict=True):
        _check(job, ranges, ends)
    if len({ranges[-1][1] for ranges in splits}) != 1:
        raise ValueError(f"the pipelines hold different layers: {splits}")
    ns, name = job.metadata.namespace, job.metadata.name
    sync = _as(SyncSpec, job.spec.pipeline.sync)
    out = []
    for p, (ranges, ends) in enumerate(zip(splits, endpoints, strict=True)):
        documents = []
        for k, ((start, end), mine) in enumerate(zip(ranges, ends, strict=True)):
            if (p > 0) != (mine.replica_listen is not None and mine.replica_address is not None):
                raise ValueError(f"pipeline {p} stage {k}: replica endpoints only off pipeline 0")
            peers = [
                ReplicaPeer(
                    pipeline=q,
                    stage=j,
                    layer_start=s,
                    layer_end=e,
                    address=endpoints[q][j].replica_address if q > p else None,
                    identity=link_identity(ns, name, q, j),
                )
                for q, split in enumerate(splits)
                if q != p
                for j, (s, e) in enumerate(split)
                if max(start, s) < min(end, e)
            ]
            replicas = ReplicasSpec(
                pipeline=p,
                shares=tuple(shares),
                listen=mine.replica_listen if p > 0 else None,
                peers=tuple(peers),
                sync=sync,
            )
            cfg = stage_config(
                job, k, len(ranges), (start, end), mine, pipeline=p, replicas=replicas,
                renewal_grace=renewal_grace, compression=compression,
                forwards_ahead=forwards_ahead, plan_epoch=plan_epoch,
            )  # fmt: skip
            documents.append(cfg.to_dict())
        out.append(documents)
    return out


def fleet_document(
    job: FineTuneJob,
    plans: Sequence[Any],
    endpoints: Sequence[Sequence[StageEndpoints]],
    added: Iterable[int],
    shares: Sequence[int] = (),
) -> dict[str, Any]:
    """names.FLEET_FILE for the pipelines `added` to a running job (arguments as
    `build_pipeline_configs`'s, for every pipeline of the plan): each added pipeline's
    stages, with their layers, replica addresses and identities. The stages started
    before read it and link to the added stages that share their layers, which are exactly
    the peers `build_pipeline_configs` would have listed there. `shares`: every pipeline's
    share as the plan gives it now (their first stages take theirs from here)."""
    splits = [layer_ranges(plan) for plan in plans]
    ns, name = job.metadata.namespace, job.metadata.name
    return FleetDocument(
        added=tuple(
            AddedPipeline(
                stages=tuple(
                    ReplicaPeer(
                        pipeline=q,
                        stage=j,
                        layer_start=s,
                        layer_end=e,
                        address=endpoints[q][j].replica_address,
                        identity=link_identity(ns, name, q, j),
                    )
                    for j, (s, e) in enumerate(splits[q])
                ),
            )
            for q in sorted(set(added))
        ),
        shares=tuple(shares),
    ).to_dict()


def stage_config(
    job: FineTuneJob,
    k: int,
    count: int,
    layers: tuple[int, int],
    ends: StageEndpoints,
    *,
    pipeline: int = 0,
    replicas: ReplicasSpec | None = None,
    renewal_grace: float = 0.0,
    compression: str | None = None,
    forwards_ahead: int | None = None,
    plan_epoch: int = 0,
) -> StageConfig:
    """The document of stage `k` of `count` of pipeline `pipeline`, holding `layers` and
    reached at `ends`; `replicas` says where the other pipelines are (None: there are none).
    `compression`: the plan's boundary code (status.plan.compression), which the spec's
    `auto` needs; None takes the spec's; `forwards_ahead` likewise
    (status.plan.forwardsAhead). `plan_epoch`: the job's `status.planEpoch`."""
    spec = job.spec
    mode = compression or spec.pipeline.compression
    ahead = spec.pipeline.forwards_ahead if forwards_ahead is None else forwards_ahead
    for field, value in (("compression", mode), ("forwardsAhead", ahead)):
        if value == "auto":
            raise ValueError(
                f"spec.pipeline.{field} is auto: the stage documents need the plan's choice "
                f"(status.plan.{field})"
            )
    ns, name = job.metadata.namespace, job.metadata.name
    # Without a credential Secret the stage uses AWS's standard credential chain.
    secret = spec.checkpoint.credentials_secret is not None
    return StageConfig(
        api_version=API_VERSION,
        kind=STAGE_CONFIG_KIND,
        job=JobRef(namespace=ns, name=name, uid=job.metadata.uid or "", plan_epoch=plan_epoch),
        stage=StageRef(index=k, count=count, layer_start=layers[0], layer_end=layers[1]),
        # These four are the spec's own sections, field for field: read as they travel.
        model=_as(ModelSpec, spec.model),
        dataset=_as(DatasetSpec, spec.dataset),
        method=_as(MethodSpec, spec.method),
        training=_as(TrainingSpec, spec.training),
        pipeline=PipelineSpec(
            schedule=spec.pipeline.schedule,
            compression=mode,  # type: ignore[arg-type]  # checked by the contract model
            forwards_ahead=ahead,  # type: ignore[arg-type]  # not auto: checked above
            # the share is delta's: a run on loopback (`relaytrain run --local`) sends none
            gradient_tokens=spec.pipeline.gradient_tokens if mode == "delta" else 1.0,
            gradient_bits=spec.pipeline.gradient_bits if mode == "delta" else GRADIENT_BITS,
            gradient_fill=spec.pipeline.gradient_fill if mode == "delta" else "none",
            activation_error=spec.pipeline.activation_error if mode == "delta" else "int4",
            activation_basis=spec.pipeline.activation_basis if mode == "delta" else "identity",
        ),
        links=LinksSpec(
            listen=ends.listen,
            next=ends.next,
            identity=link_identity(ns, name, pipeline, k),
            prev_identity=link_identity(ns, name, pipeline, k - 1) if k > 0 else None,
            next_identity=link_identity(ns, name, pipeline, k + 1) if k < count - 1 else None,
            credentials_dir=LINK_CREDENTIALS_DIR,
            renewal_grace_seconds=renewal_grace,
        ),
        checkpoint=CheckpointSpec(
            uri=spec.checkpoint.uri,
            endpoint=spec.checkpoint.endpoint,
            access_key_env=ACCESS_KEY_ENV if secret else None,
            secret_key_env=SECRET_KEY_ENV if secret else None,
            every_steps=spec.checkpoint.every_steps,
            keep=spec.checkpoint.keep,
        ),
        output=OutputSpec(uri=output_uri(job)),
        observability=ObservabilitySpec(port=ends.metrics_port),
        replicas=replicas,
    )


def _as(part: type[Part], section: BaseModel) -> Part:
    """A FineTuneJob spec section as the contract's model of the same name (camelCase JSON
    in, strict parse out); a field one has and the other lacks is an error here."""
    return part.model_validate_json(section.model_dump_json(by_alias=True))
