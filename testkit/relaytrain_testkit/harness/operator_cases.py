"""Set-up that tests of the operator's pieces share against the session cluster: the
FineTuneJob CRD, a namespace of a test's own, a job, and objects as plain JSON
(what the operator's indexes and `apply.ClusterApi` hand around)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from relaytrain_testkit import REPO
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.jobs import Job

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"


def install_crd(cluster: Any, api: client.ApiClient) -> None:
    """Apply crds/ and wait until FineTuneJobs are served."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.wait_established(f"{PLURAL}.{GROUP}")

    def served() -> bool:
        # Established comes before the API server's storage for the new kind is ready.
        try:
            client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, PLURAL)
        except ApiException:
            return False
        return True

    wait_for("FineTuneJobs to be served", served)


@contextmanager
def namespace(api: client.ApiClient, prefix: str) -> Iterator[str]:
    """A new namespace, ready for pods (its default ServiceAccount exists); deleted on
    exit, and its pods waited out (stage pods hold GPUs that later tests plan on)."""
    core = client.CoreV1Api(api)
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        wait_for(
            f"the default ServiceAccount of {name}",
            lambda: (
                core.list_namespaced_service_account(
                    name, field_selector="metadata.name=default"
                ).items
            ),
        )
        yield name
    finally:
        # The pods first, without a grace period (no kubelet runs them; the namespace
        # controller would take seconds more to get to them), then the rest.
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
        core.delete_namespace(name)
        wait_for(f"the pods of {name} to go", lambda: not core.list_namespaced_pod(name).items)


def cluster_job(name: str, model_uri: str, namespace: str | None = None) -> Job:
    """A two-stage FineTuneJob for the session cluster: a bf16 model at `model_uri`, 100
    steps of 8 micro-batches of 1 x 256 tokens, checkpoints in a local directory, 2 restarts
    a stage without back-off."""
    return (
        Job(name, namespace)
        .model(model_uri, dtype="bfloat16")
        .dataset("s3://data/train.jsonl", sequence_length=256)
        .training(steps=100, micro_batch_size=1, micro_batches=8)
        .pipeline(stages=2)
        .checkpoint("/var/tmp/relaytrain-checkpoints")
        .failure_policy(max_stage_restarts=2, backoff_seconds=0)
    )


def raw(response: Any) -> Any:
    """The JSON of a call made with `_preload_content=False`."""
    return json.loads(response.data)


def nodes_index(api: client.ApiClient) -> dict[str, list[dict[str, Any]]]:
    """Every node as the operator's node index holds them: name → [node]."""
    items = raw(client.CoreV1Api(api).list_node(_preload_content=False))["items"]
    return {n["metadata"]["name"]: [n] for n in items}
