"""build_stage_configs: the documents each stage is started with (docs/stage-contract.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from relaytrain_contract import GRADIENT_BITS
from relaytrain_operator.domain.stage_config import (
    LINK_CREDENTIALS_DIR,
    build_stage_configs,
    layer_ranges,
    local_endpoints,
    output_uri,
    pod_endpoints,
)
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

RANGES = [(0, 10), (10, 20), (20, 30)]


JOB = Job("smollm-lora", "team-a").uid("u-1")


def test_pods_chain_through_stable_dns_names() -> None:
    docs = build_stage_configs(
        parse_job(JOB.build()), RANGES, pod_endpoints("smollm-lora", "team-a", 3)
    )
    assert [d["links"]["listen"] for d in docs] == [None, "0.0.0.0:29500", "0.0.0.0:29500"]
    assert [d["links"]["next"] for d in docs] == [
        "smollm-lora-stage-1.smollm-lora.team-a.svc:29500",
        "smollm-lora-stage-2.smollm-lora.team-a.svc:29500",
        None,
    ]
    # Each pod reads its credentials where the job's link Secret is mounted.
    assert [d["links"]["credentialsDir"] for d in docs] == [LINK_CREDENTIALS_DIR] * 3
    assert all("certEnv" not in d["links"] for d in docs)


def test_each_stage_knows_its_link_identity_and_its_neighbours() -> None:
    docs = build_stage_configs(
        parse_job(JOB.build()), RANGES, pod_endpoints("smollm-lora", "team-a", 3)
    )
    ids = [f"relaytrain://team-a/smollm-lora/p0/s{k}" for k in range(3)]
    assert [d["links"]["identity"] for d in docs] == ids
    assert [d["links"]["prevIdentity"] for d in docs] == [None, ids[0], ids[1]]
    assert [d["links"]["nextIdentity"] for d in docs] == [ids[1], ids[2], None]


def test_stage_numbers_and_layers_follow_the_plan() -> None:
    docs = build_stage_configs(
        parse_job(JOB.build()), RANGES, pod_endpoints("smollm-lora", "team-a", 3)
    )
    assert [d["stage"] for d in docs] == [
        {"index": k, "count": 3, "layerStart": s, "layerEnd": e} for k, (s, e) in enumerate(RANGES)
    ]
    assert docs[0]["job"] == {"namespace": "team-a", "name": "smollm-lora", "uid": "u-1"}


def test_spec_reaches_the_worker_in_contract_names() -> None:
    docs = build_stage_configs(
        parse_job(JOB.method("qlora", rank=4).pipeline(compression="int4").build()),
        [*RANGES[:1], (10, 30)],
        local_endpoints(2, 29500, 9400),
    )
    doc = docs[1]
    assert doc["method"]["type"] == "qlora" and doc["method"]["rank"] == 4
    assert doc["pipeline"] == {
        "schedule": "1f1b",
        "compression": "int4",
        "forwardsAhead": 0,
        "gradientTokens": 1.0,
        "gradientBits": GRADIENT_BITS,
        "gradientFill": "none",
        "activationError": "int4",
        "activationBasis": "identity",
    }
    assert doc["training"]["microBatchSize"] == 1 and doc["training"]["steps"] == 100
    # No endpoint: AWS S3. No credential Secret: no variables named; AWS's standard chain.
    assert doc["checkpoint"]["endpoint"] is None
    assert (doc["checkpoint"]["accessKeyEnv"], doc["checkpoint"]["secretKeyEnv"]) == (None, None)
    # Documents are JSON, and hold no secret values (only env var names).
    json.dumps(doc)


def test_local_processes_get_distinct_ports() -> None:
    docs = build_stage_configs(parse_job(JOB.build()), RANGES, local_endpoints(3, 31000, 9500))
    assert [d["links"]["listen"] for d in docs] == [None, "127.0.0.1:31001", "127.0.0.1:31002"]
    assert [d["links"]["next"] for d in docs] == ["127.0.0.1:31001", "127.0.0.1:31002", None]
    assert [d["observability"]["port"] for d in docs] == [9500, 9501, 9502]


def test_output_defaults_under_the_checkpoint_store() -> None:
    assert (
        output_uri(parse_job(JOB.build()))
        == "s3://relaytrain/checkpoints/team-a/smollm-lora/output/"
    )
    explicit = parse_job(JOB.output("s3://adapters/smol/").build())
    assert output_uri(explicit) == "s3://adapters/smol/"


def test_documents_are_independent() -> None:
    docs = build_stage_configs(
        parse_job(JOB.build()), RANGES, pod_endpoints("smollm-lora", "team-a", 3)
    )
    docs[0]["method"]["targetModules"].append("gate_proj")
    assert docs[1]["method"]["targetModules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class _Stage:
    layer_start: int
    layer_end: int


@dataclass
class _Plan:
    stages: list[_Stage]


def test_plan_shapes_accepted() -> None:
    want = [(0, 5), (5, 12)]
    assert layer_ranges(want) == want
    assert layer_ranges(_Plan([_Stage(0, 5), _Stage(5, 12)])) == want
    assert (
        layer_ranges(
            {"stages": [{"layerStart": 0, "layerEnd": 5}, {"layerStart": 5, "layerEnd": 12}]}
        )
        == want
    )


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(0, 10), (11, 20)], "contiguous"),
        ([(1, 10), (10, 20)], "contiguous"),
        ([(0, 10), (10, 10)], "non-empty"),
        ([], "no stages"),
    ],
)
def test_broken_plans_are_refused(ranges: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_stage_configs(
            parse_job(JOB.build()), ranges, pod_endpoints("smollm-lora", "team-a", len(ranges))
        )


def test_stage_count_must_match_spec_and_endpoints() -> None:
    with pytest.raises(ValueError, match=r"pipeline\.stages is 2"):
        build_stage_configs(
            parse_job(JOB.pipeline(stages=2).build()),
            RANGES,
            pod_endpoints("smollm-lora", "team-a", 3),
        )
    with pytest.raises(ValueError, match="2 endpoints for 3 stages"):
        build_stage_configs(
            parse_job(JOB.build()), RANGES, pod_endpoints("smollm-lora", "team-a", 2)
        )


def test_a_credential_secret_is_named_by_its_environment_variables() -> None:
    docs = build_stage_configs(
        parse_job(JOB.checkpoint("s3://ckpt/x").credentials("s3").build()),
        RANGES,
        pod_endpoints("smollm-lora", "team-a", 3),
    )
    assert {(d["checkpoint"]["accessKeyEnv"], d["checkpoint"]["secretKeyEnv"]) for d in docs} == {
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
