"""The one builder of FineTuneJob manifests in the tests (after Kubeflow Trainer's
pkg/util/testing/wrapper.go): `Job()` is the smallest valid job, each method returns a new
Job with one thing changed, and `.build()` returns the manifest as a fresh dict.

    Job("smol", "team-a").pipeline(stages=2).training(steps=10, micro_batches=4).build()

- A section method (`model`, `dataset`, `method`, `training`, `pipeline`, `placement`,
  `checkpoint`, `failure_policy`) merges the fields it is given into that spec section,
  snake_case names written camelCase; a field left None is left as it is.
- `set(path, value)` sets anything by its dotted path from the manifest's root (a whole
  section, a value of the wrong type for a test of refusal); `unset(path)` removes it.
- A Job never changes once made, so a preset is a plain constant (`decide_cases.JOB`,
  `stage_pods.JOB`) that tests extend without touching each other's; presets that need a
  workspace or a MinIO take it as an argument (`local_jobs.local_job`).
- `Job.example(name)` starts from a shipped example (examples/<name>.yaml).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from relaytrain_testkit import REPO

API_VERSION = "relaytrain.io/v1alpha1"
KIND = "FineTuneJob"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label that hands a job to a Kueue LocalQueue."""

_SMALLEST_SPEC: dict[str, Any] = {
    "model": {"uri": "s3://models/smollm2-135m/"},
    "dataset": {"uri": "s3://datasets/train.jsonl"},
    "training": {"steps": 100},
    "checkpoint": {"uri": "s3://relaytrain/checkpoints"},
}
"""What a FineTuneJob must name; everything else takes the CRD's defaults."""


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


class Job:
    """A FineTuneJob manifest, built a step at a time; every step returns a new Job."""

    __slots__ = ("_manifest",)

    def __init__(self, name: str = "job", namespace: str | None = None) -> None:
        """The smallest valid job: SmolLM2-135M and a data set in S3, 100 steps, checkpoints
        in S3; no namespace unless given (parse_job then says "default")."""
        metadata: dict[str, Any] = {"name": name}
        if namespace is not None:
            metadata["namespace"] = namespace
        self._manifest: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": metadata,
            "spec": copy.deepcopy(_SMALLEST_SPEC),
        }

    # --- where it starts from -----------------------------------------------------------

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> Job:
        """A Job holding a copy of `manifest`, whatever it holds."""
        job = cls.__new__(cls)
        job._manifest = copy.deepcopy(manifest)
        return job

    @classmethod
    def from_file(cls, path: Path) -> Job:
        """The job in the YAML file at `path`."""
        manifest: dict[str, Any] = yaml.safe_load(path.read_text())
        return cls.of(manifest)

    @classmethod
    def example(cls, name: str) -> Job:
        """A shipped example: `Job.example("finetunejob-lora")` is
        examples/finetunejob-lora.yaml, `"chat/finetunejob-chat"` the chat example."""
        return cls.from_file(REPO / "examples" / f"{name}.yaml")

    # --- the way out --------------------------------------------------------------------

    def build(self) -> dict[str, Any]:
        """The manifest, a fresh copy each call."""
        return copy.deepcopy(self._manifest)

    def yaml(self) -> str:
        """The manifest as YAML."""
        return yaml.safe_dump(self._manifest)

    def write(self, where: Path) -> Path:
        """The manifest as YAML at `where`, or at `<where>/<name>.yaml` when `where` is a
        directory; returns the file's path."""
        path = where / f"{self._manifest['metadata']['name']}.yaml" if where.is_dir() else where
        path.write_text(self.yaml())
        return path

    # --- anything -----------------------------------------------------------------------

    def set(self, path: str, value: Any) -> Job:
        """`value` (a copy) at the dotted `path` from the manifest's root, e.g.
        `set("spec.training.warmupSteps", 3)`; missing parents are made."""
        *parents, last = path.split(".")
        return self._merge(".".join(parents), {last: value})

    def unset(self, path: str) -> Job:
        """The field at the dotted `path` removed (nothing happens if it is not there)."""
        *parents, last = path.split(".")
        manifest = copy.deepcopy(self._manifest)
        node = manifest
        for key in parents:
            node = node.get(key, {})
        node.pop(last, None)
        return Job.of(manifest)

    def _merge(self, path: str, fields: dict[str, Any]) -> Job:
        """`fields` (copies) merged into the mapping at the dotted `path`, made if missing."""
        manifest = copy.deepcopy(self._manifest)
        node = manifest
        for key in path.split(".") if path else []:
            node = node.setdefault(key, {})
        node.update(copy.deepcopy(fields))
        return Job.of(manifest)

    def _section(self, path: str, **fields: Any) -> Job:
        """The given `fields` (not None) merged into the spec section at `path`, camelCase."""
        given = {_camel(key): value for key, value in fields.items() if value is not None}
        return self._merge(path, given)

    # --- metadata -----------------------------------------------------------------------

    def name(self, name: str) -> Job:
        return self.set("metadata.name", name)

    def namespace(self, namespace: str) -> Job:
        return self.set("metadata.namespace", namespace)

    def uid(self, uid: str) -> Job:
        """What the API server gives a created job."""
        return self.set("metadata.uid", uid)

    def generation(self, generation: int) -> Job:
        """What the API server counts spec changes with."""
        return self.set("metadata.generation", generation)

    def label(self, key: str, value: str) -> Job:
        return self._merge("metadata.labels", {key: value})

    def queue(self, name: str) -> Job:
        """Queued for Kueue's LocalQueue `name`."""
        return self.label(QUEUE_LABEL, name)

    # --- spec sections ------------------------------------------------------------------

    def model(self, uri: str | None = None, *, dtype: str | None = None) -> Job:
        return self._section("spec.model", uri=uri, dtype=dtype)

    def dataset(
        self,
        uri: str | None = None,
        *,
        format: str | None = None,
        sequence_length: int | None = None,
        packing: bool | None = None,
        truncation: str | None = None,
        text_field: str | None = None,
        prompt_field: str | None = None,
        completion_field: str | None = None,
        messages_field: str | None = None,
    ) -> Job:
        return self._section(
            "spec.dataset",
            uri=uri,
            format=format,
            sequence_length=sequence_length,
            packing=packing,
            truncation=truncation,
            text_field=text_field,
            prompt_field=prompt_field,
            completion_field=completion_field,
            messages_field=messages_field,
        )

    def validation(self, uri: str | None = None, *, fraction: float | None = None) -> Job:
        """Held-out data: a file of its own, or a share of the training data."""
        return self.set("spec.dataset.validation", {})._section(
            "spec.dataset.validation", uri=uri, fraction=fraction
        )

    def method(
        self,
        type: str | None = None,
        *,
        rank: int | None = None,
        alpha: int | None = None,
        dropout: float | None = None,
        target_modules: list[str] | None = None,
    ) -> Job:
        """`lora`, `qlora` or `full`, and the adapters' settings."""
        return self._section(
            "spec.method",
            type=type,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            target_modules=target_modules,
        )

    def training(
        self,
        *,
        steps: int | None = None,
        epochs: int | None = None,
        micro_batch_size: int | None = None,
        micro_batches: int | None = None,
        learning_rate: float | None = None,
        schedule: str | None = None,
        warmup_steps: int | None = None,
        seed: int | None = None,
        weight_decay: float | None = None,
        max_grad_norm: float | None = None,
        eval_every_steps: int | None = None,
    ) -> Job:
        return self._section(
            "spec.training",
            steps=steps,
            epochs=epochs,
            micro_batch_size=micro_batch_size,
            micro_batches=micro_batches,
            learning_rate=learning_rate,
            schedule=schedule,
            warmup_steps=warmup_steps,
            seed=seed,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            eval_every_steps=eval_every_steps,
        )

    def pipeline(
        self,
        *,
        stages: int | str | None = None,
        replicas: int | str | None = None,
        schedule: str | None = None,
        compression: str | None = None,
        forwards_ahead: int | str | None = None,
    ) -> Job:
        return self._section(
            "spec.pipeline",
            stages=stages,
            replicas=replicas,
            schedule=schedule,
            compression=compression,
            forwards_ahead=forwards_ahead,
        )

    def sync(
        self,
        mode: str,
        every_steps: int | None = None,
        outer_code: str | None = None,
        lora_merge: str | None = None,
    ) -> Job:
        """How the pipelines keep their weights equal (`spec.pipeline.sync`, replaced)."""
        sync: dict[str, Any] = {"mode": mode}
        if every_steps is not None:
            sync["everySteps"] = every_steps
        if outer_code is not None:
            sync["outerCode"] = outer_code
        if lora_merge is not None:
            sync["loraMerge"] = lora_merge
        return self.set("spec.pipeline.sync", sync)

    def placement(
        self,
        *,
        pools: list[str] | None = None,
        node_selector: dict[str, str] | None = None,
        tolerations: list[dict[str, Any]] | None = None,
        priority_class_name: str | None = None,
        gpu_label: str | None = None,
    ) -> Job:
        return self._section(
            "spec.placement",
            pools=pools,
            node_selector=node_selector,
            tolerations=tolerations,
            priority_class_name=priority_class_name,
            gpu_label=gpu_label,
        )

    def checkpoint(
        self,
        uri: str | None = None,
        *,
        endpoint: str | None = None,
        every_steps: int | None = None,
        keep: int | None = None,
    ) -> Job:
        return self._section(
            "spec.checkpoint", uri=uri, endpoint=endpoint, every_steps=every_steps, keep=keep
        )

    def credentials(
        self, secret: str, *, access_key_key: str | None = None, secret_key_key: str | None = None
    ) -> Job:
        """The Secret with the store's key pair (`spec.checkpoint.credentialsSecret`,
        replaced)."""
        return self.set("spec.checkpoint.credentialsSecret", {"name": secret})._section(
            "spec.checkpoint.credentialsSecret",
            access_key_key=access_key_key,
            secret_key_key=secret_key_key,
        )

    def output(self, uri: str) -> Job:
        return self.set("spec.output", {"uri": uri})

    def failure_policy(
        self,
        *,
        max_stage_restarts: int | None = None,
        backoff_seconds: int | None = None,
        return_after_seconds: int | None = None,
    ) -> Job:
        return self._section(
            "spec.failurePolicy",
            max_stage_restarts=max_stage_restarts,
            backoff_seconds=backoff_seconds,
            return_after_seconds=return_after_seconds,
        )

    def link_certificates(
        self, *, lifetime_seconds: int | None = None, renew_at_percent: int | None = None
    ) -> Job:
        return self._section(
            "spec.linkCertificates",
            lifetime_seconds=lifetime_seconds,
            renew_at_percent=renew_at_percent,
        )

    def suspend(self, suspend: bool = True) -> Job:
        return self.set("spec.suspend", suspend)

    def image(self, image: str) -> Job:
        """The stage pods' worker image."""
        return self.set("spec.image", image)

    # --- as stored ----------------------------------------------------------------------

    def status(self, status: dict[str, Any]) -> Job:
        """The status the operator wrote (replaced)."""
        return self.set("status", status)
