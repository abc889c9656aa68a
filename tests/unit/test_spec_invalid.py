"""Invalid FineTuneJobs: each is refused by parse_job with the bad field named.

INVALID_CASES (relaytrain_testkit.spec_cases) is shared with tests/k8s/test_crd_api.py, where
the API server must refuse the same manifests (schema or CEL) naming the same field, so both
gates agree.
"""

from __future__ import annotations

import pytest
from relaytrain_operator.spec import SpecError, parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.spec_cases import INVALID_CASES, Case

pytestmark = pytest.mark.unit


def test_there_are_at_least_twenty_distinct_cases() -> None:
    assert len({c.id for c in INVALID_CASES}) == len(INVALID_CASES) >= 20


@pytest.mark.parametrize("case", INVALID_CASES, ids=[c.id for c in INVALID_CASES])
def test_parse_job_refuses_and_names_the_field(case: Case) -> None:
    with pytest.raises(SpecError) as info:
        parse_job(case.apply(Job()).build())
    assert case.field in info.value.paths, str(info.value)
    assert case.field in str(info.value)


def test_the_smallest_job_is_valid() -> None:
    # Otherwise every case above would pass for the wrong reason.
    job = parse_job(Job().build())
    assert job.spec.training.steps == 100


def test_unknown_field_error_lists_the_valid_names() -> None:
    case = Case("typo", "spec.training.setps", 100, "spec.training.setps")
    with pytest.raises(SpecError) as info:
        parse_job(case.apply(Job()).build())
    assert "valid fields here:" in str(info.value)
    assert "steps" in str(info.value)


def test_enum_error_says_what_is_valid() -> None:
    case = Case("x", "spec.pipeline.compression", "zstd", "")
    with pytest.raises(SpecError) as info:
        parse_job(case.apply(Job()).build())
    message = dict(info.value.problems)["spec.pipeline.compression"]
    assert all(mode in message for mode in ("none", "bf16", "int8", "int4"))
    assert "zstd" in message


def test_uri_error_explains_the_accepted_forms() -> None:
    case = Case("x", "spec.model.uri", "gs://bucket/model", "")
    with pytest.raises(SpecError) as info:
        parse_job(case.apply(Job()).build())
    message = dict(info.value.problems)["spec.model.uri"]
    assert "s3://bucket/prefix" in message and "hf://org/name" in message


def test_every_problem_is_reported_at_once() -> None:
    manifest = Job().method(rank=0, dropout=2.0).pipeline(compression="zip").build()
    with pytest.raises(SpecError) as info:
        parse_job(manifest)
    assert set(info.value.paths) == {
        "spec.method.rank",
        "spec.method.dropout",
        "spec.pipeline.compression",
    }


def test_wrong_kind_and_non_mapping_are_refused() -> None:
    manifest = Job().set("kind", "Job").build()
    with pytest.raises(SpecError, match="kind"):
        parse_job(manifest)
    with pytest.raises(SpecError, match="mapping"):
        parse_job(["not", "a", "job"])  # type: ignore[arg-type]
