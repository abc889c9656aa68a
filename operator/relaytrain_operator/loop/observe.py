"""What a pass reads beyond kopf's indexes: the reads `decide.needs` asks for.

The indexes (handlers/indexes.py) answer the frequent questions without a request: the
job's stage pods and the nodes. This module fills in the rest through `apply.ClusterApi`
and the object store, and only when a pass needs it:

- the job's pods, listed when the index lacks a planned stage's pod (one just created may
  not be indexed yet, and a pod missing by mistake would count as a failure);
- a node a stage pod is bound to but the index lacks (one that just joined must not look
  lost), read directly;
- the cluster's active pods (what holds GPUs), fresh, for a plan or a pod to create;
- the model's config.json for the first plan (cached by endpoint and URI: small and
  immutable in practice; a restart reads it again);
- progress.json of a started job, once per pass (and given-up.json while a pipeline is
  given up);
- the job's link Secret when its certificates are due for a change (status.linkCertificates
  says when), or the status does not say yet;
- the Workloads of a job submitted to a Kueue LocalQueue (one per pipeline, or one: listed by
  the job's label), and, for
  a pass that creates stage pods, the ResourceFlavors they were admitted with.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from relaytrain_contract import GIVEN_UP_FILE, PROGRESS_FILE, ConfigError
from relaytrain_contract import Progress as Record

from relaytrain_operator.domain.builders.labels import StageKey, link_secret_name
from relaytrain_operator.domain.progress import Progress, fold, job_store_uri
from relaytrain_operator.domain.queueing import by_pipeline, priority_class_of, read_admission
from relaytrain_operator.domain.status import load_status
from relaytrain_operator.loop.apply import ClusterApi
from relaytrain_operator.loop.decide import (
    InputProblem,
    ModelConfig,
    Needs,
    Observed,
    parse_spec,
    stage_pods,
    workloads_of,
)
from relaytrain_operator.spec import FineTuneJob, is_s3
from relaytrain_operator.store.objectstore import (
    StoreAccess,
    StoreError,
    object_size,
    read_json,
    store_refusal,
)

JsonDict = dict[str, Any]


class Observer:
    """Reads for one pass; one instance per operator process (it caches model configs)."""

    def __init__(self, api: ClusterApi) -> None:
        self.api = api
        self._model_configs: dict[tuple[StoreAccess | None, str], JsonDict] = {}
        """config.json by the credentials that read it and the model's URI: a job with other
        (or missing) credentials checks them itself, whatever another job read before."""

    def stage_pods(self, namespace: str, name: str) -> dict[StageKey, JsonDict]:
        """The job's stage pods as the API server has them now."""
        return stage_pods(self.api.list_stage_pods(namespace, name))

    def observe(
        self,
        job: JsonDict,
        pods: Mapping[StageKey, JsonDict],
        nodes: Mapping[str, JsonDict],
        wanted: Needs,
        now: datetime,
    ) -> Observed:
        """`Observed` for `job` from the indexed `pods` and `nodes` plus what `wanted` asks.

        `nodes` must hold every node when `wanted.room`; otherwise those of the pods that
        the index has, and the others are read here.
        """
        known = dict(nodes)
        for pod in pods.values():
            node_name = (pod.get("spec") or {}).get("nodeName")
            if node_name and node_name not in known:
                node = self.api.get_node(node_name)
                if node is not None:
                    known[node_name] = node
        spec = parse_spec(job)
        observed = Observed(job=job, now=now, pods=pods, nodes=known)
        if isinstance(spec, str):
            return observed
        found = (
            self.api.list_workloads(spec.metadata.namespace, spec.metadata.name)
            if (wanted.workload)
            else []
        )
        layout, workloads = by_pipeline(found or [])
        names = workloads_of(spec, load_status(job.get("status")), layout)
        priority = None
        priority_class = priority_class_of(job)
        if wanted.workload and len(workloads) < len(names) and priority_class is not None:
            priority = self.api.get_priority_value(priority_class)
        flavors: dict[str, JsonDict] = {}
        if wanted.room:
            assigned = {
                f for w in workloads.values() for f in read_admission(w).pool_flavors.values()
            }
            for name in sorted(assigned):
                flavor = self.api.get_flavor(name)
                if flavor is not None:
                    flavors[name] = flavor
        # The job's Secret is read once a pass, for everything that reads its store.
        reads = wanted.model or wanted.inputs or wanted.progress or wanted.given_up
        access = self._access(spec) if reads else None
        return Observed(
            job=job,
            now=now,
            pods=pods,
            nodes=known,
            cluster_pods=self.api.list_active_pods() if wanted.room else None,
            model=self.model_config(spec, access) if wanted.model else None,
            inputs=self.input_problem(spec, access) if wanted.inputs else None,
            progress=self.progress(spec, now, access) if wanted.progress else None,
            workloads=workloads,
            workloads_per_pipeline=layout,
            kueue_missing=found is None,
            flavors=flavors,
            priority=priority,
            told_given_up=self.told_given_up(spec, access) if wanted.given_up else None,
            link_secret=(
                self.api.get_secret(spec.metadata.namespace, link_secret_name(spec.metadata.name))
                if wanted.link_secret
                else None
            ),
        )

    def store_access(self, job: FineTuneJob) -> StoreAccess:
        """Endpoint and credentials of the job's object store: its Secret's key pair, or,
        when it names none, AWS's standard chain as the operator's pod has it (its
        environment, credentials file, IAM role), as the job's stages use theirs."""
        checkpoint = job.spec.checkpoint
        ref = checkpoint.credentials_secret
        if ref is None:
            return StoreAccess.from_environ(checkpoint.endpoint)
        namespace = job.metadata.namespace
        data = self.api.get_secret_data(namespace, ref.name)
        if data is None:
            raise StoreError(
                f"spec.checkpoint.credentialsSecret.name: Secret {ref.name!r} does not exist "
                f"in namespace {namespace!r}; create it with the keys {ref.access_key_key} "
                f"and {ref.secret_key_key}"
            )
        for field, key in (
            ("accessKeyKey", ref.access_key_key),
            ("secretKeyKey", ref.secret_key_key),
        ):
            if not data.get(key):
                raise StoreError(
                    f"spec.checkpoint.credentialsSecret.{field}: Secret {ref.name!r} has no "
                    f"key {key!r} (it has: {', '.join(sorted(data)) or 'no keys'})"
                )
        return StoreAccess(checkpoint.endpoint, data[ref.access_key_key], data[ref.secret_key_key])

    def _access(self, job: FineTuneJob) -> StoreAccess | StoreError:
        """The job's store access, or why there is none (told by whatever needs it)."""
        try:
            return self.store_access(job)
        except StoreError as err:
            return err

    def _use(self, job: FineTuneJob, access: StoreAccess | StoreError | None) -> StoreAccess:
        """`access` as this pass read it (None: read it now); StoreError when there is none."""
        if access is None:
            return self.store_access(job)
        if isinstance(access, StoreError):
            raise StoreError(str(access))
        return access

    def model_config(
        self, job: FineTuneJob, access: StoreAccess | StoreError | None = None
    ) -> ModelConfig:
        """The base model's config.json, or why it cannot be read."""
        uri = job.spec.model.uri
        if uri.startswith("hf://"):
            return ModelConfig(
                error=f"spec.model.uri {uri}: the operator plans from the model's config.json "
                f"and has no hub access; copy the model to an s3:// prefix"
            )
        try:  # the job's Secret is read for every job, never taken from another's read
            store = self._use(job, access) if is_s3(uri) else None
        except StoreError as err:
            return ModelConfig(error=str(err))
        key = (store, uri)
        if key in self._model_configs:
            return ModelConfig(self._model_configs[key])
        try:
            config = read_json(uri, "config.json", store)
        except StoreError as err:
            return ModelConfig(error=str(err))
        if config is None:
            return ModelConfig(error=f"spec.model.uri {uri} has no config.json")
        self._model_configs[key] = config
        return ModelConfig(config)

    def input_problem(
        self, job: FineTuneJob, access: StoreAccess | StoreError | None = None
    ) -> InputProblem | None:
        """What is wrong with the job's inputs that the operator can see before any pod
        exists, checked for every job (nothing here is cached): the credentials Secret it
        names (exists, holds both keys), the store's answer to those keys, and its s3://
        data set and held-out file (exist, not empty). None when nothing is, or the store
        cannot be reached (no verdict: the stages will say). With no Secret named, the
        operator's own credentials may not be the stages' (an IAM role), so only a missing
        or empty object counts."""
        spec, secret = job.spec, job.spec.checkpoint.credentials_secret
        named = secret is not None
        try:
            store = self._use(job, access)
        except StoreError as err:
            return InputProblem("CredentialsUnavailable", str(err))
        if secret is not None and is_s3(spec.checkpoint.uri):
            refused = store_refusal(spec.checkpoint.uri, store)
            if refused is not None:
                return InputProblem(
                    "CredentialsUnavailable",
                    f"spec.checkpoint.credentialsSecret: the store at "
                    f"{spec.checkpoint.endpoint or 'AWS S3'} refused the keys of Secret "
                    f"{secret.name!r} for {spec.checkpoint.uri} ({refused})",
                )
        validation = spec.dataset.validation.uri if spec.dataset.validation else None
        for field, uri in (("spec.dataset.uri", spec.dataset.uri),
                           ("spec.dataset.validation.uri", validation)):  # fmt: skip
            if uri is None or not is_s3(uri):
                continue  # a local path is the nodes' to read: its stage says so
            try:
                size = object_size(uri, store)
            except StoreError as err:
                if named:
                    return InputProblem("DatasetUnavailable", f"{field} {uri}: {err}")
                continue
            if size is None:
                return InputProblem(
                    "DatasetUnavailable", f"{field} {uri}: no such object; upload the JSONL file"
                )
            if size == 0:
                return InputProblem(
                    "DatasetUnavailable",
                    f"{field} {uri}: the object is empty; it needs at least one record",
                )
        return None

    def told_given_up(
        self, job: FineTuneJob, access: StoreAccess | StoreError | None = None
    ) -> tuple[int, ...] | None:
        """The pipelines the job's store tells its stages are given up (None: no such
        document, or the store cannot be read; the pass then writes it)."""
        try:
            doc = read_json(job_store_uri(job), GIVEN_UP_FILE, self._use(job, access))
            return tuple(int(p) for p in doc["pipelines"]) if doc is not None else None
        except (StoreError, KeyError, TypeError, ValueError):
            return None

    def progress(
        self, job: FineTuneJob, now: datetime, access: StoreAccess | StoreError | None = None
    ) -> Progress | None:
        """The job's progress, or None when there is none yet or the store cannot be read."""
        try:
            record = read_json(job_store_uri(job), PROGRESS_FILE, self._use(job, access))
            return fold(Record.from_json(record), job, now) if record is not None else None
        except (StoreError, ConfigError):
            return None
