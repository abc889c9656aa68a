"""Names and labels shared by the builders, the applier and the pod watch."""

from __future__ import annotations

from typing import Any

JOB_LABEL = "relaytrain.io/job"
"""Label on every child of a job: the job's name (the pod watch and the Service select it)."""
STAGE_LABEL = "relaytrain.io/stage"
"""Label on a stage pod: its 0-based stage index within its pipeline."""
PIPELINE_LABEL = "relaytrain.io/pipeline"
"""Label on a stage pod: its 0-based pipeline index (0 while the job has one; a pod
without it, created by an older operator, belongs to pipeline 0)."""
POOL_ANNOTATION = "relaytrain.io/pool"
"""Annotation on a stage pod: the GPU pool (label value) it was pinned to."""
SPLIT_ANNOTATION = "relaytrain.io/split"
"""Annotation on a stage pod: its pipeline's split when the pod was built (each stage's
decoder layers, `start-end` in order): a pod of a split the plan no longer has is replaced
(domain/resplit.py)."""
MANAGED_BY = "relaytrain-operator"

API_VERSION = "relaytrain.io/v1alpha1"
KIND = "FineTuneJob"

# A pod's hostname is one DNS label: at most 63 characters.
MAX_DNS_LABEL = 63


StageKey = tuple[int, int]
"""(pipeline, stage) of a stage pod: pipeline 0 while the job has one."""


def stage_pod_name(job_name: str, index: int, pipeline: int | None = None) -> str:
    """Pod name and hostname of stage `index`: stable across replacements.

    `pipeline` None: the job trains one pipeline (`<job>-stage-<k>`); with several, stage k
    of pipeline p is `<job>-p<p>-s<k>` (a 50-character job name leaves room for 64
    pipelines of up to 999 stages within one 63-character DNS label).
    """
    if pipeline is None:
        return f"{job_name}-stage-{index}"
    return f"{job_name}-p{pipeline}-s{index}"


def link_secret_name(job_name: str) -> str:
    """The per-job Secret holding the links' CA certificate and each stage's cert and key."""
    return f"{job_name}-link"


def stage_dns_name(job_name: str, namespace: str, index: int, pipeline: int | None = None) -> str:
    """The stable DNS name of stage `index` (of `pipeline`, as in `stage_pod_name`) under the
    job's headless Service."""
    return f"{stage_pod_name(job_name, index, pipeline)}.{job_name}.{namespace}.svc"


def job_labels(job_name: str) -> dict[str, str]:
    """Labels every child of the job carries."""
    return {
        JOB_LABEL: job_name,
        "app.kubernetes.io/name": "relaytrain-worker",
        "app.kubernetes.io/instance": job_name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    """The controller reference that makes the garbage collector delete a child with its job."""
    meta = job["metadata"]
    return {
        "apiVersion": job.get("apiVersion", API_VERSION),
        "kind": job.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(job: dict[str, Any], name: str) -> dict[str, Any]:
    """Metadata of a child object: namespace, labels and owner taken from the job."""
    meta = job["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": job_labels(meta["name"]),
        "ownerReferences": [owner_reference(job)],
    }
