"""The one module that talks to the API server for the operator's own work.

Everything else builds plain dicts (builders/), decides (decide.py, recovery.py,
status.py) or plans (planner/, placement.py); this module reads and writes them:
`ClusterApi` holds the few calls, and `Executor` applies a decision's actions in order.
Reads return plain JSON dicts, not the client's generated model classes: the builders and
the decisions work on dicts, and skipping the client's deserialisation keeps a large
listing cheap.

Every action is idempotent: an object that already exists (409) is fine, because state is
derived from the cluster and a restarted operator re-applies what it may already have
created; deletes of objects already gone (404) are fine for the same reason; a status
patch is sent only for the fields that differ from the stored ones.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from relaytrain_contract import FLEET_FILE, GIVEN_UP_FILE, PLAN_FILE

from relaytrain_operator.domain import queueing
from relaytrain_operator.domain.builders.labels import JOB_LABEL
from relaytrain_operator.domain.builders.secret import build_link_secret, secret_files
from relaytrain_operator.domain.linkcerts import (
    LinkState,
    extended_files,
    mint_link_credentials,
    mint_link_extension,
    renewed_files,
    state_annotations,
)
from relaytrain_operator.domain.progress import job_store_uri
from relaytrain_operator.domain.status import changes, to_manifest
from relaytrain_operator.loop.actions import (
    Action,
    ApplyWorkloadStatus,
    Create,
    CreateLinkSecret,
    DeletePod,
    ExtendLinkSecret,
    PatchStatus,
    PatchWorkload,
    PutFleet,
    PutGivenUp,
    PutPlan,
    RenewLinkSecret,
)
from relaytrain_operator.spec import FineTuneJob, parse_job
from relaytrain_operator.store.objectstore import StoreAccess, StoreError, write_json

GROUP = "relaytrain.io"
VERSION = "v1alpha1"
PLURAL = "finetunejobs"

logger = logging.getLogger(__name__)

JsonDict = dict[str, Any]
# Every call: raw JSON back (no model classes), and a deadline, so that a stuck connection
# fails the pass (which is retried) instead of holding a handler thread forever.
_RAW: dict[str, Any] = {"_preload_content": False, "_request_timeout": (5, 30)}


def _json(response: Any) -> JsonDict:
    """Decode a response that was requested with `_preload_content=False`."""
    data: JsonDict = json.loads(response.data)
    return data


def _found(read: Callable[[], Any]) -> JsonDict | None:
    """The object `read` returns, or None when the API server says it does not exist."""
    try:
        return _json(read())
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


@dataclass
class ClusterApi:
    """Thin, typed access to the few API calls the operator makes."""

    api_client: client.ApiClient

    @property
    def _core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def _custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    # --- the job itself -------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> JsonDict | None:
        """The job as stored now (None once it is gone)."""
        return _found(
            lambda: self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, **_RAW
            )
        )

    def patch_job_status(self, namespace: str, name: str, status: JsonDict) -> None:
        """Merge-patch the status subresource (fields set to None are removed)."""
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": status}, **_RAW
            )
        except ApiException as exc:
            if exc.status != 404:  # the job was deleted meanwhile: nothing to report on
                raise

    # --- children -------------------------------------------------------------------

    def create(self, obj: JsonDict) -> bool:
        """Create a Pod, Service or Secret; True if created, False if it already existed."""
        kind = obj["kind"]
        namespace = obj["metadata"]["namespace"]
        create: Any = {
            "Pod": self._core.create_namespaced_pod,
            "Service": self._core.create_namespaced_service,
            "Secret": self._core.create_namespaced_secret,
            "Workload": lambda ns, body, **kw: self._custom.create_namespaced_custom_object(
                queueing.GROUP, queueing.VERSION, ns, queueing.PLURAL, body, **kw
            ),
        }[kind]
        try:
            create(namespace, obj, **_RAW)
        except ApiException as exc:
            if exc.status == 409:
                return False
            if exc.status == 403 and "NamespaceTerminating" in str(exc.body):
                # The namespace (and the job with it) is going away: nothing to create.
                return False
            raise
        logger.info("Created %s %s/%s.", kind, namespace, obj["metadata"]["name"])
        return True

    def delete_pod(
        self, namespace: str, name: str, uid: str | None = None, force: bool = False
    ) -> None:
        """Delete one pod; with `uid`, only that incarnation (never a successor).

        `force` skips the grace period: for a pod whose node is gone or not ready, where no
        kubelet will ever confirm the deletion.
        """
        body = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid) if uid else None,
            propagation_policy="Background",
            grace_period_seconds=0 if force else None,
        )
        try:
            self._core.delete_namespaced_pod(name, namespace, body=body, **_RAW)
        except ApiException as exc:
            # 404: already gone; 409: the uid precondition failed, i.e. a successor
            # already holds the name and must not be touched.
            if exc.status not in (404, 409):
                raise
            return
        logger.info("Deleted Pod %s/%s.", namespace, name)

    def list_stage_pods(self, namespace: str, job_name: str) -> list[JsonDict]:
        """The job's stage pods (label-selected), terminating ones included."""
        response = self._core.list_namespaced_pod(
            namespace, label_selector=f"{JOB_LABEL}={job_name}", **_RAW
        )
        items: list[JsonDict] = _json(response)["items"]
        return items

    def get_secret(self, namespace: str, name: str) -> JsonDict | None:
        """A Secret as stored; None if it does not exist. A read the operator's RBAC forbids
        raises (the pass fails and the job gets a Forbidden Event), rather than passing for
        a missing Secret."""
        try:
            secret: JsonDict = _json(self._core.read_namespaced_secret(name, namespace, **_RAW))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return secret

    def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's keys and decoded values; None if the Secret does not exist."""
        secret = self.get_secret(namespace, name)
        return None if secret is None else secret_files(secret)

    def replace_secret(self, obj: JsonDict) -> None:
        """Replace a Secret; its metadata.resourceVersion must be the one it was read at (a
        Secret changed since answers 409, which fails the pass: the next reads it again)."""
        meta = obj["metadata"]
        replace: Any = self._core.replace_namespaced_secret  # takes the manifest as a dict
        replace(meta["name"], meta["namespace"], obj, **_RAW)
        logger.info("Replaced Secret %s/%s.", meta["namespace"], meta["name"])

    # --- Kueue -----------------------------------------------------------------------

    def list_workloads(self, namespace: str, job_name: str) -> list[JsonDict] | None:
        """The job's Workloads (label-selected): one per pipeline, or the job's one; None
        when the cluster serves no Workloads (Kueue is not installed)."""
        try:
            response = self._custom.list_namespaced_custom_object(
                queueing.GROUP, queueing.VERSION, namespace, queueing.PLURAL,
                label_selector=f"{JOB_LABEL}={job_name}", **_RAW,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        items: list[JsonDict] = _json(response)["items"]
        return items

    def patch_workload(self, namespace: str, name: str, patch: JsonDict) -> None:
        self._custom.patch_namespaced_custom_object(
            queueing.GROUP, queueing.VERSION, namespace, queueing.PLURAL, name, patch, **_RAW
        )
        logger.info("Patched Workload %s/%s: %s.", namespace, name, patch)

    def apply_workload_status(self, body: JsonDict, manager: str) -> None:
        """Server-side apply of a Workload's status as `manager` (forced: the fields are
        that manager's to set)."""
        meta = body["metadata"]
        self._custom.patch_namespaced_custom_object_status(
            queueing.GROUP,
            queueing.VERSION,
            meta["namespace"],
            queueing.PLURAL,
            meta["name"],
            body,
            field_manager=manager,
            force=True,
            _content_type="application/apply-patch+yaml",
            **_RAW,
        )
        logger.info(
            "Applied the status of Workload %s/%s as %s.", meta["namespace"], meta["name"], manager
        )

    def get_flavor(self, name: str) -> JsonDict | None:
        """A ResourceFlavor (cluster-scoped), or None when there is none."""
        return self._kueue_cluster_object(queueing.FLAVORS, name)

    def get_priority_value(self, name: str) -> int | None:
        """The value of WorkloadPriorityClass `name`, or None when there is none."""
        found = self._kueue_cluster_object(queueing.PRIORITY_CLASSES, name)
        return None if found is None else int(found.get("value") or 0)

    def _kueue_cluster_object(self, plural: str, name: str) -> JsonDict | None:
        return _found(
            lambda: self._custom.get_cluster_custom_object(
                queueing.GROUP, queueing.VERSION, plural, name, **_RAW
            )
        )

    # --- the cluster around the job -------------------------------------------------

    def list_active_pods(self) -> list[JsonDict]:
        """Every pod in the cluster that may hold a GPU (not Succeeded or Failed)."""
        return list(
            self._paged(
                self._core.list_pod_for_all_namespaces,
                field_selector="status.phase!=Succeeded,status.phase!=Failed",
            )
        )

    def get_node(self, name: str) -> JsonDict | None:
        """One node, or None when it no longer exists."""
        return _found(lambda: self._core.read_node(name, **_RAW))

    @staticmethod
    def _paged(call: Any, **kwargs: Any) -> Iterator[JsonDict]:
        token: str | None = None
        while True:
            page = _json(call(limit=500, _continue=token, **_RAW, **kwargs))
            yield from page["items"]
            token = page["metadata"].get("continue")
            if not token:
                return


EventPoster = Callable[[JsonDict, str, str, str], None]
"""Posts an Event on a job: (job, type, reason, message)."""


class Executor:
    """Applies a decision's actions to the cluster, in order, each idempotently.

    Stage pods created one after another are created side by side (a job's pods appear in
    one round trip, not one per stage). An action that fails raises: the rest of the pass
    is not applied, and the next pass decides again from what the cluster then holds.
    """

    def __init__(
        self,
        api: ClusterApi,
        post_event: EventPoster,
        threads: int = 8,
        store_access: Callable[[FineTuneJob], StoreAccess] | None = None,
    ) -> None:
        self.api = api
        self.post_event = post_event
        self.store_access = store_access
        """How to reach a job's object store (`Observer.store_access`): PutGivenUp writes
        there; None skips it."""
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="create")
        self._forbidden: dict[tuple[str, str], str] = {}  # job → the refusal last reported

    def report_forbidden(self, job: JsonDict, exc: ApiException) -> None:
        """Tell a request the API server forbade during a pass over `job` (a grant missing
        from the operator's RBAC, for a read or a write, or an admission policy such as Pod
        Security refusing a pod) on the job as a Warning Event `Forbidden` with the API
        server's words, once per distinct refusal: kopf keeps a daemon's errors in the log
        only. The pass still fails like any error (`runner.Runner.reconcile`)."""
        meta = job["metadata"]
        try:
            message = str(json.loads(exc.body or "")["message"])
        except (TypeError, ValueError, KeyError):
            message = f"{exc.status} {exc.reason}"
        key = (meta["namespace"], meta["name"])
        if self._forbidden.get(key) != message:
            self._forbidden[key] = message
            self.post_event(job, "Warning", "Forbidden", f"The API server refused: {message}")

    def run(self, job: JsonDict, actions: Sequence[Action], now: datetime) -> None:
        """Apply `actions` for `job` (as read at the start of the pass)."""
        meta = job["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        stored: JsonDict = dict(job.get("status") or {})
        pods: list[JsonDict] = []
        for action in actions:
            if isinstance(action, Create) and action.obj["kind"] == "Pod":
                pods.append(action.obj)
                continue
            self._create_pods(pods)
            if isinstance(action, PatchStatus):
                new = to_manifest(action.status)
                patch = changes(stored, new)
                if patch:
                    self.api.patch_job_status(namespace, name, patch)
                stored = new
            elif isinstance(action, CreateLinkSecret):
                self._create_link_secret(job, action, now)
            elif isinstance(action, RenewLinkSecret):
                self._renew_link_secret(job, action, now)
            elif isinstance(action, ExtendLinkSecret):
                self._extend_link_secret(job, action, now)
            elif isinstance(action, Create):
                self.api.create(action.obj)
            elif isinstance(action, DeletePod):
                self.api.delete_pod(namespace, action.name, action.uid, force=action.force)
            elif isinstance(action, PatchWorkload):
                self.api.patch_workload(namespace, action.name, action.patch)
            elif isinstance(action, ApplyWorkloadStatus):
                self.api.apply_workload_status(action.body, action.manager)
            elif isinstance(action, PutGivenUp):
                self._put_given_up(job, action)
            elif isinstance(action, PutFleet):
                self._put_fleet(job, action)
            elif isinstance(action, PutPlan):
                self._put_plan(job, action)
            else:  # PostEvent
                self.post_event(job, action.type, action.reason, action.message)
        self._create_pods(pods)

    def _put_given_up(self, job: JsonDict, action: PutGivenUp) -> None:
        """Tell the job's stages, through its store, which pipelines are given up. A store
        that cannot be written is logged, not raised: the next pass reads the document
        back and writes it again (the rest of this pass still applies)."""
        if self.store_access is None:
            return
        meta = job["metadata"]
        try:
            spec = parse_job(job)
            doc = {"pipelines": list(action.pipelines)}
            write_json(job_store_uri(spec), GIVEN_UP_FILE, doc, self.store_access(spec))
        except (StoreError, ValueError) as exc:
            logger.warning(
                "Could not tell the stages of %s/%s that pipeline(s) %s are given up: %s",
                meta["namespace"], meta["name"], list(action.pipelines), exc,
            )  # fmt: skip
            return
        logger.info(
            "Told the stages of %s/%s that pipeline(s) %s are given up.",
            meta["namespace"], meta["name"], list(action.pipelines),
        )  # fmt: skip

    def _put_fleet(self, job: JsonDict, action: PutFleet) -> None:
        """Tell the job's stages training, through its store, which pipelines were added.
        Unlike the given-up pipelines, a store that cannot be written fails the pass: the
        added stages are created only after the stages training can learn of them (the next
        pass writes it again)."""
        if self.store_access is None:
            return
        meta = job["metadata"]
        spec = parse_job(job)
        write_json(job_store_uri(spec), FLEET_FILE, action.document, self.store_access(spec))
        added = [a["stages"][0]["pipeline"] for a in action.document.get("added") or []]
        logger.info("Told the stages of %s/%s that pipeline(s) %s were added.",
                    meta["namespace"], meta["name"], added)  # fmt: skip

    def _put_plan(self, job: JsonDict, action: PutPlan) -> None:
        """Name the writers' plan in the job's store. As for the added pipelines, a store
        that cannot be written fails the pass: the plan's stages are created only once a
        stage of an older plan would find it (the next pass writes it again)."""
        if self.store_access is None:
            return
        spec = parse_job(job)
        write_json(job_store_uri(spec), PLAN_FILE, action.document, self.store_access(spec))

    def _extend_link_secret(self, job: JsonDict, action: ExtendLinkSecret, now: datetime) -> None:
        meta = job["metadata"]
        minted = mint_link_extension(
            meta["namespace"], meta["name"], action.stages, now=now,
            not_after=action.not_after, generation=action.generation,
        )  # fmt: skip
        files = extended_files(action.files, minted)
        self.api.replace_secret(
            build_link_secret(job, files, action.annotations, action.resource_version)
        )
        logger.info("Link certificates of %s/%s: minted for the added stage(s) %s.",
                    meta["namespace"], meta["name"], list(action.stages))  # fmt: skip

    def _create_link_secret(self, job: JsonDict, action: CreateLinkSecret, now: datetime) -> None:
        meta = job["metadata"]
        pki = mint_link_credentials(
            meta["namespace"], meta["name"], list(action.stage_counts), now=now,
            lifetime=action.lifetime,
        )  # fmt: skip
        state = LinkState(0, "Current", now, now, now + action.lifetime)
        self.api.create(build_link_secret(job, pki, state_annotations(state)))

    def _renew_link_secret(self, job: JsonDict, action: RenewLinkSecret, now: datetime) -> None:
        meta = job["metadata"]
        minted = None
        if action.mint is not None:
            minted = mint_link_credentials(
                meta["namespace"], meta["name"], list(action.stage_counts), now=now,
                lifetime=action.lifetime, generation=action.mint,
            )  # fmt: skip
        files = renewed_files(action.step, action.files, minted)
        annotations = state_annotations(action.after)
        self.api.replace_secret(build_link_secret(job, files, annotations, action.resource_version))
        logger.info(
            "Link certificates of %s/%s: %s (generation %d, %s, valid until %s).",
            meta["namespace"], meta["name"], action.step, action.after.generation,
            action.after.phase, action.after.not_after.isoformat(),
        )  # fmt: skip

    def _create_pods(self, pods: list[JsonDict]) -> None:
        if pods:
            list(self._threads.map(self.api.create, pods))
            pods.clear()
