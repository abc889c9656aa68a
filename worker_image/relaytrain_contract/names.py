"""Names both sides of the stage contract agree on: versions, ports, environment variables.

The operator writes them into pods and stage documents; `relaytrain run --local` into
processes; the worker reads them. Each is defined here once (docs/stage-contract.md).
"""

from __future__ import annotations

API_VERSION = "relaytrain.io/v1alpha1"
"""apiVersion of a stage document (the FineTuneJob API's group and version)."""
STAGE_CONFIG_KIND = "StageConfig"
"""kind of a stage document."""

CONFIG_ENV = "RELAYTRAIN_STAGE_CONFIG"
"""Environment variable carrying a stage's document (in a pod; locally `--config PATH`)."""
DEVICE_ENV = "RELAYTRAIN_DEVICE"
"""Environment variable saying where a stage computes (docs/stage-contract.md, "Device"):
`cuda` (the pod's GPU; a stage that sees none stops, saying so), `cpu`, or `auto` (CUDA
where torch sees a device, else the CPU; also when unset, as in `relaytrain run --local`).
The operator sets it on every stage pod from its `workerDevice` setting."""
DEVICES = ("auto", "cuda", "cpu")
"""The values `DEVICE_ENV` may take."""
LINK_CREDENTIALS_DIR = "/var/run/relaytrain/link"
"""Folder in a stage pod holding its link credentials (the job's link Secret, mounted)."""
LINK_CERT_FILE = "tls.crt"
"""File (in the credentials folder) holding the stage's link certificate (PEM)."""
LINK_KEY_FILE = "tls.key"
"""File holding the private key of that certificate (PEM)."""
LINK_CA_FILE = "ca.crt"
"""File holding the CA certificates the stage trusts: its job's link CA, and while the
operator renews the job's certificates, the next CA as well (PEM, one after the other)."""
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
"""Environment variable holding the S3 access key id (AWS's standard name)."""
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
"""Environment variable holding the S3 secret access key (AWS's standard name)."""
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
"""Environment variable holding a temporary session token (AWS's standard credential chain)."""
CREDENTIALS_FILE_ENV = "AWS_SHARED_CREDENTIALS_FILE"
"""Environment variable naming AWS's shared credentials file (default ~/.aws/credentials)."""
PROFILE_ENV = "AWS_PROFILE"
"""Environment variable naming the profile of that file to use (default `default`)."""
REGION_ENVS = ("AWS_REGION", "AWS_DEFAULT_REGION")
"""Environment variables naming the AWS region, in the order AWS's tools read them."""

LINK_PORT = 29500
"""Port on which stage k listens for stage k-1 (in pods)."""
METRICS_PORT = 9400
"""Port of a stage's /metrics and /healthz (in pods)."""
REPLICA_PORT = 29501
"""Port on which a stage of pipeline p > 0 accepts the stages of lower pipelines that share
its layers (in pods; jobs with several pipelines only)."""

PROGRESS_FILE = "progress.json"
"""The progress record under `<checkpoint.uri>/<namespace>/<job>/` (see progress.py)."""
GIVEN_UP_FILE = "given-up.json"
"""`{"pipelines": [r, ...]}` under `<checkpoint.uri>/<namespace>/<job>/`: the pipelines the
operator gave up for good (a stage out of restarts), written by the operator when it gives
one up. A stage that links does not wait for their stages; none of them trains again."""
FLEET_FILE = "fleet.json"
"""The pipelines added to a running job (`fleet.FleetDocument`) under
`<checkpoint.uri>/<namespace>/<job>/`, written before the added pipeline's stages start
(by the operator, or `relaytrain run --local`): the stages training read it and link to
them."""

PLAN_FILE = "plan.json"
"""`{"uid": "<job uid>", "epoch": N}` under `<checkpoint.uri>/<namespace>/<job>/`: the plan
whose stages may write checkpoints, written by the operator before it creates the stages of
a plan that replaced every stage (`JobRef.plan_epoch` N). A stage of the same job with an
older plan stops before it writes a checkpoint: one still running on a node cut off, or
outliving its pod, cannot commit under its replacement's feet (relaytrain_contract.fence)."""


def link_identity(namespace: str, job_name: str, pipeline: int, stage: int) -> str:
    """Who a stage is on the links: the one URI SAN of its certificate, checked by neighbours.

    `pipeline` is 0 while a job has one; `stage` the stage's index.
    """
    return f"relaytrain://{namespace}/{job_name}/p{pipeline}/s{stage}"
