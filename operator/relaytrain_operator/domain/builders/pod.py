"""One Pod per pipeline stage: pinned to its GPU pool, locked down, stable DNS name."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from relaytrain_contract import (
    CONFIG_ENV,
    DEVICE_ENV,
    LINK_CA_FILE,
    LINK_CERT_FILE,
    LINK_CREDENTIALS_DIR,
    LINK_KEY_FILE,
    LINK_PORT,
    METRICS_PORT,
    REPLICA_PORT,
)
from relaytrain_contract.exits import TERMINATION_LOG

from relaytrain_operator.domain.builders.labels import (
    PIPELINE_LABEL,
    POOL_ANNOTATION,
    SPLIT_ANNOTATION,
    STAGE_LABEL,
    child_metadata,
    link_secret_name,
    stage_pod_name,
)
from relaytrain_operator.domain.linkcerts import CA_FILE, cert_file, key_file

WORKER_CONTAINER = "worker"
"""The stage pod's one container, which runs the worker image."""
GPU_RESOURCE = "nvidia.com/gpu"
MIB = 1024 * 1024
# The worker image's numeric non-root user (worker_image/Dockerfile), so `runAsNonRoot`
# is verified without trusting the image's metadata.
RUN_AS_USER = 10001
CACHE_DIR = "/cache"
"""Writable scratch for downloaded model shards (the root filesystem is read-only); the
worker image points RELAYTRAIN_CACHE here."""


@dataclass(frozen=True)
class CredentialsRef:
    """Where the object-store credentials live: a Secret and the two keys in it."""

    secret_name: str
    """Name of the Secret in the job's namespace."""
    access_key_key: str = "accessKey"
    """Key in the Secret holding the access key id."""
    secret_key_key: str = "secretKey"
    """Key in the Secret holding the secret access key."""


@dataclass(frozen=True)
class StagePodInputs:
    """Everything one stage pod is built from; filled from the spec and the plan."""

    index: int
    """0-based stage index (within its pipeline)."""
    pool: str
    """The pool (planner's pool name) this stage runs on."""
    node_selector: dict[str, str]
    """Node labels that pin the pod to its pool (GPU label, pool label, spec extras)."""
    memory_bytes: int
    """Memory to request (and limit), from the plan's estimate for this stage."""
    stage_config: dict[str, Any]
    """The stage contract document from `build_stage_configs`."""
    image: str
    """Worker container image."""
    credentials: CredentialsRef | None = None
    """Object-store credentials; None for a store that needs none."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Tolerations copied from spec.placement."""
    priority_class_name: str | None = None
    """PriorityClass for the pod, from spec.placement."""
    runtime_class_name: str | None = None
    """RuntimeClass for the pod, from spec.placement."""
    image_pull_policy: str = "IfNotPresent"
    """Pull policy of the worker image."""
    cpu: str | None = None
    """CPU to request, if the spec names one."""
    split: str | None = None
    """The pipeline's split, as `SPLIT_ANNOTATION` records it (None: not recorded)."""
    pipeline: int | None = None
    """The stage's pipeline when the job trains several; None: the job's only one."""
    device: str = "cuda"
    """Where the worker computes (`DEVICE_ENV`): the operator's `workerDevice` setting."""


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _env(job_name: str, inputs: StagePodInputs) -> list[dict[str, Any]]:
    config = inputs.stage_config
    env: list[dict[str, Any]] = [
        {"name": CONFIG_ENV, "value": json.dumps(config, sort_keys=True)},
        {"name": DEVICE_ENV, "value": inputs.device},
        # The root filesystem is read-only: caches go to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
    ]
    checkpoint = config.get("checkpoint") or {}
    if inputs.credentials is not None:
        ref = inputs.credentials
        if checkpoint.get("accessKeyEnv"):
            env.append(_secret_env(checkpoint["accessKeyEnv"], ref.secret_name, ref.access_key_key))
        if checkpoint.get("secretKeyEnv"):
            env.append(_secret_env(checkpoint["secretKeyEnv"], ref.secret_name, ref.secret_key_key))
    return env


HOST_RUNTIME_BYTES = 2048 * MIB
"""Host memory a stage's process needs besides its share of the model: Python, torch (and
its CUDA libraries on a GPU node), the data loader and the link buffers."""


def memory_request(planned_bytes: int) -> str:
    """The host memory a stage pod requests (and is limited to): the runtime's, and the
    stage's planned share of the model (its GPU memory), which the weights pass through on
    their way to the GPU and which a stage on CPU holds entirely. The plan's figure alone
    would have a real kubelet kill a small model's stage as it starts."""
    return f"{max(1, -(-(planned_bytes + HOST_RUNTIME_BYTES) // MIB))}Mi"


def _resources(inputs: StagePodInputs) -> dict[str, Any]:
    memory = memory_request(inputs.memory_bytes)
    requests: dict[str, str] = {GPU_RESOURCE: "1", "memory": memory}
    if inputs.cpu:
        requests["cpu"] = inputs.cpu
    # Extended resources need limit == request; a memory limit keeps a leaking stage
    # from starving its neighbours on a shared node.
    limits = {GPU_RESOURCE: "1", "memory": memory}
    return {"requests": requests, "limits": limits}


LINK_VOLUME = "link"
"""The stage pod's volume of its link credentials."""


def _link_volume(job_name: str, inputs: StagePodInputs) -> dict[str, Any]:
    """The job's link Secret as a volume: of its files, only this stage's certificate and key
    (and the CA certificates every stage trusts), under the names the worker reads. A
    mounted Secret (unlike an environment variable) follows the Secret: the kubelet swaps
    the files in when the operator renews the certificates."""
    pipeline = inputs.pipeline or 0
    return {
        "name": LINK_VOLUME,
        "secret": {
            "secretName": link_secret_name(job_name),
            "defaultMode": 0o440,  # the worker's group (fsGroup) reads it; no one else
            "items": [
                {"key": CA_FILE, "path": LINK_CA_FILE},
                {"key": cert_file(pipeline, inputs.index), "path": LINK_CERT_FILE},
                {"key": key_file(pipeline, inputs.index), "path": LINK_KEY_FILE},
            ],
        },
    }


def build_stage_pod(job: dict[str, Any], inputs: StagePodInputs) -> dict[str, Any]:
    """The Pod of one stage, owned by the job.

    `restartPolicy: Never`: a stage that dies is replaced by the operator (which
    counts restarts and restores from a checkpoint), not restarted in place by the kubelet.
    """
    job_name = job["metadata"]["name"]
    name = stage_pod_name(job_name, inputs.index, inputs.pipeline)
    metadata = child_metadata(job, name)
    metadata["labels"][STAGE_LABEL] = str(inputs.index)
    metadata["labels"][PIPELINE_LABEL] = str(inputs.pipeline or 0)
    metadata["annotations"] = {POOL_ANNOTATION: inputs.pool}
    if inputs.split is not None:
        metadata["annotations"][SPLIT_ANNOTATION] = inputs.split
    ports = [
        {"name": "link", "containerPort": LINK_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    if inputs.pipeline:
        # Stages of pipelines above 0 accept the lower pipelines' stages here.
        ports.append({"name": "replica", "containerPort": REPLICA_PORT, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": inputs.image,
        "imagePullPolicy": inputs.image_pull_policy,
        "command": ["python", "-m", "relaytrain_worker"],
        "env": _env(job_name, inputs),
        "ports": ports,
        "resources": _resources(inputs),
        # The worker's one line on why it stopped (relaytrain_contract.exits), or the end
        # of its log when it crashed without one: the operator quotes it in the job.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": LINK_VOLUME, "mountPath": LINK_CREDENTIALS_DIR, "readOnly": True},
        ],
    }
    spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": job_name,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "nodeSelector": dict(inputs.node_selector),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {}},
            _link_volume(job_name, inputs),
        ],
        "terminationGracePeriodSeconds": 30,
    }
    if inputs.tolerations:
        spec["tolerations"] = [dict(t) for t in inputs.tolerations]
    if inputs.priority_class_name:
        spec["priorityClassName"] = inputs.priority_class_name
    if inputs.runtime_class_name:
        spec["runtimeClassName"] = inputs.runtime_class_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def stage_image(pods: Iterable[dict[str, Any]], job_image: str | None, default: str) -> str:
    """The image a new stage pod of a job runs: the one its running stage pods run (the most
    of them; pods being deleted, or not running, do not count), else `job_image`
    (spec.image), else the operator's `default`.

    A stage created beside running ones (a stage replaced alone, a pipeline added) links
    to them, and a worker of another version may speak another link protocol, refused at
    the handshake (docs/links-and-checkpoints.md): an operator upgraded mid-job, its default
    image moved, or a spec.image changed, would otherwise start a replacement its
    neighbours refuse, again and again. A job's stages take a new image when every one is
    replaced at once: a re-split, a suspension and resume. Pods that never started (an
    image that cannot be pulled, which spec.image then corrects) link to nothing: a
    replacement of one of them takes spec.image."""
    running = Counter(
        container.get("image")
        for pod in pods
        if not pod.get("metadata", {}).get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase") == "Running"
        for container in (pod.get("spec") or {}).get("containers", ())
        if container.get("name") == WORKER_CONTAINER and container.get("image")
    )
    if running:
        return str(min(running, key=lambda image: (-running[image], image)))
    return job_image or default
