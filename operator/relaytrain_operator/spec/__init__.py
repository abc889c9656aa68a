"""The FineTuneJob API: spec models, parse_job and SpecError, and the status shape.

`from relaytrain_operator.spec import parse_job, FineTuneJob, SpecError` is the public face;
job.py holds the manifest and its spec (sections.py the spec's sections), status.py the
status, errors.py how problems are reported; crd.py generates the CRD from them, with what
openapi.py lets a model or field say beyond its type (CEL rules, list types...).
"""

from relaytrain_operator.spec.errors import SpecError
from relaytrain_operator.spec.job import (
    API_VERSION,
    KIND,
    FineTuneJob,
    FineTuneJobSpec,
    ObjectMeta,
    parse_job,
)
from relaytrain_operator.spec.patterns import JOB_NAME_MAX
from relaytrain_operator.spec.pipeline import MAX_REPLICAS, MAX_STAGES, PipelineSpec
from relaytrain_operator.spec.placement import PlacementSpec, Toleration
from relaytrain_operator.spec.sections import (
    CheckpointSpec,
    CredentialsSecret,
    DatasetSpec,
    FailurePolicy,
    LinkCertificatesSpec,
    MethodSpec,
    ModelSpec,
    OutputSpec,
    TrainingSpec,
    is_s3,
)
from relaytrain_operator.spec.status import (
    PHASES,
    Condition,
    FineTuneJobStatus,
    FormerPlan,
    GrowthStatus,
    LinkCertificatesStatus,
    OutputStatus,
    Phase,
    PipelineStatus,
    PlanBottleneck,
    PlannedStage,
    PlanPipeline,
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
    "FormerPlan",
    "GrowthStatus",
    "LinkCertificatesSpec",
    "LinkCertificatesStatus",
    "MethodSpec",
    "ModelSpec",
    "ObjectMeta",
    "OutputSpec",
    "OutputStatus",
    "Phase",
    "PipelineSpec",
    "PipelineStatus",
    "PlacementSpec",
    "PlanBottleneck",
    "PlanPipeline",
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
