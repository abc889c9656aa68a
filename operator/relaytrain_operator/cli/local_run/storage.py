"""What a local run reads: the model's config.json and the files its stages write to the
job's checkpoint directory (progress.json, the loss history), on disk or on S3.

S3 is reached as the stages reach it: the contract's endpoint rule and AWS's standard
credential chain (the operator's own reader, `objectstore`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relaytrain_contract import PROGRESS_FILE, ConfigError, Progress

from relaytrain_operator.domain.planner import ModelShape
from relaytrain_operator.spec import FineTuneJob, SpecError


def model_layers(job: FineTuneJob) -> int:
    """The decoder layers of the job's model, from its config.json (a local path or S3).

    Raises SpecError naming spec.model.uri when config.json is missing or the planner
    refuses it (an unsupported model_type), before any stage starts.
    """
    uri = job.spec.model.uri
    if uri.startswith("s3://"):
        data = s3_read(job, uri, "config.json")
        if data is None:
            raise SpecError([("spec.model.uri", f"{uri.rstrip('/')}/config.json does not exist")])
    else:
        path = Path(uri.removeprefix("file://")) / "config.json"
        if not path.is_file():
            raise SpecError([("spec.model.uri", f"{path} does not exist")])
        data = path.read_bytes()
    try:  # the planner's reading: an unsupported model_type is refused before any stage
        return ModelShape.from_hf_config(json.loads(data)).num_layers
    except ValueError as err:  # a ModelShapeError, or not JSON
        raise SpecError([("spec.model.uri", f"{uri.rstrip('/')}/config.json: {err}")]) from None


def s3_read(job: FineTuneJob, uri: str, name: str) -> bytes | None:
    """`<uri>/<name>` from the job's object store, reached as its stages reach it: the
    contract's endpoint rule and AWS's standard credential chain (the operator's own reader,
    `objectstore`). None: no such object. Raises OSError when the store cannot be read."""
    # The minio client comes with the operator extra: imported only for a job on S3.
    from minio.error import MinioException

    from relaytrain_operator.store.objectstore import StoreAccess, StoreError, read_object

    access = StoreAccess.from_environ(job.spec.checkpoint.endpoint)
    try:
        return read_object(uri, name, access)
    except StoreError as err:
        raise OSError(str(err)) from err
    except MinioException as err:  # an answer, but not S3's
        raise OSError(f"reading {name} under {uri}: {err}") from err


def read_json(job: FineTuneJob, job_dir: str, name: str) -> Any:
    """`name` in the job's checkpoint directory `job_dir`, parsed (None: none yet, or
    unreadable this poll: the next one tries again)."""
    try:
        if job_dir.startswith("s3://"):
            data = s3_read(job, job_dir, name)
        else:
            path = Path(job_dir.removeprefix("file://")) / name
            data = path.read_bytes() if path.is_file() else None
        return json.loads(data) if data is not None else None
    except (OSError, ValueError):
        return None
    except Exception:  # anything else from the S3 client: a read must not end the run
        return None


def read_progress(job: FineTuneJob, job_dir: str) -> Progress | None:
    """The job's progress.json (None: none yet, or unreadable this poll)."""
    record = read_json(job, job_dir, PROGRESS_FILE)
    try:
        return Progress.from_json(record) if isinstance(record, dict) else None
    except ConfigError:
        return None


def write_json(job: FineTuneJob, job_dir: str, name: str, value: dict[str, Any]) -> None:
    """Write `name` into the job's checkpoint directory `job_dir` (on disk or S3), as the
    operator writes what it tells the stages. Raises OSError when it cannot."""
    if job_dir.startswith("s3://"):
        from relaytrain_operator.store.objectstore import StoreAccess, StoreError
        from relaytrain_operator.store.objectstore import write_json as s3_write

        try:
            s3_write(job_dir, name, value, StoreAccess.from_environ(job.spec.checkpoint.endpoint))
        except StoreError as err:
            raise OSError(str(err)) from err
        return
    path = Path(job_dir.removeprefix("file://")) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
