"""Invalid FineTuneJobs, each with the field its refusal must name: parse_job refuses them
(tests/unit/test_spec_invalid.py) and so does the API server, by the CRD's schema or CEL
(tests/k8s/test_crd_api.py), so both gates agree. Each is the smallest valid job
(relaytrain_testkit.jobs.Job()) with one field set or removed."""

from __future__ import annotations

from typing import Any, NamedTuple

from relaytrain_testkit.jobs import Job

DELETE = object()
"""A `Case.value` that removes the field."""


class Case(NamedTuple):
    """One invalid manifest: a valid one with one field set (or removed)."""

    id: str
    path: str  # dotted path from the manifest root, e.g. "spec.training.steps"
    value: Any  # DELETE removes the field
    field: str  # the field the error must name
    also: tuple[tuple[str, Any], ...] = ()
    """Other fields set first (a case that is invalid only with them)."""

    def apply(self, job: Job) -> Job:
        """`job` with this case's field set (or removed)."""
        for path, value in self.also:
            job = job.set(path, value)
        return job.unset(self.path) if self.value is DELETE else job.set(self.path, self.value)


INVALID_CASES = [
    Case("missing-model", "spec.model", DELETE, "spec.model"),
    Case("missing-dataset", "spec.dataset", DELETE, "spec.dataset"),
    Case("missing-training", "spec.training", DELETE, "spec.training"),
    Case("missing-checkpoint", "spec.checkpoint", DELETE, "spec.checkpoint"),
    Case("missing-model-uri", "spec.model.uri", DELETE, "spec.model.uri"),
    Case("negative-steps", "spec.training.steps", -5, "spec.training.steps"),
    Case("zero-steps", "spec.training.steps", 0, "spec.training.steps"),
    Case("steps-as-string", "spec.training.steps", "100", "spec.training.steps"),
    Case("steps-and-epochs", "spec.training.epochs", 2, "spec.training.steps"),
    Case("neither-steps-nor-epochs", "spec.training", {"microBatches": 4}, "spec.training.steps"),
    Case("warmup-exceeds-steps", "spec.training.warmupSteps", 500, "spec.training.warmupSteps"),
    Case(
        "stop-with-epochs",
        "spec.training",
        {"epochs": 2, "endOfData": "stop"},
        "spec.training.endOfData",
    ),
    Case("unknown-end-of-data", "spec.training.endOfData", "wrap", "spec.training.endOfData"),
    Case("zero-learning-rate", "spec.training.learningRate", 0, "spec.training.learningRate"),
    Case("unknown-lr-schedule", "spec.training.schedule", "step", "spec.training.schedule"),
    Case("unknown-compression", "spec.pipeline.compression", "zstd", "spec.pipeline.compression"),
    Case("zero-stages", "spec.pipeline.stages", 0, "spec.pipeline.stages"),
    Case("zero-gradient-tokens", "spec.pipeline.gradientTokens", 0, "spec.pipeline.gradientTokens"),
    Case(
        "gradient-tokens-without-delta",
        "spec.pipeline.gradientTokens",
        0.5,
        "spec.pipeline.gradientTokens",
        also=(("spec.pipeline.compression", "int8"),),
    ),
    Case(
        "unknown-gradient-fill", "spec.pipeline.gradientFill", "idle", "spec.pipeline.gradientFill"
    ),
    Case(
        "gradient-fill-with-every-token",
        "spec.pipeline.gradientFill",
        "activations",
        "spec.pipeline.gradientFill",
        also=(("spec.pipeline.compression", "delta"),),
    ),
    Case("gradient-bits-zero", "spec.pipeline.gradientBits", 0, "spec.pipeline.gradientBits"),
    Case(
        "gradient-bits-without-delta",
        "spec.pipeline.gradientBits",
        1,
        "spec.pipeline.gradientBits",
        also=(("spec.pipeline.compression", "int8"),),
    ),
    Case(
        "unknown-activation-error",
        "spec.pipeline.activationError",
        "int2",
        "spec.pipeline.activationError",
    ),
    Case(
        "activation-error-without-delta",
        "spec.pipeline.activationError",
        "int3",
        "spec.pipeline.activationError",
        also=(("spec.pipeline.compression", "int8"),),
    ),
    Case(
        "unknown-activation-basis",
        "spec.pipeline.activationBasis",
        "pca",
        "spec.pipeline.activationBasis",
    ),
    Case(
        "activation-basis-without-delta",
        "spec.pipeline.activationBasis",
        "fitted",
        "spec.pipeline.activationBasis",
        also=(("spec.pipeline.compression", "int4"),),
    ),
    Case("stages-word", "spec.pipeline.stages", "three", "spec.pipeline.stages"),
    Case("unknown-pipeline-schedule", "spec.pipeline.schedule", "gpipe", "spec.pipeline.schedule"),
    Case("zero-replicas", "spec.pipeline.replicas", 0, "spec.pipeline.replicas"),
    Case("replicas-word", "spec.pipeline.replicas", "many", "spec.pipeline.replicas"),
    Case("replicas-above-64", "spec.pipeline.replicas", 65, "spec.pipeline.replicas"),
    Case(
        "forwards-ahead-negative", "spec.pipeline.forwardsAhead", -1, "spec.pipeline.forwardsAhead"
    ),
    Case(
        "forwards-ahead-word", "spec.pipeline.forwardsAhead", "many", "spec.pipeline.forwardsAhead"
    ),
    Case(
        "forwards-ahead-above-16", "spec.pipeline.forwardsAhead", 17, "spec.pipeline.forwardsAhead"
    ),
    # The smallest job's 8 micro-batches (the default) cannot feed 9 pipelines.
    Case("more-replicas-than-micro-batches", "spec.pipeline.replicas", 9, "spec.pipeline.replicas"),
    Case("sync-word", "spec.pipeline.sync.mode", "sometimes", "spec.pipeline.sync.mode"),
    Case(
        "periodic-without-every",
        "spec.pipeline.sync",
        {"mode": "periodic"},
        "spec.pipeline.sync.everySteps",
    ),
    Case(
        "periodic-every-step",
        "spec.pipeline.sync",
        {"mode": "periodic", "everySteps": 1},
        "spec.pipeline.sync.everySteps",
    ),
    Case(
        "every-without-periodic",
        "spec.pipeline.sync",
        {"everySteps": 4},
        "spec.pipeline.sync.everySteps",
    ),
    Case(
        "outer-code-without-periodic",
        "spec.pipeline.sync",
        {"outerCode": "int2"},
        "spec.pipeline.sync.outerCode",
    ),
    Case(
        "outer-code-word",
        "spec.pipeline.sync",
        {"mode": "periodic", "everySteps": 4, "outerCode": "int3"},
        "spec.pipeline.sync.outerCode",
    ),
    Case(
        "exact-merge-with-qlora",
        "spec.pipeline.sync",
        {"mode": "periodic", "everySteps": 4, "loraMerge": "exact"},
        "spec.pipeline.sync.loraMerge",
        also=(("spec.method.type", "qlora"),),
    ),
    Case(
        "lora-merge-word",
        "spec.pipeline.sync",
        {"mode": "periodic", "everySteps": 4, "loraMerge": "mean"},
        "spec.pipeline.sync.loraMerge",
    ),
    Case("lora-rank-zero", "spec.method.rank", 0, "spec.method.rank"),
    Case("dropout-1.5", "spec.method.dropout", 1.5, "spec.method.dropout"),
    Case("dropout-exactly-1", "spec.method.dropout", 1.0, "spec.method.dropout"),
    Case("unknown-method", "spec.method.type", "dora", "spec.method.type"),
    Case("no-target-modules", "spec.method.targetModules", [], "spec.method.targetModules"),
    Case(
        "repeated-target-module",
        "spec.method.targetModules",
        ["q_proj", "q_proj"],
        "spec.method.targetModules",
    ),
    Case("unknown-field", "spec.learningRate", 0.1, "spec.learningRate"),
    Case("unknown-nested-field", "spec.training.batchSize", 8, "spec.training.batchSize"),
    Case("bad-s3-bucket", "spec.model.uri", "s3://My_Models/smol", "spec.model.uri"),
    Case("s3-without-bucket", "spec.checkpoint.uri", "s3://", "spec.checkpoint.uri"),
    Case("http-model-uri", "spec.model.uri", "https://example.com/model", "spec.model.uri"),
    Case("hf-dataset-uri", "spec.dataset.uri", "hf://org/data", "spec.dataset.uri"),
    Case("unknown-dtype", "spec.model.dtype", "int8", "spec.model.dtype"),
    Case("unknown-data-format", "spec.dataset.format", "csv", "spec.dataset.format"),
    Case("tiny-sequence", "spec.dataset.sequenceLength", 4, "spec.dataset.sequenceLength"),
    Case(
        "endpoint-without-scheme",
        "spec.checkpoint.endpoint",
        "minio:9000",
        "spec.checkpoint.endpoint",
    ),
    Case(
        "endpoint-on-local-store",
        "spec.checkpoint",
        {"uri": "/var/ckpt", "endpoint": "http://minio:9000"},
        "spec.checkpoint.endpoint",
    ),
    Case(
        "secret-without-name",
        "spec.checkpoint.credentialsSecret",
        {"accessKeyKey": "k"},
        "spec.checkpoint.credentialsSecret.name",
    ),
    Case("keep-zero", "spec.checkpoint.keep", 0, "spec.checkpoint.keep"),
    Case(
        "validation-uri-and-fraction",
        "spec.dataset.validation",
        {"uri": "s3://datasets/held-out.jsonl", "fraction": 0.1},
        "spec.dataset.validation.uri",
    ),
    Case("validation-empty", "spec.dataset.validation", {}, "spec.dataset.validation.uri"),
    Case(
        "validation-fraction-one",
        "spec.dataset.validation",
        {"fraction": 1.0},
        "spec.dataset.validation.fraction",
    ),
    Case(
        "validation-fraction-zero",
        "spec.dataset.validation",
        {"fraction": 0.0},
        "spec.dataset.validation.fraction",
    ),
    Case("eval-every-negative", "spec.training.evalEverySteps", -1, "spec.training.evalEverySteps"),
    Case(
        "eval-every-without-validation",
        "spec.training.evalEverySteps",
        10,
        "spec.training.evalEverySteps",
    ),
    Case(
        "negative-restarts",
        "spec.failurePolicy.maxStageRestarts",
        -1,
        "spec.failurePolicy.maxStageRestarts",
    ),
    Case(
        "bad-toleration-effect",
        "spec.placement.tolerations",
        [{"key": "gpu", "operator": "Exists", "effect": "Sometimes"}],
        "spec.placement.tolerations[0].effect",
    ),
    Case("repeated-pool", "spec.placement.pools", ["a100", "a100"], "spec.placement.pools"),
    Case("suspend-as-string", "spec.suspend", "yes", "spec.suspend"),
    Case("name-too-long", "metadata.name", "a" * 51, "metadata.name"),
    Case("name-with-dot", "metadata.name", "smol.lora", "metadata.name"),
]
