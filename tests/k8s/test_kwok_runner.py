"""The e2e harness that plays kubelet for kwok pods: runs, reports and kills real processes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from relaytrain_testkit.harness.containers import image_ref, require_image
from relaytrain_testkit.harness.kwok_runner import KwokProcessRunner
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture
def ns(kube_cluster: Any) -> Iterator[tuple[client.CoreV1Api, str]]:
    core = client.CoreV1Api(kube_cluster.api_client())
    name = f"runner-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield core, name
    core.delete_namespace(name)


@pytest.fixture
def runner(kube_cluster: Any, ns: Any, tmp_path: Path) -> Iterator[KwokProcessRunner]:
    """A runner for the test's namespace, stopped after it; nothing may have gone wrong in
    its passes."""
    running = KwokProcessRunner(
        kube_cluster.api_client(), tmp_path, ns[1], images=frozenset({image_ref("operator")})
    )
    running.start()
    yield running
    running.stop()
    assert not running.errors


def pod(name: str, code: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"relaytrain.io/job": "runner"}},
        "spec": {
            "hostname": name,
            "subdomain": "runner",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "restartPolicy": "Never",
            "containers": [
                {"name": "worker", "image": "x", "args": ["python", "-c", code], "env": env}
            ],
        },
    }


def test_runs_pod_as_process_and_posts_its_exit(
    ns: Any, runner: KwokProcessRunner, tmp_path: Path
) -> None:
    core, namespace = ns
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "s"}, "stringData": {"token": "sekrit"}}
    )
    code = "import os,sys; print('token', os.environ['TOKEN'], os.environ['ME']); sys.exit(3)"
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    core.create_namespaced_pod(namespace, pod("exits", code, env))

    def failed() -> Any:
        p = core.read_namespaced_pod("exits", namespace)
        return p if p.status.phase == "Failed" else None

    p = wait_for("the pod to be reported Failed", failed)
    assert p.status.container_statuses[0].state.terminated.exit_code == 3
    logs = list(tmp_path.glob(f"{namespace}/exits/*/container.log"))
    assert logs and "token sekrit exits" in logs[0].read_text()


def test_the_termination_message_is_what_the_process_wrote_or_the_end_of_its_log(
    ns: Any, runner: KwokProcessRunner, tmp_path: Path
) -> None:
    core, namespace = ns
    wrote = (
        "import os,sys; open(os.environ['RELAYTRAIN_TERMINATION_LOG'], 'w').write('my words');"
        " print('noise'); sys.exit(3)"
    )
    crashed = "import sys; print('line 1'); print('the end'); sys.exit(1)"
    cases = [("wrote", wrote, "File"), ("crashed", crashed, "FallbackToLogsOnError"),
             ("quiet", crashed, "File")]  # fmt: skip
    for name, code, policy in cases:
        manifest = pod(name, code, [])
        manifest["spec"]["containers"][0]["terminationMessagePolicy"] = policy
        core.create_namespaced_pod(namespace, manifest)

    def ended(name: str) -> Any:
        p = core.read_namespaced_pod(name, namespace)
        return p.status.phase == "Failed" and p.status.container_statuses[0].state.terminated

    assert wait_for("wrote ended", lambda: ended("wrote")).message == "my words"
    assert wait_for("crashed ended", lambda: ended("crashed")).message == "line 1\nthe end"
    assert wait_for("quiet ended", lambda: ended("quiet")).message is None


def _waiting(core: Any, namespace: str, name: str) -> Any:
    """The pod's first container's waiting state while the pod is Pending, else None."""
    p = core.read_namespaced_pod(name, namespace)
    statuses = p.status.container_statuses or []
    return p.status.phase == "Pending" and statuses and statuses[0].state.waiting


def _warnings(core: Any, namespace: str, name: str) -> list[tuple[str, str]]:
    """(reason, message) of each Warning Event about the pod."""
    events = core.list_namespaced_event(namespace).items
    return [
        (e.reason, e.message)
        for e in events
        if e.involved_object.name == name and e.type == "Warning"
    ]


def test_a_missing_secret_holds_the_container_as_a_kubelet_does_until_it_exists(
    ns: Any, runner: KwokProcessRunner, tmp_path: Path
) -> None:
    core, namespace = ns
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "token"}}}]
    core.create_namespaced_pod(namespace, pod("held", "import time; time.sleep(600)", env))
    core.create_namespaced_pod(namespace, pod("free", "import time; time.sleep(600)", []))

    held = wait_for("the container held", lambda: _waiting(core, namespace, "held"))
    assert (held.reason, held.message) == (
        "CreateContainerConfigError",
        'secret "late" not found',
    )
    # The runner's pass goes on for the other pods.
    wait_for("the other pod's process", lambda: runner.local_pod(namespace, "free"))

    # The Event is posted beside the status, not before it: wait for it, then say what came.
    wait_for("the held container's Warning", lambda: _warnings(core, namespace, "held"))
    assert _warnings(core, namespace, "held") == [("Failed", 'Error: secret "late" not found')]
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "late"}, "stringData": {"token": "t"}}
    )

    def running() -> Any:
        p = core.read_namespaced_pod("held", namespace)
        return p.status.phase == "Running" and runner.local_pod(namespace, "held")

    wait_for("the container started once the Secret exists", running)


_READS_LINK = """
import os, time
d = "/var/run/relaytrain/link"
def read(name):
    with open(os.path.join(d, name)) as f:
        return f.read()
first = read("tls.crt")
names = sorted(n for n in os.listdir(d) if not n.startswith(".."))
mode = oct(os.stat(os.path.join(d, "tls.key")).st_mode & 0o777)
print("first", first, names, mode, os.readlink(os.path.join(d, "..data"))[:4], flush=True)
while read("tls.crt") == first:
    time.sleep(0.1)
print("then", read("tls.crt"), read("tls.key"), flush=True)
"""


def test_a_secret_volume_is_mounted_when_its_secret_exists_and_follows_its_updates(
    ns: Any, runner: KwokProcessRunner, tmp_path: Path
) -> None:
    """A stage pod's link credentials as the operator mounts them: held (FailedMount) while
    the Secret is missing, then the files inside the running container, then a renewal
    read by the same process."""
    core, namespace = ns
    manifest = pod("linked", _READS_LINK, [])
    manifest["spec"]["volumes"] = [
        {
            "name": "link",
            "secret": {
                "secretName": "job-link",
                "defaultMode": 0o440,
                "items": [
                    {"key": "ca.crt", "path": "ca.crt"},
                    {"key": "p0-s1.crt", "path": "tls.crt"},
                    {"key": "p0-s1.key", "path": "tls.key"},
                ],
            },
        }
    ]
    manifest["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "link", "mountPath": "/var/run/relaytrain/link", "readOnly": True}
    ]
    core.create_namespaced_pod(namespace, manifest)

    held = wait_for("the container held", lambda: _waiting(core, namespace, "linked"))
    said = 'MountVolume.SetUp failed for volume "link" : secret "job-link" not found'
    assert (held.reason, held.message) == ("ContainerCreating", said)

    # The Event is posted beside the status, not before it: wait for it, then say what came.
    wait_for("the held container's Warning", lambda: _warnings(core, namespace, "linked"))
    assert _warnings(core, namespace, "linked") == [("FailedMount", said)]
    data = {"ca.crt": "CA", "p0-s1.crt": "CRT1", "p0-s1.key": "KEY1", "p1-s0.key": "NOT MINE"}
    core.create_namespaced_secret(namespace, {"metadata": {"name": "job-link"}, "stringData": data})
    local = wait_for("the process to start", lambda: runner.local_pod(namespace, "linked"))

    def log_says(word: str) -> Any:
        text = local.log_path.read_text()
        return next((line for line in text.splitlines() if line.startswith(word)), None)

    first = wait_for("the process to read its volume", lambda: log_says("first "))
    assert first == "first CRT1 ['ca.crt', 'tls.crt', 'tls.key'] 0o440 ..20"
    core.patch_namespaced_secret(
        "job-link", namespace, {"stringData": {"p0-s1.crt": "CRT2", "p0-s1.key": "KEY2"}}
    )
    assert wait_for("the renewal to reach the process", lambda: log_says("then ")) == (
        "then CRT2 KEY2"
    )

    def succeeded() -> Any:
        return core.read_namespaced_pod("linked", namespace).status.phase == "Succeeded"

    wait_for("the pod to be reported Succeeded", succeeded)


def test_deleting_the_pod_kills_its_process(
    ns: Any, runner: KwokProcessRunner, tmp_path: Path
) -> None:
    core, namespace = ns
    core.create_namespaced_pod(namespace, pod("sleeper", "import time; time.sleep(600)", []))
    local = wait_for("the process to start", lambda: runner.local_pod(namespace, "sleeper"))
    assert local.process.poll() is None
    core.delete_namespaced_pod("sleeper", namespace, grace_period_seconds=0)
    wait_for("the process to end", lambda: local.process.poll() is not None)


# A SIGTERM says so on stdout; the slow one then holds on (until the runner's second), the
# quick one exits.
_TERMED = """
import signal, sys, time
def term(*_):
    print("term", flush=True)
    if QUICK or getattr(term, "seen", False):
        sys.exit(0)
    term.seen = True
signal.signal(signal.SIGTERM, term)
print("up", flush=True)
while True:
    time.sleep(0.2)
"""


def test_a_pod_using_its_grace_period_holds_up_no_other_pods_deletion(
    ns: Any, runner: KwokProcessRunner
) -> None:
    """As a kubelet's pod workers: a deleted pod whose process takes its grace period to
    stop (a stage asked to leave, waiting for its stage 0 to lead it out) does not hold
    back the SIGTERM of a pod deleted after it (that stage 0), even once kwok has removed
    the first pod's object."""
    core, namespace = ns
    started = {}
    for name, quick in (("slow", False), ("quick", True)):
        manifest = pod(name, f"QUICK = {quick}\n{_TERMED}", [])
        manifest["spec"]["terminationGracePeriodSeconds"] = 120
        core.create_namespaced_pod(namespace, manifest)
        started[name] = wait_for(
            f"{name} to start",
            lambda n=name: (p := runner.local_pod(namespace, n)) and "up" in _said(p) and p,
        )
    slow, quick = started["slow"], started["quick"]
    core.delete_namespaced_pod("slow", namespace)
    wait_for(lambda: f"slow's SIGTERM ({runner.describe(slow)})", lambda: "term" in _said(slow))
    core.delete_namespaced_pod("quick", namespace)
    wait_for(
        lambda: f"quick's SIGTERM to end it ({runner.describe(quick)})",
        lambda: quick.process.poll() is not None,
    )
    assert "term" in _said(quick)
    assert slow.process.poll() is None, "the slow pod lost its grace period"


def test_a_pod_gone_with_its_node_is_killed_at_once(ns: Any, runner: KwokProcessRunner) -> None:
    """A node deleted without notice takes its pods' processes with it: the runner SIGKILLs
    the process of a pod gone with its node (the operator force-deletes it, as the pod GC
    would) with no SIGTERM and no grace, where a pod deleted on a live node gets both."""
    from relaytrain_testkit.chaos import delete_nodes, node_ready
    from relaytrain_testkit.harness import kwok_nodes
    from relaytrain_testkit.harness.kwok_nodes import slow_pool

    core, namespace = ns
    _, nodes = slow_pool(f"gone{namespace[-6:]}", 1)
    node = nodes[0]["metadata"]["name"]
    kwok_nodes.create_nodes(core.api_client, nodes)
    try:
        wait_for(f"{node} Ready", lambda: node_ready(core, node))
        manifest = pod("doomed", f"QUICK = True\n{_TERMED}", [])
        manifest["spec"].pop("nodeSelector")
        manifest["spec"]["nodeName"] = node
        manifest["spec"]["terminationGracePeriodSeconds"] = 120
        core.create_namespaced_pod(namespace, manifest)
        local = wait_for(
            "it to start",
            lambda: (p := runner.local_pod(namespace, "doomed")) and "up" in _said(p) and p,
        )
    finally:
        delete_nodes(core, [node])
    core.delete_namespaced_pod("doomed", namespace, grace_period_seconds=0)
    wait_for("its process to end", lambda: local.process.poll() is not None)
    assert local.process.returncode == -9, local.process.returncode
    assert "term" not in _said(local), _said(local)


def test_a_pod_waits_to_start_while_its_predecessor_of_the_same_name_runs(
    ns: Any, runner: KwokProcessRunner
) -> None:
    """This runner's addresses and ports are a pod name's (its Service's DNS name), where a
    kubelet's pod gets an IP of its own: a pod made again under the name of one whose
    process is still stopping within its grace does not start until that process is gone
    (else it would find its ports taken)."""
    core, namespace = ns
    manifest = pod("twin", f"QUICK = False\n{_TERMED}", [])
    manifest["spec"]["terminationGracePeriodSeconds"] = 3
    core.create_namespaced_pod(namespace, manifest)
    old = wait_for(
        "the first to start",
        lambda: (p := runner.local_pod(namespace, "twin")) and "up" in _said(p) and p,
    )
    core.delete_namespaced_pod("twin", namespace)
    wait_for("its SIGTERM", lambda: "term" in _said(old))
    wait_for(
        "its object gone",
        lambda: "twin" not in {p.metadata.name for p in core.list_namespaced_pod(namespace).items},
    )
    assert old.process.poll() is None, "it lost its grace period"
    core.create_namespaced_pod(namespace, pod("twin", f"QUICK = True\n{_TERMED}", []))
    new = wait_for(
        "the second to start",
        lambda: (p := runner.local_pod(namespace, "twin")) and p is not old and p,
        timeout=60,
    )
    assert old.process.poll() is not None, "both ran at once"
    wait_for("the second to run", lambda: "up" in _said(new))


def _said(local: Any) -> str:
    return str(local.log_path.read_text())


_INSIDE = """
import errno, json, os
out = {"uid": os.getuid(), "gid": os.getgid(), "home": os.environ.get("HOME")}
for path in ("/x", "/tmp/x"):
    try:
        open(path, "w").close()
        out[path] = "written"
    except OSError as exc:
        out[path] = errno.errorcode[exc.errno]
open("/dev/termination-log", "w").write(json.dumps(out))
raise SystemExit(3)
"""


def test_a_pod_of_our_image_runs_in_a_container_as_its_pod_says(
    ns: Any, runner: KwokProcessRunner
) -> None:
    """The pod's own numeric user (not the image's), a read-only root with its emptyDir
    writable, its environment and its termination-message file, from a real container."""
    core, namespace = ns
    manifest = pod("contained", _INSIDE, [{"name": "HOME", "value": "/tmp"}])
    manifest["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 4242,
                                           "runAsGroup": 4242, "fsGroup": 4242}  # fmt: skip
    manifest["spec"]["volumes"] = [{"name": "tmp", "emptyDir": {}}]
    container = manifest["spec"]["containers"][0]
    container.update(
        image=require_image("operator"),
        command=["python", "-c"],
        args=[_INSIDE],
        terminationMessagePath="/dev/termination-log",
        securityContext={
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}],
    )
    core.create_namespaced_pod(namespace, manifest)

    def ended() -> Any:
        p = core.read_namespaced_pod("contained", namespace)
        return p.status.phase == "Failed" and p.status.container_statuses[0].state.terminated

    done = wait_for("the container to end", ended, timeout=120)
    assert done.exit_code == 3
    assert json.loads(done.message) == {
        "uid": 4242, "gid": 4242, "home": "/tmp", "/x": "EROFS", "/tmp/x": "written",
    }  # fmt: skip
    # It ran in a container, not as a local process.
    (ran,) = [lp for lp in runner.history if lp.name == "contained"]
    assert ran.container is not None and ran.container.startswith("k8s_worker_contained_")
