"""A FineTuneJob, its plan, and the stage pods the pure builders make for them."""

from __future__ import annotations

from typing import Any

from relaytrain_operator.domain.builders.pod import CredentialsRef, StagePodInputs, build_stage_pod
from relaytrain_operator.domain.stage_config import build_stage_configs, pod_endpoints
from relaytrain_operator.spec import parse_job

from relaytrain_testkit.jobs import Job

JOB = (
    Job("smol", "team-a")
    .uid("u-1")
    .generation(1)
    .model("s3://models/smol/")
    .dataset("s3://data/train.jsonl")
    .training(steps=10)
    .pipeline(stages=2)
    .checkpoint("s3://relaytrain/ckpt", endpoint="http://minio:9000")
    .credentials("s3-creds", access_key_key="id", secret_key_key="key")
)
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
    manifest = JOB.build()
    configs = build_stage_configs(parse_job(manifest), PLAN, pod_endpoints("smol", "team-a", 2))
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
    return build_stage_pod(manifest, inputs)
