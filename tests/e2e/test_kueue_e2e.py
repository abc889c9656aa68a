"""FineTuneJobs queued by the real Kueue controller (relaytrain_testkit.harness.kueue, built from
sigs.k8s.io/kueue at its pin), under the chart-installed operator (`kueue.enabled`), with real
worker processes training.

One ClusterQueue with a ResourceFlavor per GPU pool (its nodes' `relaytrain.io/pool` label)
and lower-priority preemption. A low-priority job is submitted while the queue has no quota:
it waits, Suspended, with Kueue's own reason in its condition and no pod. Given exactly its
quota it is admitted and trains with the assigned flavours' node labels; a stage killed then
is replaced without losing the admission. A high-priority job of the same shape preempts it:
its pods go, the operator hands its quota back (only once they are gone), the high-priority
job trains and finishes (its Workload Finished, freeing the quota), and the first job is
admitted again and resumes from its last committed checkpoint, not from step 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from relaytrain_operator.domain.queueing import PRIORITY_LABEL, QUEUE_LABEL, workload_name
from relaytrain_testkit.harness.chart_rbac import render_chart
from relaytrain_testkit.harness.containers import require_image
from relaytrain_testkit.harness.kueue import GROUP as KUEUE
from relaytrain_testkit.harness.kueue import VERSION as KV
from relaytrain_testkit.harness.kwok_nodes import SLOW_GPU, slow_pool
from relaytrain_testkit.harness.operator_env import (
    EVERY,
    GROUP,
    PLURAL,
    VERSION,
    ProgressWatcher,
    diagnostics,
    operator_env,
    planned_on_ready_nodes,
    stage_pods,
    stored_json,
    tiny_job,
)
from relaytrain_testkit.harness.rbac_audit import (
    calls_of,
    explain,
    granted_to,
    service_account_user,
)
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POOL_LABEL = "relaytrain.io/pool"
PLURALS = {(GROUP, "FineTuneJob"): PLURAL}
STEPS = 300
"""The low-priority job's steps: enough that it is still training when preempted and when
suspended after the resume (measured 2026-11-27: preempted at step 10, suspended at 12). Its
steps take 80-150 ms on a quiet machine. The high-priority job's processes are held while the
test looks at the preemption, so the low job resumes only after that (on 2026-12-02, with 600
steps and no hold, the high job had finished and the low one was running again before the
test saw the preempted processes stop); from there, its phases are recorded every quarter
second."""


@pytest.fixture(scope="module")
def env(
    kube_cluster: Any,
    minio_server: Any,
    kueue: Any,
    image_registry: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    """The chart's operator pod runs the operator image in a container (its GPU catalog,
    with SLOW_GPU added, is mounted at /etc/relaytrain there)."""
    require_image("operator")
    operator_image = image_registry.push("operator")
    work = tmp_path_factory.mktemp("kueue-e2e")
    with operator_env(
        kube_cluster, minio_server, work, operator_image=operator_image,
        kueue={"enabled": True}, gpuCatalog=SLOW_GPU,
    ) as parts:  # fmt: skip
        parts["kueue"] = kueue
        yield parts


def _cluster_queue(name: str, pools: list[str], quota: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": f"{KUEUE}/{KV}",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu", "memory"],
                    "flavors": [
                        {
                            "name": f"{name}-{pool}",
                            "resources": [
                                {"name": "nvidia.com/gpu", "nominalQuota": quota.get(pool, 0)},
                                {"name": "memory", "nominalQuota": "1Ti"},
                            ],
                        }
                        for pool in pools
                    ],
                }
            ],
        },
    }


def _queues(custom: Any, ns: str, lq: str, pools: list[str]) -> tuple[str, str, str]:
    """A ClusterQueue with a ResourceFlavor per pool of `pools` and no quota yet, LocalQueue
    `lq` in `ns` for it, and WorkloadPriorityClasses low-<tag> (10) and high-<tag> (1000).
    Returns the ClusterQueue, the LocalQueue and the tag."""
    tag = uuid.uuid4().hex[:5]
    cq = f"rt-cq-{tag}"
    for pool in pools:
        custom.create_cluster_custom_object(
            KUEUE,
            KV,
            "resourceflavors",
            {
                "apiVersion": f"{KUEUE}/{KV}",
                "kind": "ResourceFlavor",
                "metadata": {"name": f"{cq}-{pool}"},
                "spec": {"nodeLabels": {POOL_LABEL: pool}},
            },
        )
    custom.create_cluster_custom_object(KUEUE, KV, "clusterqueues", _cluster_queue(cq, pools, {}))
    custom.create_namespaced_custom_object(
        KUEUE,
        KV,
        ns,
        "localqueues",
        {
            "apiVersion": f"{KUEUE}/{KV}",
            "kind": "LocalQueue",
            "metadata": {"name": lq},
            "spec": {"clusterQueue": cq},
        },
    )
    for cls, value in ((f"low-{tag}", 10), (f"high-{tag}", 1000)):
        custom.create_cluster_custom_object(
            KUEUE,
            KV,
            "workloadpriorityclasses",
            {
                "apiVersion": f"{KUEUE}/{KV}",
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": cls},
                "value": value,
            },
        )
    return cq, lq, tag


def _set_quota(custom: Any, cq: str, pools: list[str], quota: dict[str, int]) -> None:
    """ClusterQueue `cq`'s nominal GPU quota per pool set to `quota` (read again and
    replaced while Kueue's own writes, a finalizer or its status, move it in between)."""
    for _ in range(10):
        cluster_queue = custom.get_cluster_custom_object(KUEUE, KV, "clusterqueues", cq)
        cluster_queue["spec"] = _cluster_queue(cq, pools, quota)["spec"]
        try:
            custom.replace_cluster_custom_object(KUEUE, KV, "clusterqueues", cq, cluster_queue)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError(f"ClusterQueue {cq} kept changing under its quota's update")


def _demand(workload: dict[str, Any]) -> dict[str, int]:
    """The GPUs per pool a Workload's pod sets ask for."""
    demand: dict[str, int] = {}
    for pod_set in workload["spec"]["podSets"]:
        pool = pod_set["template"]["metadata"]["labels"][POOL_LABEL]
        demand[pool] = demand.get(pool, 0) + pod_set["count"]
    return demand


def _job(name: str, minio: Any, queue: str, priority: str, steps: int) -> dict[str, Any]:
    job = tiny_job(name, minio).label(QUEUE_LABEL, queue).label(PRIORITY_LABEL, priority)
    return job.training(steps=steps).build()


def test_kueue_admits_waits_preempts_and_resumes(env: dict[str, Any], kube_cluster: Any) -> None:
    e = env
    core, custom, ns, runner = e["core"], e["custom"], e["ns"], e["runner"]
    pools = [p["name"] for p in kube_cluster.pools]
    cq, lq, tag = _queues(custom, ns, "team", pools)

    def status(name: str) -> dict[str, Any]:
        job = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        return job.get("status") or {}

    def ready(name: str) -> dict[str, Any]:
        return next((c for c in status(name).get("conditions", []) if c["type"] == "Ready"), {})

    def workload(name: str) -> dict[str, Any]:
        return custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            KUEUE, KV, ns, "workloads", workload_name(name)
        )

    def wl_condition(name: str, kind: str) -> dict[str, Any]:
        conditions = (workload(name).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == kind), {})

    low, high = "low-job", "high-job"
    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{low}/progress.json")
    # The low job's phases, seen every quarter second from its eviction on.
    phases: list[str] = []
    watching = threading.Event()

    def record() -> None:
        while not watching.is_set():
            with contextlib.suppress(Exception):
                phases.append(status(low).get("phase") or "")
            watching.wait(0.25)

    recorder = threading.Thread(target=record, daemon=True)
    try:
        # 1. No quota yet: the job plans, submits its Workload and waits with Kueue's words.
        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, _job(low, e["minio"], lq, f"low-{tag}", steps=STEPS)
        )
        waiting = wait_for(
            "the low-priority job waiting for quota",
            lambda: ready(low) if ready(low).get("reason") == "WaitingForQuota" else None,
            timeout=90,
        )
        assert status(low)["phase"] == "Suspended"
        assert "insufficient" in waiting["message"] and lq in waiting["message"], waiting
        assert stage_pods(core, ns, low) == {}
        demand = _demand(workload(low))
        assert sum(demand.values()) == len(status(low)["stages"])

        # 2. Exactly its quota: admitted, its pods carry the flavours' node labels, it trains.
        _set_quota(custom, cq, pools, demand)
        wait_for(
            "the low-priority job admitted and running",
            lambda: status(low).get("phase") == "Running",
            timeout=120,
        )
        admitted = wl_condition(low, "Admitted")
        assert admitted.get("status") == "True", admitted
        pods = stage_pods(core, ns, low)
        assert pods and all(
            p.spec.node_selector[POOL_LABEL] == p.metadata.annotations["relaytrain.io/pool"]
            for p in pods.values()
        )

        # 3. A stage killed: replaced, the admission kept (the same QuotaReserved transition).
        reserved_at = wl_condition(low, "QuotaReserved")["lastTransitionTime"]
        wait_for(
            "a committed checkpoint",
            lambda: (watcher.latest().get("lastCommittedStep") or 0) >= EVERY,
            timeout=180,
        )
        victim = sorted(pods)[-1]
        before_kill = watcher.latest().get("lastCommittedStep") or 0
        os.kill(runner.local_pod(ns, victim).process.pid, signal.SIGKILL)
        wait_for(
            "the killed stage replaced and running",
            lambda: (
                any(s.get("restarts") for s in status(low)["stages"])
                and status(low)["phase"] == "Running"
            ),
            timeout=120,
        )
        assert wl_condition(low, "QuotaReserved") == {
            **wl_condition(low, "QuotaReserved"),
            "status": "True",
            "lastTransitionTime": reserved_at,
        }

        # 4. A higher priority of the same shape preempts it: pods gone, quota handed back.
        committed = wait_for(
            "a commit after the replacement",
            lambda: (c := watcher.latest().get("lastCommittedStep") or 0) > before_kill and c,
            timeout=180,
        )
        # Its processes are held until the preemption has been looked at: once they run, it
        # trains its 12 steps and finishes, and the low job is admitted again at once.
        with runner.hold(ns, f"{high}-"):
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, _job(high, e["minio"], lq, f"high-{tag}", steps=12)
            )
            evicted = wait_for(
                "the low-priority job evicted",
                lambda: ready(low) if ready(low).get("reason") == "Evicted" else None,
                timeout=120,
            )
            assert "Preempted" in evicted["message"], evicted
            recorder.start()  # the phases it goes through from here
            wait_for(
                "the high-priority job admitted",
                lambda: wl_condition(high, "Admitted").get("status") == "True",
                timeout=120,
            )
            # Its quota was handed back only once its pods were gone (they held the GPUs).
            pods_left = core.list_namespaced_pod(ns, label_selector=f"relaytrain.io/job={low}")
            assert pods_left.items == []
            assert wl_condition(low, "QuotaReserved").get("status") == "False"
            assert wl_condition(low, "Evicted").get("reason") == "Preempted"
            # The API objects go before the processes do (kwok finalises a deletion while the
            # process still has its grace period, in which a stage can still commit): wait
            # for the processes, so that nothing below is written to after it is read.
            wait_for(
                lambda: f"the preempted job's processes stopped: {runner.processes(ns, low)}",
                lambda: runner.processes(ns, f"{low}-") == [],
                timeout=60,
            )
            # The stopped run's last record, once the watcher has it too (its processes are
            # gone, so the record no longer changes until the resume).
            mc, bucket = e["minio"].client(), e["minio"].bucket
            final = stored_json(mc, bucket, f"ckpt/{ns}/{low}/progress.json")
            wait_for(
                "the watcher at the stopped run's last record", lambda: watcher.latest() == final
            )
            stopped_at = final.get("step") or 0
            # The newest commit made before the preemption, as the store has it (progress.json
            # can lag it by one: a committer stopped between its commit and its record).
            last_commit = max(
                int(found.group(1))
                for o in mc.list_objects(bucket, f"ckpt/{ns}/{low}/", recursive=True)
                if (found := re.search(r"/step-(\d+)/manifest\.json$", o.object_name))
            )
            assert last_commit >= committed

        # 5. The high-priority job finishes; its Workload is Finished; the low one resumes.
        wait_for(
            "the high-priority job succeeded",
            lambda: status(high).get("phase") == "Succeeded",
            timeout=240,
        )
        assert wl_condition(high, "Finished").get("status") == "True"
        wait_for(
            "the low-priority job running again",
            lambda: "Running" in phases,  # recorded from the eviction on
            timeout=120,
        )
        watching.set()
        resumed = wait_for(
            "a step after the resume",
            lambda: next(
                (doc for _, doc in watcher.history if (doc.get("step") or 0) > stopped_at),
                None,
            ),
            timeout=180,
        )
        assert resumed, "training went on past where it was preempted"

        # 6. spec.suspend maps onto the Workload's spec.active: suspended, Kueue evicts it
        # and the quota is handed back; resumed, it is admitted again and goes on.
        def suspend(value: bool) -> None:
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, low, {"spec": {"suspend": value}}
            )

        suspend(True)
        print(f"\nPreempted at step {stopped_at}; suspended at step "
              f"{watcher.latest().get('step')} of {STEPS}")  # fmt: skip
        wait_for(
            "the suspended job's quota handed back",
            lambda: (
                workload(low)["spec"]["active"] is False
                and wl_condition(low, "QuotaReserved").get("status") == "False"
            ),
            timeout=120,
        )
        assert status(low)["phase"] == "Suspended" and ready(low)["reason"] == "Suspended"
        assert core.list_namespaced_pod(ns, label_selector=f"relaytrain.io/job={low}").items == []
        suspend(False)
        wait_for(
            "the resumed job admitted and running",
            lambda: (
                workload(low)["spec"]["active"] is True and status(low).get("phase") == "Running"
            ),
            timeout=120,
        )
        wait_for(
            "the low-priority job succeeded",
            lambda: status(low).get("phase") == "Succeeded",
            timeout=600,
        )
        assert wl_condition(low, "Finished").get("status") == "True"
        # Restored, not restarted: every stage's new pod restored the newest commit made
        # before the preemption, and no step below it was reported again.
        pods_dir = e["work"] / "pods" / ns
        for k in range(len(status(low)["stages"])):
            logs = [p.read_text() for p in (pods_dir / f"{low}-stage-{k}").rglob("*.log")]
            assert any(f"restored committed step {last_commit}" in text for text in logs), k
        at_stop = max(
            i for i, (_, doc) in enumerate(watcher.history) if doc.get("step") == stopped_at
        )
        # What came after the record read at the preemption (that record itself can lag the
        # newest commit by one, as above).
        later = [doc.get("step") or 0 for _, doc in watcher.history[at_stop + 1 :]]
        assert min(later) >= last_commit and max(later) == STEPS, (later, last_commit)
        # The chart's Kueue grants are exactly the Kueue calls its operator made.
        release = e["release"]
        docs = render_chart(
            release.name, release.namespace, "kueue.enabled=true", f"watchNamespaces={{{ns}}}"
        )
        account = f"{release.name}-relaytrain"
        granted = {p for p in granted_to(docs, release.namespace, account) if p.group == KUEUE}
        user = service_account_user(release.namespace, account)
        calls = calls_of(kube_cluster.component_log("audit"), user, PLURALS)
        used = {p for p in calls.used if p.group == KUEUE}
        assert calls.refused == [] and granted == used, explain(granted - used, used - granted)
    except BaseException:
        for name in (low, high):
            with contextlib.suppress(Exception):
                print(name, json.dumps(workload(name), indent=1)[-3000:])
                print(name, json.dumps(status(name), indent=1)[-2000:])
        print(diagnostics(e))
        print(e["kueue"].logs()[-6000:])
        raise
    finally:
        watching.set()
        watcher.stop()


def test_kueue_grows_a_job_when_quota_frees_and_takes_back_one_pipeline(
    env: dict[str, Any], kube_cluster: Any
) -> None:
    """One Workload per pipeline: a job of two pipelines, given the quota of one, trains on
    the one Kueue admits while the other waits out of the job; given the quota of both, it
    grows (the other comes back and rejoins with the live pipeline's state). A higher-priority
    Workload that needs one pipeline's GPUs takes that pipeline only: it leaves at a step
    boundary, its quota is handed back once its pods are gone, the other trains on with no
    step back, and once the higher-priority Workload is gone Kueue admits the pipeline again
    and it comes back."""
    e = env
    core, custom, ns = e["core"], e["custom"], e["ns"]
    pools = [p["name"] for p in kube_cluster.pools]
    cq, lq, tag = _queues(custom, ns, "fleet", pools)
    name, steps = "kq-fleet", 100_000  # deleted once seen through; never runs out
    job = tiny_job(name, e["minio"]).label(QUEUE_LABEL, lq).label(PRIORITY_LABEL, f"low-{tag}")
    manifest = job.pipeline(stages=2, replicas=2).training(steps=steps).build()

    def status() -> dict[str, Any]:
        got = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        return got.get("status") or {}

    def workload(p: int) -> dict[str, Any]:
        return custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            KUEUE, KV, ns, "workloads", workload_name(name, p)
        )

    def phases() -> list[str]:
        return [p["phase"] for p in status().get("pipelines") or []]

    def log(pod: str) -> str:
        paths = sorted((e["work"] / "pods" / ns / pod).rglob("container.log"))
        return "".join(p.read_text() for p in paths)

    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")
    high = {
        "apiVersion": f"{KUEUE}/{KV}",
        "kind": "Workload",
        "metadata": {"name": f"urgent-{tag}", "namespace": ns},
    }
    try:
        # 1. Submitted with no quota: one Workload per pipeline, the job waits.
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
        wait_for(
            "the job waiting for quota",
            lambda: any(
                c["type"] == "Ready" and c["reason"] == "WaitingForQuota"
                for c in status().get("conditions") or []
            ),
            timeout=90,
        )
        demands = [_demand(workload(p)) for p in (0, 1)]
        assert [sum(d.values()) for d in demands] == [2, 2], demands
        assert stage_pods(core, ns, name) == {}

        # 2. The quota of one pipeline: Kueue admits one, the job trains on it alone and
        # the other is out of the job, waiting for Kueue, with no pod.
        _set_quota(custom, cq, pools, demands[0])
        first = wait_for(
            "one pipeline admitted and training",
            lambda: sorted(phases()) == ["Left", "Running"] and phases(),
            timeout=180,
        )
        trains, waits = first.index("Running"), first.index("Left")
        out = status()["pipelines"][waits]
        assert out["leftReason"].startswith("its Workload waits for Kueue"), out
        assert {n.rsplit("-s", 1)[0] for n in stage_pods(core, ns, name)} == {f"{name}-p{trains}"}
        wait_for("steps of the one pipeline", lambda: (watcher.latest().get("step") or 0) >= 3, 180)
        alone = f"links without given-up pipeline(s) [{waits}]"
        assert alone in log(f"{name}-p{trains}-s0"), log(f"{name}-p{trains}-s0")[-3000:]

        # 3. The quota of both: the other is admitted and comes back: the job grows.
        _set_quota(custom, cq, pools, {k: demands[0].get(k, 0) + demands[1].get(k, 0)
                                       for k in set(demands[0]) | set(demands[1])})  # fmt: skip
        wait_for(
            "the job grown to two pipelines",
            lambda: (
                phases() == ["Running", "Running"]
                and "rejoined at step" in log(f"{name}-p{waits}-s0")
            ),
            timeout=240,
        )
        assert status()["pipelines"][waits]["returns"] == 1

        # 4. A higher priority takes one pipeline's GPUs: that pipeline leaves, the other
        # trains on; the quota is handed back once the pods are gone.
        before = watcher.latest().get("step") or 0
        taken = workload(trains)
        high["spec"] = {
            "queueName": lq,
            "podSets": taken["spec"]["podSets"],
            "priorityClassRef": {
                "group": KUEUE,
                "kind": "WorkloadPriorityClass",
                "name": f"high-{tag}",
            },
            "priority": 1000,
        }
        custom.create_namespaced_custom_object(KUEUE, KV, ns, "workloads", high)
        shrunk = wait_for(
            "one pipeline preempted and out",
            lambda: sorted(phases()) == ["Left", "Running"] and status()["pipelines"],
            timeout=180,
        )
        gone = next(p for p in shrunk if p["phase"] == "Left")
        assert "Kueue evicted its Workload (Preempted" in gone["leftReason"], gone
        wait_for(
            "the higher priority admitted",
            lambda: any(
                c["type"] == "Admitted" and c["status"] == "True"
                for c in (custom.get_namespaced_custom_object(
                    KUEUE, KV, ns, "workloads", high["metadata"]["name"]
                ).get("status") or {}).get("conditions") or []
            ),
            timeout=180,
        )  # fmt: skip
        assert not [
            n for n in stage_pods(core, ns, name) if n.startswith(f"{name}-p{gone['index']}-")
        ]
        assert status()["phase"] == "Running"
        wait_for(
            "steps with one pipeline after the preemption",
            lambda: (watcher.latest().get("step") or 0) >= before + 3,
            timeout=180,
        )

        # 5. The higher priority gone: the pipeline is admitted again and comes back.
        custom.delete_namespaced_custom_object(KUEUE, KV, ns, "workloads", high["metadata"]["name"])
        wait_for(
            "the preempted pipeline back",
            lambda: (
                phases() == ["Running", "Running"]
                and (status()["pipelines"][gone["index"]]["returns"] or 0) > gone["returns"]
            ),
            timeout=240,
        )
        steps_seen = [doc["step"] for _, doc in watcher.history if "step" in doc]
        assert steps_seen == sorted(steps_seen), "a step went back"
        final = status()["pipelines"]
        print(
            f"\nPipeline {trains} admitted alone; pipeline {waits} came back at step "
            f"{final[waits].get('returnedAtStep') if gone['index'] != waits else '?'}; pipeline "
            f"{gone['index']} preempted at step {gone['leftAtStep']} and back at step "
            f"{final[gone['index']]['returnedAtStep']}; step {watcher.latest().get('step')} now"
        )
        reasons = {ev.reason for ev in core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={name}").items}  # fmt: skip
        assert {"Admitted", "PipelineLeaving", "PipelineAdded"} <= reasons, reasons
    except BaseException:
        with contextlib.suppress(Exception):
            for p in (0, 1):
                print(p, json.dumps(workload(p), indent=1)[-2500:])
            print(json.dumps(status(), indent=1)[-3000:])
        print(diagnostics(e))
        print(e["kueue"].logs()[-6000:])
        raise
    finally:
        watcher.stop()
        with contextlib.suppress(Exception):
            custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        with contextlib.suppress(Exception):
            custom.delete_namespaced_custom_object(
                KUEUE, KV, ns, "workloads", high["metadata"]["name"]
            )


@dataclass
class _TwoQueued:
    """A `replicas: auto` job of one-stage pipelines queued for a ClusterQueue of its own,
    planned as two pipelines on two Ready nodes of a slow pool of three (the chart's catalog
    adds the slow GPU), the third left to join; what the two tests below read of it."""

    e: dict[str, Any]
    quota: int
    prefix: str
    name: str = ""
    pool: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        e, ns = self.e, self.e["ns"]
        self.pool, self.nodes = slow_pool(f"{self.prefix[:5]}{ns[-6:]}", 3)
        pools = [str(self.pool["name"])]
        cq, lq, tag = _queues(e["custom"], ns, self.prefix, pools)
        _set_quota(e["custom"], cq, pools, {pools[0]: self.quota})

        def manifest(name: str) -> dict[str, Any]:
            return (
                tiny_job(name, e["minio"])
                .label(QUEUE_LABEL, lq)
                .label(PRIORITY_LABEL, f"low-{tag}")
                .pipeline(stages=1, replicas="auto")
                .training(steps=600)
                .placement(pools=pools)
                .build()
            )

        self.name, _ = planned_on_ready_nodes(
            e["core"], e["custom"], ns, self.nodes[:2], manifest,
            lambda plan: len(plan.get("pipelines") or []) == 2, f"kq-{self.prefix}",
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        got = self.e["custom"].get_namespaced_custom_object(
            GROUP, VERSION, self.e["ns"], PLURAL, self.name
        )
        return got.get("status") or {}

    def pipelines(self) -> list[dict[str, Any]]:
        return self.status().get("pipelines") or []

    def workload(self, p: int) -> dict[str, Any]:
        return self.e["custom"].get_namespaced_custom_object(  # type: ignore[no-any-return]
            KUEUE, KV, self.e["ns"], "workloads", workload_name(self.name, p)
        )

    def workload_if_made(self, p: int) -> dict[str, Any] | None:
        """Pipeline p's Workload, or None while there is none: the operator records a
        pipeline in the job's status, then creates its Workload (two writes)."""
        try:
            return self.workload(p)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None

    def log(self, pod: str) -> str:
        paths = sorted((self.e["work"] / "pods" / self.e["ns"] / pod).rglob("container.log"))
        return "".join(p.read_text() for p in paths)

    def training_past_a_commit(self, watcher: ProgressWatcher) -> None:
        wait_for(
            "two pipelines training past a commit",
            lambda: (
                [p["phase"] for p in self.pipelines()] == ["Running", "Running"]
                and (watcher.latest().get("lastCommittedStep") or 0) > 0
            ),
            timeout=300,
        )

    def admitted(self, p: int) -> dict[str, Any]:
        """Pipeline `p`'s Workload's Admitted condition, asserted True."""
        conditions = self.workload(p)["status"]["conditions"]
        admitted = [c for c in conditions if c["type"] == "Admitted"]
        assert admitted and admitted[0]["status"] == "True", conditions
        return admitted[0]  # type: ignore[no-any-return]

    def join_third(self) -> None:
        from relaytrain_testkit.harness import kwok_nodes

        kwok_nodes.create_nodes(self.e["core"].api_client, self.nodes[2:])

    def dump(self) -> None:
        """What a failure shows: the Workloads, the status, the pods' and Kueue's logs."""
        with contextlib.suppress(Exception):
            for p in (0, 1, 2):
                print(p, json.dumps(self.workload(p), indent=1)[-2500:])
            print(json.dumps(self.status(), indent=1)[-3000:])
        print(diagnostics(self.e))
        print(self.e["kueue"].logs()[-6000:])

    def remove(self) -> None:
        from relaytrain_testkit.chaos import delete_nodes

        with contextlib.suppress(Exception):
            self.e["custom"].delete_namespaced_custom_object(
                GROUP, VERSION, self.e["ns"], PLURAL, self.name
            )
        delete_nodes(self.e["core"], [n["metadata"]["name"] for n in self.nodes])


def test_a_running_job_grows_by_a_pipeline_kueue_admits(env: dict[str, Any]) -> None:
    """`replicas: auto` under Kueue (one Workload per pipeline) on a slow pool of two Ready
    GPUs: two pipelines of one stage, each admitted on its own Workload. A third node joins:
    the operator prices a third pipeline, finds it pays, records it out of the job (waiting
    for Kueue) and creates its Workload, shaped as the others'; no pod starts for it before
    Kueue admits it. The ClusterQueue has the quota: Kueue admits it, its stage starts and
    joins the two training at a step boundary with their state; no step goes back."""
    e = env
    core, ns = e["core"], e["ns"]
    job = _TwoQueued(e, quota=3, prefix="grow")
    name, pool = job.name, job.pool
    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")

    def phases() -> list[str]:
        return [p["phase"] for p in job.pipelines()]

    try:
        job.training_past_a_commit(watcher)
        at = watcher.latest()
        assert at["step"] < 200, f"the job ran too fast to grow: {at}"
        job.join_third()
        wait_for(
            "a third pipeline recorded, with a Workload of its own",
            lambda: len(phases()) == 3 and job.workload_if_made(2),
            timeout=120,
        )
        added, shaped = job.workload(2), job.workload(0)
        assert _demand(added) == {pool["name"]: 1} == _demand(shaped), added["spec"]
        assert added["spec"]["queueName"] == shaped["spec"]["queueName"]
        joined = wait_for(
            "the third pipeline admitted by Kueue and joined",
            lambda: "rejoined at step" in job.log(f"{name}-p2-s0") and watcher.latest(),
            timeout=300,
        )
        admitted = job.admitted(2)
        wait_for("three pipelines training", lambda: phases() == ["Running"] * 3, timeout=120)
        # No pod of pipeline 2 was created before Kueue admitted its Workload.
        created = [p for p in core.list_namespaced_pod(ns).items
                   if p.metadata.name.startswith(f"{name}-p2-")]  # fmt: skip
        admitted_at = datetime.fromisoformat(admitted["lastTransitionTime"])
        assert created and all(p.metadata.creation_timestamp >= admitted_at for p in created)
        steps_seen = [doc["step"] for _, doc in watcher.history if "step" in doc]
        assert steps_seen == sorted(steps_seen), "a step went back"
        reasons = {ev.reason for ev in core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={name}").items}  # fmt: skip
        assert "PipelineAdded" in reasons, reasons
        print(
            f"\nKueue: two pipelines admitted at step 0; a node joined at step {at['step']}; "
            f"the third pipeline's Workload admitted and its stage joined by step "
            f"{joined['step']}"
        )
    except BaseException:
        job.dump()
        raise
    finally:
        watcher.stop()
        job.remove()


def test_a_pipeline_whose_node_is_gone_gives_its_workload_back_for_one_kueue_admits(
    env: dict[str, Any],
) -> None:
    """Two one-stage pipelines, one Workload each, on a slow pool of two GPUs whose
    ClusterQueue has exactly their quota. The node under pipeline 1 is deleted: its stage's
    replacement finds no GPU, and after `joinSeconds` the pipeline leaves for good
    (`retired`): its Workload is made inactive, Kueue evicts it and the quota is handed back
    once its pods are gone. A node joins the pool: the operator adds a pipeline there with a
    Workload of its own, which Kueue admits with the quota pipeline 1 gave back, and it joins
    pipeline 0 at a step boundary; no step goes back, and pipeline 1 never comes back."""
    e = env
    core, ns = e["core"], e["ns"]
    job = _TwoQueued(e, quota=2, prefix="retire")
    name, pool = job.name, job.pool
    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")
    try:
        job.training_past_a_commit(watcher)
        core.delete_node(stage_pods(core, ns, name)[f"{name}-p1-s0"].spec.node_name)
        retired = wait_for(
            "pipeline 1 retired",
            lambda: (p := job.pipelines()) and p[1].get("retired") and p[1],
            timeout=120,
        )
        assert retired["phase"] == "Left", retired
        assert "waited" in retired["leftReason"] and "for a GPU" in retired["leftReason"]
        wait_for("its Workload inactive", lambda: job.workload(1)["spec"]["active"] is False)
        at = watcher.latest()
        job.join_third()
        joined = wait_for(
            "a pipeline added on the node that joined, admitted by Kueue and joined",
            lambda: "rejoined at step" in job.log(f"{name}-p2-s0") and watcher.latest(),
            timeout=300,
        )
        job.admitted(2)
        assert _demand(job.workload(2)) == {pool["name"]: 1}
        final = job.pipelines()
        assert final[1]["retired"] and final[1]["phase"] == "Left", final
        assert not [n for n in stage_pods(core, ns, name) if n.startswith(f"{name}-p1-")]
        steps_seen = [doc["step"] for _, doc in watcher.history if "step" in doc]
        assert steps_seen == sorted(steps_seen), "a step went back"
        print(
            f"\nKueue: pipeline 1 retired at step {retired['leftAtStep']} (its node deleted), "
            f"its Workload given back; a node joined at step {at.get('step')}; pipeline 2 "
            f"admitted in its quota and joined by step {joined['step']}"
        )
    except BaseException:
        job.dump()
        raise
    finally:
        watcher.stop()
        job.remove()
