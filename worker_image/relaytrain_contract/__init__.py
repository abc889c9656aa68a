"""The stage contract: what the operator hands each stage process and what the worker
reports back (docs/stage-contract.md).

Pure: pydantic models and constants, imported by both `relaytrain_operator` (which builds
stage documents and reads progress) and `relaytrain_worker` (which parses the documents and
writes progress). It imports neither torch nor kopf nor kubernetes, nor either package.
"""

from __future__ import annotations

from relaytrain_contract.errors import ConfigError
from relaytrain_contract.names import (
    ACCESS_KEY_ENV,
    API_VERSION,
    CONFIG_ENV,
    CREDENTIALS_FILE_ENV,
    LINK_CA_ENV,
    LINK_CERT_ENV,
    LINK_KEY_ENV,
    LINK_PORT,
    METRICS_PORT,
    PROFILE_ENV,
    PROGRESS_FILE,
    REGION_ENVS,
    REPLICA_PORT,
    SECRET_KEY_ENV,
    SESSION_TOKEN_ENV,
    STAGE_CONFIG_KIND,
    link_identity,
)
from relaytrain_contract.progress import Progress
from relaytrain_contract.stage import (
    CheckpointSpec,
    Compression,
    DatasetFormat,
    DatasetSpec,
    Dtype,
    JobRef,
    LinksSpec,
    LrSchedule,
    MethodSpec,
    MethodType,
    ModelSpec,
    ObservabilitySpec,
    OutputSpec,
    PipelineSchedule,
    PipelineSpec,
    ReplicaPeer,
    ReplicasSpec,
    StageConfig,
    StageRef,
    TrainingSpec,
    Truncation,
)
from relaytrain_contract.store import (
    AWS_S3_HOST,
    S3Credentials,
    S3Endpoint,
    aws_credentials,
    s3_endpoint,
)

__all__ = [
    "ACCESS_KEY_ENV",
    "API_VERSION",
    "AWS_S3_HOST",
    "CONFIG_ENV",
    "CREDENTIALS_FILE_ENV",
    "LINK_CA_ENV",
    "LINK_CERT_ENV",
    "LINK_KEY_ENV",
    "LINK_PORT",
    "METRICS_PORT",
    "PROFILE_ENV",
    "PROGRESS_FILE",
    "REGION_ENVS",
    "REPLICA_PORT",
    "SECRET_KEY_ENV",
    "SESSION_TOKEN_ENV",
    "STAGE_CONFIG_KIND",
    "CheckpointSpec",
    "Compression",
    "ConfigError",
    "DatasetFormat",
    "DatasetSpec",
    "Dtype",
    "JobRef",
    "LinksSpec",
    "LrSchedule",
    "MethodSpec",
    "MethodType",
    "ModelSpec",
    "ObservabilitySpec",
    "OutputSpec",
    "PipelineSchedule",
    "PipelineSpec",
    "Progress",
    "ReplicaPeer",
    "ReplicasSpec",
    "S3Credentials",
    "S3Endpoint",
    "StageConfig",
    "StageRef",
    "TrainingSpec",
    "Truncation",
    "aws_credentials",
    "link_identity",
    "s3_endpoint",
]
