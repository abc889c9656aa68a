"""The FineTuneJob API: spec models, parse_job and SpecError, and the status shape.

`from relaytrain_operator.spec import parse_job, FineTuneJob, SpecError` is the public face;
job.py holds the spec models, status.py the status, errors.py how problems are reported.
"""

from relaytrain_operator.spec.errors import SpecError
from relaytrain_operator.spec.job import (
    API_VERSION,
    KIND,
    MAX_REPLICAS,
    MAX_STAGES,
    CheckpointSpec,
    CredentialsSecret,
    DatasetSpec,
    FailurePolicy,
    FineTuneJob,
    FineTuneJobSpec,
    MethodSpec,
    ModelSpec,
    ObjectMeta,
    OutputSpec,
    PipelineSpec,
    PlacementSpec,
    Toleration,
    TrainingSpec,
    is_s3,
    parse_job,
)
from relaytrain_operator.spec.patterns import JOB_NAME_MAX
from relaytrain_operator.spec.status import (
    PHASES,
    Condition,
    FineTuneJobStatus,
    OutputStatus,
    Phase,
    PlanBottleneck,
    PlannedStage,
    PlanStatus,
    ProgressStatus,
    StageStatus,
    status_patch,
)

__all__ = [
    "API_VERSION",
    "JOB_NAME_MAX",
    "KIND",
    "MAX_REPLICAS",
    "MAX_STAGES",
    "PHASES",
    "CheckpointSpec",
    "Condition",
    "CredentialsSecret",
    "DatasetSpec",
    "FailurePolicy",
    "FineTuneJob",
    "FineTuneJobSpec",
    "FineTuneJobStatus",
    "MethodSpec",
    "ModelSpec",
    "ObjectMeta",
    "OutputSpec",
    "OutputStatus",
    "Phase",
    "PipelineSpec",
    "PlacementSpec",
    "PlanBottleneck",
    "PlanStatus",
    "PlannedStage",
    "ProgressStatus",
    "SpecError",
    "StageStatus",
    "Toleration",
    "TrainingSpec",
    "is_s3",
    "parse_job",
    "status_patch",
]
