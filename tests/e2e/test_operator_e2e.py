"""A FineTuneJob end to end: operator, real control plane, MinIO and real worker processes.

The kwok process runner (relaytrain_testkit.harness.kwok_runner) runs each stage pod's
container as a local process, so the stages really train a (tiny) Llama and talk over
authenticated links.
The operator is installed as users install it: `helm install` of charts/relaytrain, its
Deployment's pod run by the same runner as the chart's ServiceAccount (a token bound to
the pod, no kubeconfig; relaytrain_testkit.harness.chart_install), in namespaces that enforce
the Pod Security Standard `restricted`. One job runs to completion while the chart is upgraded
under it (a new operator pod; the stage pods and processes stay) and one stage's process
is killed with SIGKILL mid-run, as a dying GPU would: the operator replaces that pod alone,
the surviving stage processes keep running (same PIDs, same pod UIDs), roll back to the last
committed checkpoint, and the job finishes with an adapter in MinIO.
"""

from __future__ import annotations

import base64
import functools
import io
import itertools
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from minio.error import S3Error
from relaytrain_testkit.harness import containers
from relaytrain_testkit.harness.containers import require_image
from relaytrain_testkit.harness.kwok_nodes import SLOW_GPU, slow_pool
from relaytrain_testkit.harness.operator_env import (
    EVERY,
    GROUP,
    PLURAL,
    STEPS,
    VERSION,
    ProgressWatcher,
    diagnostics,
    operator_env,
    planned_on_ready_nodes,
    stage_pods,
    stored_json,
    tiny_job,
)
from relaytrain_testkit.harness.procs import held
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.jobs import Job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _job_status(custom: Any, ns: str, name: str) -> dict[str, Any]:
    """The FineTuneJob's status as the API server has it now ({} before the first write)."""
    status: dict[str, Any] = (
        custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}
    )
    return status


@pytest.fixture(scope="module")
def env(
    kube_cluster: Any,
    minio_server: Any,
    image_registry: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    """The chart's operator pod runs the operator image `make images` built, pushed to the
    session's registry and pulled from it by digest, in a container."""
    require_image("operator")
    operator_image = image_registry.push("operator")
    work = tmp_path_factory.mktemp("e2e")
    with operator_env(
        kube_cluster, minio_server, work, operator_image=operator_image, gpuCatalog=SLOW_GPU
    ) as parts:
        yield parts


# peft 0.21.2's PeftModel.from_pretrained calls a transformers 5.23 API deprecated for v6.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_job_survives_a_stage_killed_mid_run(env: dict[str, Any]) -> None:
    """The stage pods run in real containers from the worker image `make images` built
    (podman and runc, harness/containers.py), under the pod's securityContext in a
    namespace that enforces `restricted`; one is SIGKILLed mid-run, after the job's first
    link certificates expired and renewed ones reached the running stages."""
    e = env
    core, custom, ns, runner = e["core"], e["custom"], e["ns"], e["runner"]
    name = "tiny-lora"
    worker_image = require_image("worker")
    # Certificates of 30 s, renewed halfway: the first ones expire mid-run, and the
    # replacement below links with renewed ones to neighbours that read theirs again.
    job = tiny_job(name, e["minio"]).image(worker_image)
    job = job.link_certificates(lifetime_seconds=30, renew_at_percent=50)
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job.build())

    status = functools.partial(_job_status, custom, ns, name)

    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")
    first_links = wait_for(
        "status.linkCertificates", lambda: status().get("linkCertificates"), timeout=120
    )
    assert first_links["generation"] == 0, first_links

    def progressed_past_a_commit() -> Any:
        if status().get("phase") == "Failed":  # say why now, not when the wait runs out
            raise AssertionError(f"the job failed: {status()}")
        prog = watcher.latest()
        committed = prog.get("lastCommittedStep")
        return committed is not None and committed >= EVERY and prog

    try:
        before = wait_for("a committed checkpoint", progressed_past_a_commit, timeout=400)
    except AssertionError as err:
        watcher.stop()
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None

    pods = stage_pods(core, ns, name)
    assert before["step"] < STEPS - EVERY, f"the job ran too fast to be interrupted: {before}"
    assert sorted(pods) == [f"{name}-stage-{k}" for k in range(3)]
    # The operator that runs the job: the chart's pod, from the operator image pulled from
    # the registry by digest, in a container as the chart's user.
    release = e["release"]
    operator = release.operator_pod()
    assert operator.spec.containers[0].image == e["operator_image"]
    assert "@sha256:" in e["operator_image"]
    running = release.runner.local_pod(operator.metadata.namespace, operator.metadata.name)
    assert running is not None and running.container is not None
    uid = containers.exec_in(running.container, "python", "-c", "import os; print(os.getuid())")
    assert uid.stdout.strip() == "65532", uid
    # Inside a stage's container: the pod's numeric non-root user, a root filesystem that
    # refuses a write, and the pod's volumes (/tmp, the cache) that take one.
    inside = runner.local_pod(ns, f"{name}-stage-0").container
    assert inside is not None, "the stage pod did not run in a container"
    probe = containers.exec_in(inside, "python", "-c", _WRITES)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == {
        "uid": 10001, "gid": 10001, "/opt/venv/x": "EROFS", "/x": "EROFS",
        "/tmp/x": "written", "/cache/x": "written",
    }, probe.stdout  # fmt: skip

    # `helm upgrade` while it trains: a new operator pod; the stage pods and their
    # processes stay as they are (checked with the survivors at the end). Stage 0 is held
    # (SIGSTOP) meanwhile, so that a fast machine cannot finish all the steps during the
    # upgrade and leave nothing to interrupt; the others wait on its activations.
    release, values = e["release"], e["values"]
    old_operator = release.operator_pod().metadata.uid
    processes = {n: runner.local_pod(ns, n).pid for n in pods}
    stopped = processes[f"{name}-stage-0"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        values["resyncSeconds"] = 2
        release.upgrade(values)
        upgraded, _ = release.ready_operator()
    except BaseException:
        os.kill(stopped, signal.SIGCONT)
        raise
    assert upgraded.metadata.uid != old_operator
    # Still held: the job's first certificates run out, renewed ones are in place.
    first_expiry = datetime.fromisoformat(first_links["notAfter"])

    def renewed_and_first_expired() -> Any:
        links = status().get("linkCertificates") or {}
        expired = datetime.now(UTC) > first_expiry
        return expired and links.get("generation", 0) >= 1 and links

    try:
        renewed = wait_for("the first certificates expired", renewed_and_first_expired, timeout=120)
    except BaseException:
        os.kill(stopped, signal.SIGCONT)
        raise
    print(f"Link certificates at generation {renewed['generation']} ({renewed['phase']})")
    now = stage_pods(core, ns, name)
    assert {n: p.metadata.uid for n, p in now.items()} == {
        n: p.metadata.uid for n, p in pods.items()
    }
    assert {n: runner.local_pod(ns, n).pid for n in now} == processes
    victim = f"{name}-stage-1"
    survivors = {
        n: (p.metadata.uid, runner.local_pod(ns, n).pid) for n, p in pods.items() if n != victim
    }
    victim_pid = runner.local_pod(ns, victim).pid
    before = watcher.latest()  # where training is at the moment of the kill
    assert before["step"] < STEPS - EVERY, f"the job ran too fast to be interrupted: {before}"
    os.kill(victim_pid, signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()
    os.kill(stopped, signal.SIGCONT)

    def replaced() -> Any:
        now = stage_pods(core, ns, name)
        new = now.get(victim)
        return new is not None and new.metadata.uid != pods[victim].metadata.uid and new

    try:
        # The operator pod that `helm upgrade` just started notices it; on a loaded machine
        # its first passes can take a while.
        wait_for("the killed stage's pod to be replaced", replaced, timeout=300)
    except AssertionError as err:
        watcher.stop()
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None

    try:
        final = _ended(status, "the job to finish")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None
    took = time.monotonic() - killed_at
    assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
    print(f"\nJob finished {took:.1f}s after the kill; last step before it {before.get('step')}")

    # Survivors: one pod and one process each, from before the kill to a clean exit.
    for n, (uid, pid) in survivors.items():
        started = [(lp.uid, lp.pid) for lp in runner.history if lp.name == n]
        assert started == [(uid, pid)], f"{n} was restarted: {started}"
        # It ended by itself (0) or was stopped by its pod's deletion once the job succeeded
        # (130 while it still ran, 143 — SIGTERM — once it had finished:
        # tests/unit/test_worker_sigterm.py; -15 when the SIGTERM found podman's client
        # itself tearing the ended container down, and podman's own 127 when the container
        # it forwarded the SIGTERM to had already ended and been removed, as its log says).
        wait_for(f"{n}'s container to end", lambda uid=uid: uid in runner.finished, timeout=60)
        code = runner.finished[uid]
        said = "".join(p.read_text() for p in (e["work"] / "pods" / ns / n).rglob("container.log"))
        raced = code == 127 and "container has already been removed" in said
        clean = code in (0, 130, 128 + signal.SIGTERM, -signal.SIGTERM) or raced
        assert clean, f"{n} exited with {code}: {said[-2000:]}"
    assert [lp.name for lp in runner.history].count(victim) == 2
    history = {s["index"]: s for s in final.get("stages", [])}
    assert history[1]["restarts"] == 1
    # Work lost is at most one checkpoint interval: after the kill the pipeline rolled
    # back no further than the last commit, and training went on from there.
    watcher.stop()
    after = [(t, doc) for t, doc in watcher.history if t > killed_at]
    lowest = min(doc["step"] for _, doc in after)
    # (The watcher may lag the pipeline by a few steps, so `before` is a lower bound of
    # where training was at the kill: nothing after the kill may go back further than one
    # interval before it.)
    assert lowest >= before["step"] - EVERY, (before, lowest)
    respawned = [lp for lp in runner.history if lp.name == victim][-1]
    print(
        f"Stage 1 killed at step {before['step']}; its replacement process started "
        f"{respawned.started_at - killed_wall:.1f}s later; lowest step reported after the "
        f"kill {lowest}"
    )
    # status.stages says which commit the replacement restored: one made no earlier than
    # one interval before the step the job had reached.
    restored = history[1].get("restoredFromStep")
    assert restored is not None and restored >= before["step"] - EVERY, (restored, before)
    print(f"The replacement restored the commit of step {restored}")

    events = core.list_namespaced_event(ns).items
    assert any(ev.reason == "StageRestarting" and victim in (ev.message or "") for ev in events)
    assert any(ev.reason == "LinkCertificatesRenewed" for ev in events)

    out = final.get("output") or {}
    mc = e["minio"].client()
    files = {
        o.object_name.rsplit("/", 1)[-1]
        for o in mc.list_objects(e["minio"].bucket, f"adapters/{name}/", recursive=True)
    }
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, (out, files)
    # What the containers wrote loads with peft onto the model it was trained from.
    adapter = e["work"] / f"adapter-{name}"
    for f in files:
        mc.fget_object(e["minio"].bucket, f"adapters/{name}/{f}", str(adapter / f))
    _load_with_peft(e["model"], adapter)


_WRITES = """
import errno, json, os
out = {"uid": os.getuid(), "gid": os.getgid()}
for path in ("/opt/venv/x", "/x", "/tmp/x", "/cache/x"):
    try:
        open(path, "w").close()
        out[path] = "written"
    except OSError as exc:
        out[path] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def _load_with_peft(model_dir: Path, adapter: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, adapter)
    lora = [n for n, _ in tuned.named_parameters() if "lora_B" in n]
    assert lora, "the adapter added no LoRA weights"
    trained = [n for n, p in tuned.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert trained, "every lora_B is zero: the adapter was never trained"


def test_two_pipelines_train_one_job_export_what_the_chart_queries_and_survive_a_kill_and_a_drain(
    env: dict[str, Any],
) -> None:
    """Two 2-stage pipelines of real worker processes, wired by the operator through the
    Service's stable names, train one job: each pipeline's share of every step, gradients
    reduced across them, one progress record and one adapter. Every stage's /metrics and
    the chart-installed operator's are read while they train: every metric the chart's
    PrometheusRule and Grafana dashboard query is among what they export. A stage of
    pipeline 1 is then killed mid-run and takes out its pipeline only: the operator replaces
    that pod alone, pipeline 0's processes keep running and never step back, the job is
    Degraded meanwhile, and pipeline 1 rejoins. Then `kubectl drain` of a node under
    pipeline 0 (its cordon, and the eviction of the pod) is a planned departure: pipeline 0
    leaves at a step boundary with no failure counted, pipeline 1 trains on and writes with
    no step back, and pipeline 0 comes back at once on free GPUs elsewhere and rejoins."""
    from relaytrain_testkit.harness.chart_rbac import render_chart

    e = env
    core, custom, ns, runner = e["core"], e["custom"], e["ns"], e["runner"]
    # Enough steps for the replacement to start and rejoin while pipeline 0 trains on: on
    # an idle machine pipeline 0 alone takes about ten steps a second, and the replacement
    # needs about ten seconds to load and link (150 steps were not enough there).
    name, steps = "tiny-fleet", 400
    manifest = (
        tiny_job(name, e["minio"]).pipeline(stages=2, replicas=2).training(steps=steps).build()
    )
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)

    status = functools.partial(_job_status, custom, ns, name)

    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")
    stages = [f"{name}-p{p}-s{k}" for p in range(2) for k in range(2)]
    try:
        # What the four stages and the operator export, read while they train.
        exported = wait_for(
            "every stage's /metrics",
            functools.partial(_every_stage_exports, runner, ns, stages),
            timeout=300,
        )
        exported |= _families(f"http://127.0.0.1:{e['values']['metrics']['port']}/metrics")
        at = wait_for(
            "a few steps of both pipelines",
            lambda: (p := watcher.latest()).get("step", 0) >= 4 and p,
            timeout=400,
        )
    except AssertionError as err:
        watcher.stop()
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None
    assert at["step"] < steps - 4, f"the job ran too fast to be interrupted: {at}"
    pods = stage_pods(core, ns, name)
    assert sorted(pods) == [f"{name}-p{p}-s{k}" for p in range(2) for k in range(2)]
    victim = f"{name}-p1-s1"
    survivors = {
        n: (p.metadata.uid, runner.local_pod(ns, n).process.pid)
        for n, p in pods.items()
        if n.startswith(f"{name}-p0-")
    }
    os.kill(runner.local_pod(ns, victim).process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    drained = None
    try:
        wait_for(
            "the job Degraded",
            lambda: any(
                c["type"] == "Degraded" and c["status"] == "True"
                for c in status().get("conditions") or []
            ),
            timeout=120,
        )
        wait_for("pipeline 1 rejoined", lambda: "rejoined at step" in _log(e, victim), timeout=300)
        drained = str(stage_pods(core, ns, name)[f"{name}-p0-s1"].spec.node_name)
        left, back = _drain_pipeline_0(e, name, drained, status)
        final = _ended(status, "the two-pipeline job to finish")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None
    finally:
        watcher.stop()
        if drained is not None:
            core.patch_node(drained, {"spec": {"unschedulable": None}})
    assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
    shares = [p["microBatches"] for p in final["plan"]["pipelines"]]
    assert len(shares) == 2 and sum(shares) == 3 and min(shares) >= 1
    # Pipeline 0: one pod and one process each until the drain, then one more each; only
    # the victim restarted in pipeline 1.
    for n, (uid, pid) in survivors.items():
        started = [(lp.uid, lp.process.pid) for lp in runner.history if lp.name == n]
        assert len(started) == 2 and started[0] == (uid, pid), f"{n}: {started}"
    ran = [lp.name for lp in runner.history if lp.name.startswith(f"{name}-")]
    assert sorted(set(ran)) == [f"{name}-p{p}-s{k}" for p in range(2) for k in range(2)]
    assert ran.count(victim) == 2 and ran.count(f"{name}-p1-s0") == 1
    # The job never stepped back: no rollback, the steps after the kill only go up.
    after = [doc["step"] for t, doc in watcher.history if t > killed_at]
    assert after == sorted(after) and after[-1] == steps, after
    assert final["restarts"] == 1  # the kill; the drain was a departure, not a failure
    assert [p["restarts"] for p in final["pipelines"]] == [0, 1]
    assert final["progress"]["step"] == steps and final["progress"]["loss"] > 0
    degraded = next(c for c in final["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"
    # The drain: pipeline 0 left at a step boundary and came back elsewhere.
    reason = left["pipelines"][0]["leftReason"]
    assert reason == f"node {drained} is cordoned (a drain or maintenance)", reason
    assert drained not in {p.spec.node_name for p in back.values()}
    assert final["pipelines"][0]["returns"] == 1
    for k in range(2):
        # How the runner stopped each process is in its kubelet.log (diagnostics).
        assert "left the job at step" in _log(e, f"{name}-p0-s{k}"), (
            f"p0/s{k} did not lead pipeline 0 out:\n{diagnostics(e)}"
        )
        assert "from a pipeline that left" not in _log(e, f"{name}-p1-s{k}")
    assert "rejoined at step" in _log(e, f"{name}-p0-s0")
    reasons = {ev.reason for ev in core.list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name}").items}  # fmt: skip
    assert {"PipelineLeaving", "PipelineAdded"} <= reasons, reasons
    files = {
        o.object_name.rsplit("/", 1)[-1]
        for o in e["minio"]
        .client()
        .list_objects(e["minio"].bucket, f"adapters/{name}/", recursive=True)
    }
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    print(
        f"\nTwo pipelines: killed {victim} at step {at['step']}; the job finished "
        f"{time.monotonic() - killed_at:.1f}s later at step {after[-1]} without a step back"
    )
    # Every metric the chart's alerts and dashboard query is among what the run exported.
    docs = render_chart("mon", "relaytrain-system",
                        "monitoring.prometheusRule.enabled=true",
                        "monitoring.grafanaDashboard.enabled=true")  # fmt: skip
    rules = next(d for d in docs if d["kind"] == "PrometheusRule")
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    board = next(d for d in docs if d["kind"] == "ConfigMap" and "relaytrain.json" in d["data"])
    panels = json.loads(board["data"]["relaytrain.json"])["panels"]
    queries = [t["expr"] for panel in panels for t in panel["targets"]]
    named = {n for q in exprs + queries for n in re.findall(r"\brelaytrain_[a-z0-9_]+", q)}
    assert len(exprs) == 4 and len(queries) >= 10 and len(named) >= 12, (exprs, named)
    assert named - exported == set(), f"queried but not exported: {sorted(named - exported)}"
    print(f"{len(named)} metrics queried by the chart, all among {len(exported)} exported")


def test_a_job_of_replicas_auto_grows_by_a_pipeline_on_each_node_that_joins(
    env: dict[str, Any],
) -> None:
    """`replicas: auto` on a pool of one GPU: one pipeline of one stage. A second node of
    the pool joins while it trains: the operator prices a second pipeline there, restart
    included (the one pipeline's documents have no replicas to grow by), finds it pays,
    records the plan of two, and replaces the one pipeline's pod by pipeline 0's beside
    pipeline 1's: both restore the last commit, no failure counted. A third node joins: the
    operator adds a third pipeline hot — mints its stage's certificate under a CA of its own
    that the Secret adds to what every stage trusts, tells the stages training through the
    store (fleet.json) and creates its pod; the pipelines training dial it and admit it at a
    step boundary with their state. The job finishes on three pipelines: no restart, no step
    back but the restart's (to its last commit), each change counted as `added`."""
    from relaytrain_testkit.chaos import delete_nodes, node_ready
    from relaytrain_testkit.harness import kwok_nodes

    e = env
    core, custom, ns = e["core"], e["custom"], e["ns"]
    mc, bucket = e["minio"].client(), e["minio"].bucket
    pool, nodes = slow_pool(f"grow{ns[-6:]}", 3)
    names = [n["metadata"]["name"] for n in nodes]
    name, steps = "tiny-grows", 500
    manifest = (
        tiny_job(name, e["minio"])
        .pipeline(stages=1, replicas="auto")
        .training(steps=steps)
        .placement(pools=[str(pool["name"])])
        .build()
    )
    status = functools.partial(_job_status, custom, ns, name)
    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")

    def training(count: int) -> Any:
        """The status once `count` pipelines' pods run and each stage said it trains."""
        st = status()
        phases = [p["phase"] for p in st.get("pipelines") or []]
        said = all("micro-batches from step" in _log(e, f"{name}-p{p}-s0") for p in range(count))
        return phases == ["Running"] * count and said and st

    try:
        kwok_nodes.create_nodes(core.api_client, nodes[:1])
        wait_for(f"{names[0]} Ready", functools.partial(node_ready, core, names[0]))
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
        one = wait_for(
            "one pipeline training past a commit",
            lambda: (
                (st := status()).get("phase") == "Running"
                and not st.get("pipelines")
                and (st.get("progress") or {}).get("lastCommittedStep")
                and st
            ),
            timeout=300,
        )
        assert one["progress"]["step"] < steps // 3, f"the job ran too fast to grow: {one}"
        second = time.monotonic()
        kwok_nodes.create_nodes(core.api_client, nodes[1:2])
        two = wait_for("two pipelines training", lambda: training(2), timeout=300)
        took = {"two": time.monotonic() - second}
        restarted = [doc["step"] for _, doc in watcher.history]
        third = time.monotonic()
        kwok_nodes.create_nodes(core.api_client, nodes[2:])
        grown = wait_for(
            "a third pipeline recorded",
            lambda: len((st := status()).get("pipelines") or []) == 3 and st,
            timeout=120,
        )
        joined = wait_for(
            "the third pipeline admitted",
            lambda: "rejoined at step" in _log(e, f"{name}-p2-s0") and watcher.latest(),
            timeout=300,
        )
        took["three"] = time.monotonic() - third
        final = _ended(status, "the grown job to finish")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None
    finally:
        watcher.stop()
        delete_nodes(core, names)
    assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
    # The one pipeline became pipeline 0: its pod replaced, both pipelines from the commit.
    assert [p.get("addedAtStep") is not None for p in two["pipelines"]] == [False, True]
    assert "restored committed step" in _log(e, f"{name}-p0-s0")
    assert "restored committed step" in _log(e, f"{name}-p1-s0")
    assert f"{name}-stage-0" in [lp.name for lp in e["runner"].history]
    added = grown["pipelines"][2]
    assert added["addedAtStep"] is not None and added["addedAtStep"] < joined["step"] < steps
    plan = final["plan"]["pipelines"]
    assert [p["stages"][0]["pool"] for p in plan] == [pool["name"]] * 3
    assert [p["microBatches"] for p in plan] == [1, 1, 1]  # the step's three, one each
    assert final["restarts"] == 0 and final["progress"]["step"] == steps
    # Steps go back once, to the last commit, at the restart; never when the third joins.
    after = [doc["step"] for _, doc in watcher.history]
    backs = [(a, b) for a, b in itertools.pairwise(after) if b < a]
    assert len(backs) <= 1, backs
    assert all(b >= one["progress"]["lastCommittedStep"] for _, b in backs), backs
    assert after[len(restarted) :] == sorted(after[len(restarted) :]), after
    # The stages training were told, before the pod existed, where it listens and who it is.
    fleet = stored_json(mc, bucket, f"ckpt/{ns}/{name}/fleet.json")
    told = [[s["pipeline"], s["stage"]] for a in fleet["added"] for s in a["stages"]]
    assert told == [[1, 0], [2, 0]]
    # The restart replaced every stage under a new plan epoch, which the job's store names
    # (a stage of the one pipeline still running writes no more); adding the third did not.
    uid = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)["metadata"]["uid"]
    assert stored_json(mc, bucket, f"ckpt/{ns}/{name}/plan.json") == {"uid": uid, "epoch": 1}
    assert final["planEpoch"] == 1
    for p in (0, 1):
        assert "links to the added pipeline(s) [2]" in _log(e, f"{name}-p{p}-s0")
    # Pipeline 0 shares the step as the grown plan does (1 of 3, not its document's 2).
    assert "takes 1 of each step's micro-batches as planned now" in _log(e, f"{name}-p0-s0")
    secret = core.read_namespaced_secret(f"{name}-link", ns).data
    assert {"p1-s0.crt", "p2-s0.crt", "p2-s0.key"} <= set(secret)
    assert base64.b64decode(secret["ca.crt"]).count(b"BEGIN CERTIFICATE") == 3
    events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    said = sorted(ev.message for ev in events if ev.reason == "PipelineAdded")
    assert len(said) == 2, said
    assert "Pipeline 1 is added after step" in said[0] and "restarts beside it" in said[0]
    assert "Pipeline 2 is added after step" in said[1], said
    metrics = _metric_samples(f"http://127.0.0.1:{e['values']['metrics']['port']}/metrics")
    assert metrics.get(("relaytrain_pipeline_changes_total", ns, "added"), 0) >= 2, metrics
    # The restart's restore first; a link lost later (a slow machine's timeout) restores the
    # newest commit again, which the status above shows sent no step back a second time.
    restored, *again = re.findall(r"restored committed step (\d+)", _log(e, f"{name}-p0-s0"))
    print(
        f"\nGrew from one pipeline to two, {took['two']:.1f} s from the node's creation to "
        f"both training (restarted from the commit of step {restored}"
        f"{f'; restored again after a lost link: {again}' if again else ''}, "
        f"{max((a - b for a, b in backs), default=0)} steps trained again), then to three hot, "
        f"{took['three']:.1f} s from the node's creation to its admission (recorded at "
        f"step {added['addedAtStep']}, admitted by step {joined['step']}); finished at step "
        f"{steps}"
    )


def test_a_stage_whose_node_is_gone_is_resplit_onto_what_is_left_and_back_when_a_gpu_joins(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pipeline, `stages: auto`, on a pool of three GPUs: three stages. The node under
    stage 2 is deleted and no GPU is free: after `joinSeconds` the operator re-splits the
    pipeline into two stages on the GPUs it still holds, and every stage restarts from the
    last commit in the new split. A node joins the pool: the job is re-split back to three
    stages. Real stage processes train throughout, over uncompressed links; every loss any
    last stage computed for a step, before or after a re-split, is the one the job's final
    loss history holds for that step, bit for bit: a step trained again in another split is
    the same arithmetic (state restored by parameter name, the same micro-batches)."""
    from relaytrain_testkit.chaos import delete_nodes
    from relaytrain_testkit.harness import kwok_nodes

    e = env
    core, custom, ns, runner = e["core"], e["custom"], e["ns"], e["runner"]
    mc, bucket = e["minio"].client(), e["minio"].bucket
    pool, nodes = slow_pool(f"split{ns[-6:]}", 4)
    names = [n["metadata"]["name"] for n in nodes]
    # Enough steps left when the node joins for the re-split back to pay for its restart
    # (priced on the steps left): two forked stages train about 50 steps a second here, and
    # 300 steps once ran out first: a re-split back here pays only while about 200 steps or
    # more are left (it saves about 1.7 s a step against a restart priced at about 330 s).
    steps = 600
    monkeypatch.setenv("RELAYTRAIN_LOG_LEVEL", "DEBUG")  # each step's loss, in every bit

    def manifest(name: str) -> dict[str, Any]:
        return (
            tiny_job(name, e["minio"])
            .pipeline(stages="auto", compression="none")  # int8 rounds at the boundaries
            .training(steps=steps)
            .checkpoint(f"s3://{bucket}/ckpt", endpoint=e["minio"].url, every_steps=20, keep=2)
            .placement(pools=[str(pool["name"])])
            .build()
        )

    name, _ = planned_on_ready_nodes(
        core, custom, ns, nodes[:3], manifest, lambda plan: len(plan["stages"]) == 3,
        "tiny-resplit",
    )  # fmt: skip
    status = functools.partial(_job_status, custom, ns, name)
    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")

    def replanned(words: str) -> list[Any]:
        events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
        return [ev for ev in events.items if ev.reason == "Replanned" and words in ev.message]

    def training_on(count: int, past: int) -> Any:
        """The status once `count` planned stages run and the job is past step `past`."""
        st = status()
        stages = st.get("stages") or []
        running = len(stages) == count and all(s.get("phase") == "Running" for s in stages)
        return running and watcher.latest().get("step", 0) > past and st

    try:
        three = wait_for(
            "three stages training past a commit",
            lambda: (
                training_on(3, 0)
                and (watcher.latest().get("lastCommittedStep") or 0) >= 20
                and status()
            ),
            timeout=300,
        )
        first = [(s["layerStart"], s["layerEnd"]) for s in three["plan"]["stages"]]
        assert len(first) == 3, three["plan"]
        at = watcher.latest()
        assert at["step"] < steps // 3, f"the job ran too fast to be re-split: {at}"
        gone = stage_pods(core, ns, name)[f"{name}-stage-2"].spec.node_name
        core.delete_node(gone)  # no GPU is free anywhere else in the pool
        wait_for("a re-split to two stages", lambda: replanned("instead of 3 stages"), timeout=120)
        # Past the furthest step the three stages reported: the two stages' own progress.
        furthest = max(doc.get("step", 0) for _, doc in watcher.history)
        two = wait_for("two stages training", lambda: training_on(2, furthest), timeout=300)
        assert two["plan"]["resplitFrom"]["stages"] == 3, two["plan"]
        kwok_nodes.create_nodes(core.api_client, nodes[3:])
        back = wait_for("a re-split back", lambda: replanned("re-split back"), timeout=120)
        final = _ended(status, "the re-split job to finish")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None
    finally:
        watcher.stop()
        delete_nodes(core, names)
    assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
    assert "3 stages" in back[0].message and "instead of 2 stages" in back[0].message
    plan = final["plan"]
    assert [(s["layerStart"], s["layerEnd"]) for s in plan["stages"]] == first, plan
    assert "resplitFrom" not in plan and final["restarts"] == 0, final
    assert final["progress"]["step"] == steps
    # Each re-split started every stage again from the last commit, in its split.
    ran = [lp.name for lp in runner.history if lp.name.startswith(f"{name}-")]
    if [ran.count(f"{name}-stage-{k}") for k in range(3)] != [3, 3, 2]:
        events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
        said = "\n".join(f"{ev.reason}: {ev.message}" for ev in events.items)
        raise AssertionError(
            f"stage processes started {ran}, not 3, 3 and 2 times:\n"
            f"{runner.chronicle(ns, f'{name}-')}\nThe job's Events:\n{said}\n{diagnostics(e)}"
        )
    # (Per process: the first stage 0 may also have rolled back in place when stage 2's link
    # went, and a two-stage process replaced before it logged a line restored nothing yet.)
    after = [lp for lp in runner.history if lp.name == f"{name}-stage-0"][1:]
    logs = [lp.log_path.read_text() for lp in after]
    restored = [re.findall(r"restored committed step (\d+)", text)[:1] for text in logs]
    assert restored[-1] and all(r for r, text in zip(restored, logs, strict=True) if text), logs
    restored = [r[0] if r else "-" for r in restored]
    # Every loss a last stage computed for a step, first time or trained again after a
    # re-split, is the loss the history holds for it, bit for bit (the float's repr).
    history = stored_json(mc, bucket, f"ckpt/{ns}/{name}/loss-history.json")
    losses = {r["step"]: r["loss"] for r in history}
    assert sorted(losses) == list(range(1, steps + 1)), sorted(losses)[:5]
    line = re.compile(r"Step (\d+) loss (\S+)$", re.MULTILINE)
    computed = [
        [(int(m[1]), float(m[2])) for m in line.finditer(lp.log_path.read_text())]
        for lp in runner.history
        if lp.name.startswith(f"{name}-stage-")
    ]
    off = [(step, loss, losses[step]) for seen in computed for step, loss in seen
           if loss != losses[step]]  # fmt: skip
    assert not off, off[:5]
    # Steps trained by two processes: those after the commit a re-split restarted from (a
    # split stopped right at a commit retrains nothing; with a commit every 20 steps, both
    # re-splits doing so is about a 1-in-400 chance).
    again = sorted({s for k, seen in enumerate(computed) for s, _ in seen
                    if any(s in dict(other) for other in computed[k + 1 :])})  # fmt: skip
    assert again, f"no step trained twice: nothing compared across splits ({restored})"
    print(
        f"\nRe-split from {first} to two stages after the node under stage 2 was deleted "
        f"(restored step {restored[0]}), back to three when a GPU joined (restored step "
        f"{restored[1]}); {sum(map(len, computed))} computed losses equal to the history's, "
        f"{len(again)} steps trained in two splits: {again}; {back[0].message}"
    )


def _metric_samples(url: str) -> dict[tuple[str, str, str], float]:
    """relaytrain_pipeline_changes_total by (name, namespace, change) from `url`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels.get("namespace", ""), s.labels.get("change", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "relaytrain_pipeline_changes_total"
    }


def test_pipeline_0_given_up_leaves_pipeline_1_to_write_resume_and_finish_the_job(
    env: dict[str, Any],
) -> None:
    """With no restarts allowed, a killed stage of pipeline 0 gives pipeline 0 up: its pods
    go and a PipelineFailed Event says so, the job stays Running (Degraded) — pipeline 0 is
    no longer the one the job cannot lose — and pipeline 1, now the lowest training, writes
    the commits and the progress. The operator tells the stages through the store, so after
    a suspend and resume pipeline 1 resumes from its own last commit without waiting for
    pipeline 0's stages, and writes the adapter: the job Succeeds with every step done."""
    e = env
    core, custom, ns, runner = e["core"], e["custom"], e["ns"], e["runner"]
    # Steps enough that pipeline 1 is still training when the suspend lands: it is killed at
    # the first commit and suspended two of its own commits later (step 20 to 30 or so); the
    # rest is trained after the resume, where only the last step and commit are looked at.
    name, steps = "tiny-writer", 240
    manifest = (
        tiny_job(name, e["minio"])
        .pipeline(stages=2, replicas=2)
        .training(steps=steps)
        .failure_policy(max_stage_restarts=0)
        .build()
    )
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
    status = functools.partial(_job_status, custom, ns, name)
    mc, bucket = e["minio"].client(), e["minio"].bucket
    watcher = ProgressWatcher(e["minio"], f"ckpt/{ns}/{name}/progress.json")
    try:
        at = wait_for(
            "a commit of both pipelines",
            lambda: (p := watcher.latest()).get("lastCommittedStep") and p,
            timeout=400,
        )
        assert at["step"] < steps // 4, f"the job ran too fast to be interrupted: {at}"
        pods = stage_pods(core, ns, name)
        survivors = {
            n: runner.local_pod(ns, n).process.pid for n in pods if n.startswith(f"{name}-p1-")
        }
        os.kill(runner.local_pod(ns, f"{name}-p0-s1").process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # Pipeline 1's pods can start, train and commit before the operator has seen them
        # run (forked stages start in a blink): wait for its record of pipeline 1 too.
        given_up = wait_for(
            "pipeline 0 given up, pipeline 1 seen training",
            lambda: (
                (st := status()).get("pipelines")
                and [p["phase"] for p in st["pipelines"]][:2] == ["Failed", "Running"]
                and st
            ),
            timeout=120,
        )
        assert given_up["phase"] == "Running", given_up  # not Failed: pipeline 1 trains on
        told = wait_for(
            "the stages told",
            lambda: _stored_or_none(mc, bucket, f"ckpt/{ns}/{name}/given-up.json"),
            timeout=60,
        )
        assert told == {"pipelines": [0]}
        # Pipeline 1 writes now: it commits on its own, and progress goes on.
        base = given_up.get("progress", {}).get("lastCommittedStep") or at["lastCommittedStep"]
        mine = wait_for(
            "a commit of pipeline 1's",
            lambda: (p := watcher.latest()).get("lastCommittedStep", 0) > base + EVERY and p,
            timeout=300,
        )
        assert mine["step"] < steps - 20, f"pipeline 1 finished before the suspend: {mine}"
        for n, pid in survivors.items():  # never restarted up to here
            assert runner.local_pod(ns, n).process.pid == pid, n
            assert runner.local_pod(ns, n).process.poll() is None, n
        before = [doc["step"] for t, doc in watcher.history if t > killed_at]
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, {"spec": {"suspend": True}}
        )
        wait_for("phase Suspended", lambda: status().get("phase") == "Suspended", timeout=120)
        wait_for("no stage pods", lambda: not stage_pods(core, ns, name), timeout=120)
        suspended = watcher.latest()
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, {"spec": {"suspend": False}}
        )
        final = _ended(status, "the job to finish on pipeline 1")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnostics(e)}") from None
    finally:
        watcher.stop()
    assert final["phase"] == "Succeeded", f"{final}\n{diagnostics(e)}"
    assert [p["phase"] for p in final["pipelines"]] == ["Failed", "Succeeded"]
    events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    assert any(
        ev.reason == "PipelineFailed" and "Pipeline 0 is given up" in ev.message for ev in events
    ), [(ev.reason, ev.message) for ev in events]
    # Progress went on from the kill to the suspend, never back; pipeline 0 was not
    # started again on resume, pipeline 1's stages were, and resumed from its own commit.
    assert before == sorted(before) and before[-1] >= mine["step"], before
    ran = [lp.name for lp in runner.history if lp.name.startswith(f"{name}-")]
    assert ran.count(f"{name}-p0-s0") == ran.count(f"{name}-p0-s1") == 1, ran
    assert ran.count(f"{name}-p1-s0") == ran.count(f"{name}-p1-s1") == 2, ran
    resumed = suspended["lastCommittedStep"]
    for k in range(2):
        logs = "".join(
            p.read_text()
            for p in (e["work"] / "pods" / ns / f"{name}-p1-s{k}").rglob("container.log")
        )
        assert "links without given-up pipeline(s) [0]" in logs, logs[-3000:]
        restored = [int(n) for n in re.findall(r"restored committed step (\d+)", logs)]
        assert restored and restored[-1] >= resumed, logs[-3000:]
    assert final["progress"]["step"] == steps and final["progress"]["lastCommittedStep"] == steps
    body = stored_json(mc, bucket, f"ckpt/{ns}/{name}/step-{steps}/manifest.json")["body"]
    assert (body["pipeline"], body["numStages"]) == (1, 2), body
    files = {
        o.object_name.rsplit("/", 1)[-1]
        for o in mc.list_objects(bucket, f"adapters/{name}/", recursive=True)
    }
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    print(
        f"\nPipeline 0 given up at step {at['step']}; pipeline 1 committed step "
        f"{mine['lastCommittedStep']} alone, was suspended at {suspended['step']}, resumed from "
        f"step {resumed} and finished the job {time.monotonic() - killed_at:.1f}s after the kill"
    )


def _ended(status: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """The job's status once it Succeeded or Failed (waited for up to ten minutes)."""
    ended: dict[str, Any] = wait_for(
        what, lambda: (st := status()).get("phase") in ("Succeeded", "Failed") and st, timeout=600
    )
    return ended


def _log(e: dict[str, Any], pod: str) -> str:
    """Everything the containers of stage pod `pod` wrote, every incarnation."""
    paths = sorted((e["work"] / "pods" / e["ns"] / pod).rglob("container.log"))
    return "".join(p.read_text() for p in paths)


def _drain_pipeline_0(
    e: dict[str, Any], name: str, drained: str, status: Callable[[], Any]
) -> tuple[Any, Any]:
    """`kubectl drain` of node `drained`, under stage p0/s1 of job `name`: cordon, then
    evict, in the order a drain meets them: the evicted stage is asked to stop before the
    operator has seen the cordon (held meanwhile, as a busy operator would be), so it trains
    on until its stage 0, which the operator then removes, leads the pipeline out. Waits
    until pipeline 0 has left (its record says why: its Left phase may last one pass) and
    its processes ended, then holds pipeline 1's first stage until pipeline 0's new pods
    run, so that the job cannot finish first on a fast machine. Returns the status that said
    pipeline 0 left, and the pods once pipeline 0 is back. The caller uncordons."""
    core, ns, runner = e["core"], e["ns"], e["runner"]
    pods = stage_pods(core, ns, name)
    leaving = [runner.local_pod(ns, n).process for n in pods if "-p0-" in n]
    operator = e["release"].ready_operator()[1].pid
    evicted = f"{name}-p0-s1"
    # Held for less than the three failed liveness probes (20 s apart) that would restart it:
    # a failure here leaves the operator as it was for the tests after this one.
    with held(operator):
        core.patch_node(drained, {"spec": {"unschedulable": True}})
        evict = client.V1Eviction(metadata=client.V1ObjectMeta(name=evicted, namespace=ns))
        core.create_namespaced_pod_eviction(evicted, ns, evict)
        try:
            wait_for(
                "the evicted stage asked to stop",
                lambda: "was asked to stop" in _log(e, evicted),
                timeout=30,
            )
        except AssertionError as err:
            said = sorted((e["work"] / "pods" / ns / evicted).rglob("*.log"))
            tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in said)
            raise AssertionError(f"{err}; runner errors {runner.errors[-5:]}\n{tails}") from None
    left = wait_for(
        "pipeline 0 left",
        lambda: (st := status())["pipelines"][0].get("leftReason") and st,
        timeout=120,
    )
    wait_for("pipeline 0's processes ended", lambda: all(p.poll() is not None for p in leaving))
    with held(runner.local_pod(ns, f"{name}-p1-s0").process.pid):
        back = wait_for(
            "pipeline 0's new pods running",
            lambda: (
                len(now := stage_pods(core, ns, name)) == 4
                and now[f"{name}-p0-s0"].metadata.uid != pods[f"{name}-p0-s0"].metadata.uid
                and all(p.status.phase == "Running" for p in now.values())
                and now
            ),
            timeout=120,
        )
    return left, back


def _stored_or_none(mc: Any, bucket: str, key: str) -> Any:
    """The JSON document at `key`, or None while there is none."""
    try:
        return stored_json(mc, bucket, key)
    except Exception:  # not written yet
        return None


def _families(url: str) -> set[str]:
    """The metric names an exposition declares (`# TYPE` lines, samples or not), as queries
    name them: counters with `_total`, histograms with `_bucket`, `_sum` and `_count`."""

    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    names = set()
    for kind_line in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        name, kind = kind_line
        names.add(name)
        if kind == "counter":
            names.add(f"{name}_total")
        elif kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def _every_stage_exports(runner: Any, ns: str, stages: list[str]) -> set[str] | None:
    """The metric names the `stages`' /metrics declare together, once each of them serves
    them with `relaytrain_step` among them (None until then)."""
    names: set[str] = set()
    for stage in stages:
        local = runner.local_pod(ns, stage)
        if local is None or local.metrics_port is None:
            return None
        try:
            found = _families(f"http://127.0.0.1:{local.metrics_port}/metrics")
        except OSError:
            return None
        if "relaytrain_step" not in found:
            return None
        names |= found
    return names


@dataclass(frozen=True)
class Wrong:
    """A job valid to the CRD but wrong in the world, and what the job must end saying."""

    name: str
    change: Callable[[Job, str], Job]
    """The tiny job, changed (with the bucket's name)."""
    reason: str
    said: str
    """A fragment of the condition's message that names the problem."""


_PUT = {  # objects the corpus needs in the bucket
    "data/empty.jsonl": b"",
    "data/odd.jsonl": b'{"prompt": "1+1=", "answer": "2"}\n',
    "data/garbled.jsonl": b'{"prompt": "1+1=", "completion": " 2"}\n{"prompt": oops\n',
    "models/mamba/config.json": json.dumps({"model_type": "mamba", "hidden_size": 64}).encode(),
    "models/huge/config.json": json.dumps({
        "model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
        "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
    }).encode(),
    "models/noshards/config.json": b"",  # filled with the tiny model's config below
}  # fmt: skip

WRONG = [
    # First, while the other jobs hold no GPU: its words count the GPUs free when it is
    # planned (a model of 126 layers of 12 GiB holds on none of them).
    Wrong("too-large", lambda j, b: j.model(f"s3://{b}/models/huge/"), "Unschedulable",
          "126 decoder layers"),
    Wrong("no-model", lambda j, b: j.model(f"s3://{b}/models/none/"), "ModelUnavailable",
          "has no config.json"),
    Wrong("no-secret", lambda j, b: j.credentials("absent"), "ModelUnavailable",
          "Secret 'absent' does not exist"),
    Wrong("no-key", lambda j, b: j.credentials("partial"), "ModelUnavailable",
          "Secret 'partial' has no key 'AWS_SECRET_ACCESS_KEY'"),
    Wrong("bad-keys", lambda j, b: j.credentials("refused"), "ModelUnavailable",
          "SignatureDoesNotMatch"),
    Wrong("no-store", lambda j, b: j.checkpoint(endpoint="http://127.0.0.1:9"),
          "ModelUnavailable", "reading config.json under s3://"),
    Wrong("no-data", lambda j, b: j.dataset(f"s3://{b}/data/none.jsonl"), "DatasetUnavailable",
          "data/none.jsonl: no such object"),
    Wrong("empty-data", lambda j, b: j.dataset(f"s3://{b}/data/empty.jsonl"),
          "DatasetUnavailable", "data/empty.jsonl: the object is empty"),
    Wrong("no-held-out", lambda j, b: j.set("spec.dataset.validation",
                                            {"uri": f"s3://{b}/data/gone.jsonl"}),
          "DatasetUnavailable", "spec.dataset.validation.uri"),
    Wrong("odd-data", lambda j, b: j.dataset(f"s3://{b}/data/odd.jsonl"), "InvalidInput",
          "field 'completion' does not exist in record 1"),
    Wrong("garbled-data", lambda j, b: j.dataset(f"s3://{b}/data/garbled.jsonl"),
          "InvalidInput", "line 2 is not JSON"),
    Wrong("no-shards", lambda j, b: j.model(f"s3://{b}/models/noshards/"), "InvalidInput",
          "model.safetensors"),
    Wrong("mamba", lambda j, b: j.model(f"s3://{b}/models/mamba/"), "InvalidSpec",
          "model_type 'mamba' is not supported"),
]  # fmt: skip


def test_jobs_wrong_in_the_world_end_saying_why_while_a_good_one_trains(
    env: dict[str, Any],
) -> None:
    """Thirteen jobs valid to the CRD but wrong in the world — a missing model, Secret or
    key, keys the store refuses, an endpoint nobody answers, a data set missing, empty,
    with a record lacking its field or not JSON, a held-out file missing, a model without
    its weights, an unsupported family, a model no fleet here holds — each end within 90 s
    with a Ready condition and one Warning Event that name the problem; no stage is
    restarted, the operator's pod is not restarted, and a good job beside them succeeds."""
    e = env
    core, custom, ns, release = e["core"], e["custom"], e["ns"], e["release"]
    bucket, mc = e["minio"].bucket, e["minio"].client()
    tiny = mc.get_object(bucket, "models/tiny/config.json")
    objects = {**_PUT, "models/noshards/config.json": tiny.read()}
    tiny.close()
    tiny.release_conn()
    for key, body in objects.items():
        mc.put_object(bucket, key, io.BytesIO(body), len(body))
    keys = {"AWS_ACCESS_KEY_ID": e["minio"].access_key}
    for name, data in (("partial", keys), ("refused", {**keys, "AWS_SECRET_ACCESS_KEY": "no"})):
        core.create_namespaced_secret(
            ns, client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data)
        )
    operator_before = release.operator_pod()
    for wrong in WRONG:
        job = wrong.change(tiny_job(wrong.name, e["minio"]).pipeline(stages=2), bucket)
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job.build())
    good_job = tiny_job("good-beside", e["minio"]).training(steps=2 * EVERY)
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, good_job.build())

    def ready(name: str) -> dict[str, Any]:
        status = _job_status(custom, ns, name)
        found = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
        return {**(found[0] if found else {}), "stages": status.get("stages") or []}

    def all_told() -> bool:
        return all(ready(w.name).get("reason") == w.reason for w in WRONG)

    try:
        wait_for("every wrong job told", all_told, timeout=90)
    except AssertionError as err:
        seen = {w.name: (ready(w.name).get("reason"), ready(w.name).get("message")) for w in WRONG}
        raise AssertionError(f"{err}: {seen}\n{diagnostics(e)}") from None

    def warnings() -> list[Any]:
        return [ev for ev in core.list_namespaced_event(ns).items if ev.type == "Warning"]

    def each_warned() -> Any:  # the Event follows the condition's write
        events = warnings()
        named = {ev.involved_object.name for ev in events}
        return all(w.name in named for w in WRONG) and events

    events = wait_for("each wrong job's Warning Event", each_warned, timeout=30)
    for wrong in WRONG:
        told = ready(wrong.name)
        assert wrong.said in told["message"], (wrong.name, told)
        assert [s.get("restarts", 0) for s in told["stages"]] in ([], [0, 0]), (wrong.name, told)
        mine = [(ev.reason, ev.message) for ev in events if ev.involved_object.name == wrong.name]
        # One Event, in the words the reason first came with (an Unschedulable job's count
        # of free GPUs moves as the others come and go; its condition follows, not Events).
        assert [r for r, _ in mine] == [wrong.reason] and wrong.said in mine[0][1], mine
    good = wait_for(
        "the good job to succeed",
        lambda: _job_status(custom, ns, "good-beside").get("phase") == "Succeeded",
        timeout=400,
    )
    assert good
    # Each message stayed put while the good job trained: still one Warning Event per job.
    later = warnings()
    for wrong in WRONG:
        assert len([ev for ev in later if ev.involved_object.name == wrong.name]) == 1, wrong
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, wrong.name)
    operator_after = release.operator_pod()
    assert operator_after.metadata.uid == operator_before.metadata.uid
    assert operator_after.status.container_statuses[0].restart_count == 0


def test_no_credential_leaves_its_secret(env: dict[str, Any], kube_cluster: Any) -> None:
    """After the jobs above ran (a kill, a replacement, two pipelines), the object store's
    keys appear nowhere but in their Secret: not in any pod the operator created (the API
    server's audit log holds every creation's body, Secrets' excepted), the jobs' status,
    the namespace's Events, the operator's and every stage process's log, or anything the
    workers wrote to the store besides weights (progress.json, manifests, adapter config).
    Last in this module on purpose."""
    e = env
    minio, ns = e["minio"], e["ns"]
    values = {minio.access_key, minio.secret_key}
    audit = [
        json.loads(line)
        for line in kube_cluster.component_log("audit").splitlines()
        if f'"namespace":"{ns}"' in line
    ]
    created_pods = [
        a for a in audit if a.get("verb") == "create" and a["objectRef"]["resource"] == "pods"
    ]
    assert created_pods and all("requestObject" in a for a in created_pods)
    # The pods do get the keys, by reference to the Secret.
    refs = {
        env["valueFrom"]["secretKeyRef"]["name"]
        for a in created_pods
        for env in a["requestObject"]["spec"]["containers"][0]["env"]
        if env["name"].startswith("AWS_")
    }
    assert refs == {"s3"}
    texts = {"audit log (requests with bodies)": "\n".join(json.dumps(a) for a in audit)}
    jobs = e["custom"].list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
    texts["jobs"] = json.dumps(jobs)
    texts["events"] = json.dumps(
        [ev.to_dict() for ev in e["core"].list_namespaced_event(ns).items], default=str
    )
    # The operator's own namespace too: its pod's Events, and its log (among the logs below).
    system = e["release"].namespace
    texts["operator namespace events"] = json.dumps(
        [ev.to_dict() for ev in e["core"].list_namespaced_event(system).items], default=str
    )
    operator_logs = [p for p in e["work"].rglob("*.log") if system in str(p)]
    assert operator_logs, f"no log of the operator's pod under {e['work']}"
    for path in sorted(e["work"].rglob("*.log")):
        texts[str(path)] = path.read_text(errors="replace")
    mc = minio.client()
    stored = 0
    for obj in mc.list_objects(minio.bucket, "", recursive=True):
        if obj.object_name.endswith(".safetensors") or obj.object_name.startswith("models/"):
            continue
        try:
            resp = mc.get_object(minio.bucket, obj.object_name)
        except S3Error as err:  # pruned since the listing (a job of a failed test trains on)
            if err.code == "NoSuchKey":
                continue
            raise
        texts[f"s3://{minio.bucket}/{obj.object_name}"] = resp.read().decode(errors="replace")
        resp.close()
        resp.release_conn()
        stored += 1
    assert stored and any(name.endswith("progress.json") for name in texts)
    leaks = [
        (where, value[:4]) for where, text in texts.items() for value in values if value in text
    ]
    assert leaks == [], f"credentials found in: {leaks}"
