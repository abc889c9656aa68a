"""relaytrain_contract beyond the stage document: the S3 endpoint rule and progress.json."""

from __future__ import annotations

import math

import pytest
from relaytrain_contract import ConfigError, Progress, S3Endpoint, s3_endpoint

pytestmark = pytest.mark.unit

EU_WEST = "s3.eu-west-1.amazonaws.com"
AWS_ENV = {"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        (None, S3Endpoint("s3.amazonaws.com", True, "eu-west-1")),
        ("", S3Endpoint("s3.amazonaws.com", True, "eu-west-1")),
        ("https://s3.eu-west-1.amazonaws.com", S3Endpoint(EU_WEST, True, "eu-west-1")),
        ("http://minio.minio:9000", S3Endpoint("minio.minio:9000", False)),
        ("https://minio.example", S3Endpoint("minio.example", True)),
        ("localhost:9000", S3Endpoint("localhost:9000", False)),
    ],
)  # fmt: skip
def test_an_empty_endpoint_is_aws_s3_and_aws_region_is_only_aws(
    endpoint: str | None, expected: S3Endpoint
) -> None:
    assert s3_endpoint(endpoint, AWS_ENV) == expected


def test_the_default_region_serves_when_aws_region_is_unset() -> None:
    assert s3_endpoint(None, {"AWS_DEFAULT_REGION": "ap-south-1"}).region == "ap-south-1"
    assert s3_endpoint(None, {}).region is None  # the client asks the bucket


def test_a_progress_record_reads_back_and_tolerates_what_it_does_not_know() -> None:
    record = Progress(step=3, totalSteps=10, loss=math.inf, tokensPerSecond=5.0).stamped()
    assert record.loss is None and record.updated_at is not None
    back = Progress.from_json(record.to_json())
    assert back == record
    newer = {**back.model_dump(mode="json"), "pipelines": [{"step": 3}]}
    assert Progress.from_json(newer) == record


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"step": 11, "totalSteps": 10, "tokensPerSecond": 1.0}, r"^step: step 11 of 10"),
        ({"step": "3", "totalSteps": 10, "tokensPerSecond": 1.0}, r"^step: should be a valid"),
        ({"step": 3, "tokensPerSecond": 1.0}, r"^totalSteps: required$"),
    ],
)
def test_a_bad_progress_record_names_the_field(record: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Progress.from_json(record)
