"""A FineTuneJob, its plan, and the stage pods the pure builders make for them."""

from __future__ import annotations

from typing import Any

from relaytrain_operator.domain.builders.pod import CredentialsRef, StagePodInputs, build_stage_pod
from relaytrain_operator.domain.stage_config import build_stage_configs, pod_endpoints
from relaytrain_operator.spec import parse_job

JOB: dict[str, Any] = {
    "apiVersion": "relaytrain.io/v1alpha1",
    "kind": "FineTuneJob",
    "metadata": {"name": "smol", "namespace": "team-a", "uid": "u-1", "generation": 1},
    "spec": {
        "model": {"uri": "s3://models/smol/"},
        "dataset": {"uri": "s3://data/train.jsonl"},
        "training": {"steps": 10},
        "pipeline": {"stages": 2},
        "checkpoint": {
            "uri": "s3://relaytrain/ckpt",
            "endpoint": "http://minio:9000",
            "credentialsSecret": {"name": "s3-creds", "accessKeyKey": "id", "secretKeyKey": "key"},
        },
    },
}
"""A two-stage FineTuneJob as stored."""
PLAN: dict[str, Any] = {
    "stages": [
        {"index": 0, "pool": "h100", "layerStart": 0, "layerEnd": 20},
        {"index": 1, "pool": "a100", "layerStart": 20, "layerEnd": 30},
    ]
}
"""JOB's plan: stage 0 on an h100, stage 1 on an a100."""


def pod_for(stage: int, **overrides: Any) -> dict[str, Any]:
    """Stage `stage`'s pod as the builders make it for JOB and PLAN (`overrides`: more
    `StagePodInputs` fields)."""
    job = parse_job(JOB)
    configs = build_stage_configs(job, PLAN, pod_endpoints("smol", "team-a", 2))
    inputs = StagePodInputs(
        index=stage,
        pool=PLAN["stages"][stage]["pool"],
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        memory_bytes=3 * 1024**3 + 1,
        stage_config=configs[stage],
        image="registry.example/worker:1",
        credentials=CredentialsRef("s3-creds", "id", "key"),
        **overrides,
    )
    return build_stage_pod(JOB, inputs)
