"""parse_job on valid manifests: defaults, the shipped examples, API-server objects, status."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from relaytrain_operator.spec import (
    PHASES,
    Condition,
    FineTuneJobStatus,
    ProgressStatus,
    SpecError,
    parse_job,
    status_patch,
)
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("finetunejob-*.yaml"))


def test_defaults_match_the_design() -> None:
    spec = parse_job(Job().build()).spec
    assert spec.model.dtype == "bfloat16"
    assert spec.method.type == "lora" and spec.method.rank == 8 and spec.method.alpha == 16
    assert spec.method.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert spec.pipeline.stages == "auto"
    assert spec.pipeline.replicas == 1
    assert spec.pipeline.schedule == "1f1b"
    assert spec.pipeline.compression == "int8"
    assert spec.placement.gpu_label == "nvidia.com/gpu.product"
    assert spec.placement.pools == []
    assert spec.dataset.format == "text"
    assert spec.checkpoint.keep == 2
    assert spec.suspend is False
    assert spec.output is None and spec.image is None


def test_every_example_parses() -> None:
    assert len(EXAMPLES) >= 3
    methods = set()
    for path in EXAMPLES:
        job = parse_job(yaml.safe_load(path.read_text()))
        methods.add(job.spec.method.type)
    assert methods == {"lora", "qlora", "full"}


def test_object_from_the_api_server_parses() -> None:
    # What kopf hands the operator: defaults filled in (JSON ints where floats are meant),
    # server metadata, and a status the operator wrote.
    manifest = (
        Job("job", "team-a")
        .uid("b3594e34")
        .generation(3)
        .set("metadata.resourceVersion", "42")
        .set("metadata.managedFields", [{"manager": "kubectl"}])
        .set("metadata.creationTimestamp", "2026-11-22T05:00:00Z")
        .method("lora", dropout=0)
        .training(max_grad_norm=1, learning_rate=1)
        .status({"phase": "Running", "whatever": "the operator wrote"})
    )
    job = parse_job(manifest.build())
    assert job.metadata.uid == "b3594e34" and job.metadata.generation == 3
    assert job.metadata.namespace == "team-a"
    assert job.spec.method.dropout == 0.0 and job.spec.training.learning_rate == 1.0


def test_namespace_defaults_for_local_manifests() -> None:
    assert parse_job(Job().build()).metadata.namespace == "default"


def test_python_names_and_manifest_names_round_trip() -> None:
    job = parse_job(yaml.safe_load(EXAMPLES[0].read_text()))
    dumped = job.model_dump(mode="json", exclude_none=True)
    assert "apiVersion" in dumped and "microBatchSize" in dumped["spec"]["training"]
    again = parse_job(dumped)
    assert again == job


def test_default_checkpoint_fills_only_a_missing_checkpoint() -> None:
    manifest = Job().unset("spec.checkpoint").build()
    with pytest.raises(SpecError, match=r"spec\.checkpoint"):
        parse_job(manifest)
    job = parse_job(manifest, default_checkpoint_uri="/tmp/relaytrain-ckpt")
    assert job.spec.checkpoint.uri == "/tmp/relaytrain-ckpt"
    given = parse_job(Job().build(), default_checkpoint_uri="/tmp/other")
    assert given.spec.checkpoint.uri == "s3://relaytrain/checkpoints"


def test_local_paths_and_hf_ids_are_accepted_uris() -> None:
    for uri in (
        "./models/smol",
        "/data/models/smol",
        "file:///data/smol",
        "hf://HuggingFaceTB/SmolLM2-135M",
    ):
        assert parse_job(Job().model(uri).build()).spec.model.uri == uri


def test_epochs_instead_of_steps() -> None:
    manifest = Job().set("spec.training", {"epochs": 3, "warmupSteps": 10}).build()
    training = parse_job(manifest).spec.training
    assert training.epochs == 3 and training.steps is None


def test_stages_take_a_number() -> None:
    assert parse_job(Job().pipeline(stages=3).build()).spec.pipeline.stages == 3


@pytest.mark.parametrize("replicas", [1, 2, 8, "auto"])
def test_replicas_take_a_number_up_to_the_micro_batches_or_auto(replicas: int | str) -> None:
    manifest = Job().pipeline(replicas=replicas).build()  # 8 micro-batches by default
    assert parse_job(manifest).spec.pipeline.replicas == replicas


@pytest.mark.parametrize("ahead", [0, 4, 16, "auto"])
def test_forwards_ahead_take_a_number_up_to_16_or_auto(ahead: int | str) -> None:
    assert parse_job(Job().pipeline(forwards_ahead=ahead).build()).spec.pipeline.forwards_ahead == (
        ahead
    )


def test_forwards_ahead_errors_say_what_is_valid() -> None:
    with pytest.raises(SpecError, match=r'spec.pipeline.forwardsAhead: must be "auto" or an '
                       r"integer from 0 to 16, got 17"):  # fmt: skip
        parse_job(Job().pipeline(forwards_ahead=17).build())


def test_replicas_errors_say_what_is_valid() -> None:
    with pytest.raises(SpecError, match=r'spec.pipeline.replicas: must be "auto" or an integer '
                       r"from 1 to 64, got True"):  # fmt: skip
        parse_job(Job().pipeline(replicas=True).build())
    with pytest.raises(SpecError) as info:
        parse_job(Job().pipeline(replicas=3).training(micro_batches=2).build())
    assert info.value.paths == ["spec.pipeline.replicas"]
    assert "must not exceed training.microBatches (2)" in str(info.value)


def test_status_patch_is_camel_case_and_drops_unset_fields() -> None:
    status = FineTuneJobStatus(
        phase="Running",
        observed_generation=2,
        conditions=[
            Condition(
                type="Ready",
                status="True",
                reason="StagesReady",
                last_transition_time="2026-11-22T05:00:00Z",
            )
        ],
        progress=ProgressStatus(step=3, total_steps=100, step_of_total="3/100", loss=2.5),
        ready_stages="3/3",
    )
    patch = status_patch(status)
    assert patch["observedGeneration"] == 2
    assert patch["progress"] == {"step": 3, "totalSteps": 100, "stepOfTotal": "3/100", "loss": 2.5}
    assert patch["conditions"][0]["lastTransitionTime"] == "2026-11-22T05:00:00Z"
    assert "plan" not in patch and "output" not in patch
    assert FineTuneJobStatus.model_validate(patch) == status


def test_phases_are_the_designed_ones() -> None:
    assert set(PHASES) == {
        "Pending",
        "Planning",
        "Running",
        "Recovering",
        "Succeeded",
        "Failed",
        "Suspended",
    }
