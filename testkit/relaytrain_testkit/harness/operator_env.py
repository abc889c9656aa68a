"""The operator end to end, as the e2e tests set it up: a namespace enforcing the Pod Security
Standard `restricted` with the object store's key pair in a Secret, the chart installed with
its operator run as a pod under its ServiceAccount (harness/chart_install.py), a kwok
process runner for the stage pods (in real containers for the worker image), a tiny Llama
and a small data set in MinIO; and what the tests read back (the workers' progress.json as
it changes, the stage pods, logs)."""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client

from relaytrain_testkit.harness.chart_install import (
    ChartRelease,
    chart_values,
    restricted_namespace,
)
from relaytrain_testkit.harness.containers import image_ref
from relaytrain_testkit.harness.kwok_runner import KwokProcessRunner
from relaytrain_testkit.harness.operator_cases import install_crd
from relaytrain_testkit.jobs import Job

GROUP, VERSION, PLURAL = "relaytrain.io", "v1alpha1", "finetunejobs"
STEPS, EVERY = 40, 4


@contextmanager
def operator_env(
    kube_cluster: Any, minio: Any, work: Path, operator_image: str | None = None, **values: Any
) -> Iterator[dict[str, Any]]:
    """Everything above, torn down on exit; yields the parts by name (core, custom, ns,
    runner, work, minio, release, values, and model: the tiny model's folder). `values`:
    more chart values (kueue={...}). `operator_image`: a registry's reference by digest
    (`host:port/repository@sha256:...`) the chart's operator pod pulls and runs in a
    container; None runs it as a local process of this checkout."""
    from relaytrain_testkit.tiny_models import tiny_model_dir

    api = kube_cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    install_crd(kube_cluster, api)  # the release adopts it (as when another test applied it)
    model = tiny_model_dir(work / "model", layers=6, hidden=64, max_positions=64)
    mc = minio.client()
    if not mc.bucket_exists(minio.bucket):
        mc.make_bucket(minio.bucket)
    for path in sorted(model.rglob("*")):
        if path.is_file():
            mc.fput_object(minio.bucket, f"models/tiny/{path.relative_to(model)}", str(path))
    rows = [
        {"prompt": f"add {a} {b} =", "completion": f" {a + b}"}
        for a in range(12)
        for b in range(12)
    ]
    data = work / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mc.fput_object(minio.bucket, "data/sums.jsonl", str(data))

    tag = uuid.uuid4().hex[:6]
    ns = restricted_namespace(core, f"rte2e-{tag}")
    core.create_namespaced_secret(
        ns,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="s3"),
            string_data={
                "AWS_ACCESS_KEY_ID": minio.access_key,
                "AWS_SECRET_ACCESS_KEY": minio.secret_key,
            },
        ),
    )
    # The operator as the chart installs it, watching this namespace.
    system = restricted_namespace(core, f"rte2e-system-{tag}")
    release = ChartRelease(f"rte2e{tag}", system, kube_cluster.kubeconfig, api, work / "chart")
    values = {**chart_values(ns), **values}
    # The e2e tier's stages train on the same two cores as the operator: a pass that waits
    # its turn for a CPU must not read as a hung operator (liveness after 20 s, not 6 s;
    # tests/k8s/test_chart_install.py times the quick probes on a quiet operator).
    probes = values["probes"]
    values["probes"] = {**probes, "liveness": {**probes["liveness"], "failureThreshold": 10}}
    registries: frozenset[str] = frozenset()
    if operator_image is not None:
        repository, _, digest = operator_image.partition("@")
        values["image"] = {"repository": repository, "digest": digest}
        registries = frozenset({repository.split("/", 1)[0]})
    # Stage pods of the worker image `make images` built run in real containers
    # (harness/containers.py); those of any other image as local processes.
    runner = KwokProcessRunner(api, work / "pods", ns, images=frozenset({image_ref("worker")}))
    try:
        release.start_kubelet(registries)
        release.install(values)
        release.ready_operator()
        runner.start()
        yield {
            "core": core,
            "custom": custom,
            "ns": ns,
            "runner": runner,
            "work": work,
            "minio": minio,
            "release": release,
            "values": values,
            "model": model,
            "operator_image": operator_image,
        }
    finally:
        runner.stop()
        release.helm("uninstall", release.name, "--wait", check=False)
        release.stop_kubelet()
        core.delete_namespace(ns)
        core.delete_namespace(system)


def tiny_job(name: str, minio: Any) -> Job:
    """The e2e tests' job on the tiny Llama and the sums data in `minio`: three stages with
    int8 links, LoRA r4, STEPS steps of 3 micro-batches of 2 x 16 tokens, a checkpoint every
    EVERY steps (2 kept) with the keys in Secret `s3`, the adapter under adapters/<name>/, 2
    restarts a stage without back-off."""
    bucket = minio.bucket
    return (
        Job(name)
        .model(f"s3://{bucket}/models/tiny/", dtype="float32")
        .dataset(f"s3://{bucket}/data/sums.jsonl", format="prompt-completion", sequence_length=16)
        .method("lora", rank=4, alpha=8)
        .training(steps=STEPS, micro_batch_size=2, micro_batches=3, learning_rate=0.01,
                  warmup_steps=1, seed=3)
        .pipeline(stages=3, compression="int8")
        .checkpoint(f"s3://{bucket}/ckpt", endpoint=minio.url, every_steps=EVERY, keep=2)
        .credentials("s3")
        .output(f"s3://{bucket}/adapters/{name}/")
        .failure_policy(max_stage_restarts=2, backoff_seconds=0)
    )  # fmt: skip


def stored_json(mc: Any, bucket: str, key: str) -> Any:
    """The JSON document stored at `key` (raises when it cannot be read)."""
    resp = mc.get_object(bucket, key)
    try:
        return json.loads(resp.read())
    finally:
        resp.close()
        resp.release_conn()


class ProgressWatcher:
    """Reads the workers' progress.json from MinIO every 0.2 s (the ground truth the
    operator summarises in status.progress) and keeps the history."""

    def __init__(self, minio: Any, key: str) -> None:
        self.minio, self.key = minio, key
        self.history: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        mc = self.minio.client()
        while not self._stop.wait(0.2):
            try:
                doc = stored_json(mc, self.minio.bucket, self.key)
            except Exception:  # not written yet, or being rewritten
                continue
            if not self.history or self.history[-1][1] != doc:
                self.history.append((time.monotonic(), doc))

    def latest(self) -> dict[str, Any]:
        return self.history[-1][1] if self.history else {}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def stage_pods(core: Any, ns: str, job: str) -> dict[str, Any]:
    pods = core.list_namespaced_pod(ns, label_selector=f"relaytrain.io/job={job}").items
    return {p.metadata.name: p for p in pods if p.metadata.deletion_timestamp is None}


def diagnostics(e: dict[str, Any]) -> str:
    logs = [f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(e["work"].rglob("*.log"))]
    release: ChartRelease = e["release"]
    return "\n".join(logs) + release.diagnostics()


def planned_on_ready_nodes(
    core: Any,
    custom: Any,
    ns: str,
    nodes: list[dict[str, Any]],
    manifest: Callable[[str], dict[str, Any]],
    fits: Callable[[dict[str, Any]], bool],
    prefix: str,
    attempts: int = 3,
) -> tuple[str, dict[str, Any]]:
    """Create kwok `nodes`, wait until each is Ready, then create FineTuneJob
    `<prefix><attempt>` from `manifest(name)` until its first plan `fits`: the plan is made
    for the GPUs of the Ready nodes the operator's node index holds, and a Ready update may
    reach it after the job (that job is deleted, and another made once its pods are gone).
    Returns the job's name and plan; deletes the nodes if it fails."""
    from relaytrain_testkit.chaos import delete_nodes, node_ready
    from relaytrain_testkit.harness import kwok_nodes
    from relaytrain_testkit.harness.waiting import wait_for

    names = [n["metadata"]["name"] for n in nodes]
    kwok_nodes.create_nodes(core.api_client, nodes)
    try:
        for node in names:
            wait_for(f"{node} Ready", functools.partial(node_ready, core, node))
        for attempt in range(attempts):
            name = f"{prefix}{attempt}"
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest(name))

            def plan(n: str = name) -> Any:
                got = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, n)
                return (got.get("status") or {}).get("plan")

            planned: dict[str, Any] = wait_for("a plan", plan, timeout=60)
            if fits(planned):
                return name, planned
            custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
            gone = functools.partial(_no_stage_pods, core, ns, name)
            wait_for("its pods gone", gone, timeout=60)
        raise AssertionError(f"no plan of {attempts} jobs fit: the last was {planned}")
    except BaseException:
        delete_nodes(core, names)
        raise


def _no_stage_pods(core: Any, ns: str, job: str) -> bool:
    return not stage_pods(core, ns, job)
