"""Pods on a real node: the pinned kubelet and containerd (harness/real_kubelet.py), not kwok's
simulation. What the kwok runner imitates (harness/containers.py), a kubelet does here: it
pulls the image from the session's registry by digest, runs the operator image under the
chart's own securityContext, refuses a root image under runAsNonRoot, reports an image that
is not there, and OOM-kills a container over its memory limit. Every status read here is
the kubelet's (and containerd's) own."""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from relaytrain_testkit import REPO
from relaytrain_testkit.harness.chart_install import helm_binary
from relaytrain_testkit.harness.real_kubelet import RealNode, derive_image
from relaytrain_testkit.harness.waiting import wait_for

pytestmark = [pytest.mark.e2e]

# Run as the command of the operator image's container: who it runs as, and what the
# chart's securityContext leaves it (written to the termination-message file the kubelet
# mounts, which the pod's status then carries).
_SELF_CHECK = """
import errno, json, os
out = {"uid": os.getuid(), "gid": os.getgid()}
try:
    open("/x", "w").close()
    out["write /"] = "written"
except OSError as exc:
    out["write /"] = errno.errorcode[exc.errno]
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
out.update({k: status[k].strip() for k in ("CapEff", "CapBnd", "NoNewPrivs", "Seccomp")})
with open("/dev/termination-log", "w") as log:
    json.dump(out, log)
"""


@pytest.fixture(scope="module")
def core(real_node: RealNode) -> Any:
    return client.CoreV1Api(real_node.cluster.api_client())


@pytest.fixture(scope="module")
def namespace(core: Any) -> Iterator[str]:
    name = f"real-node-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(
        f"the default ServiceAccount of {name}",
        lambda: (
            core.list_namespaced_service_account(name, field_selector="metadata.name=default").items
        ),
    )
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


def _pod(node: RealNode, name: str, image: str, **container: Any) -> dict[str, Any]:
    pod_security = container.pop("pod_security", None)
    spec: dict[str, Any] = {
        **node.placement(),
        "hostNetwork": True,  # the real node has no pod network
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "c",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "terminationMessagePolicy": "FallbackToLogsOnError",
                **container,
            }
        ],
    }
    if pod_security is not None:
        spec["securityContext"] = pod_security
    return {"metadata": {"name": name}, "spec": spec}


def _state(core: Any, namespace: str, name: str) -> tuple[str, Any]:
    """The pod's phase and its container's state (None before the kubelet reports one)."""
    pod = core.read_namespaced_pod(name, namespace)
    statuses = pod.status.container_statuses or []
    return pod.status.phase, (statuses[0].state if statuses else None)


def _terminated(core: Any, namespace: str, name: str, timeout: float = 120) -> Any:
    def done() -> Any:
        phase, state = _state(core, namespace, name)
        if phase in ("Succeeded", "Failed") and state is not None and state.terminated:
            return phase, state.terminated
        return None

    return wait_for(f"pod {name} to finish on the real node", done, timeout=timeout)


def _waiting(core: Any, namespace: str, name: str, reason: str, timeout: float = 60) -> Any:
    def waiting() -> Any:
        _, state = _state(core, namespace, name)
        return state.waiting if state and state.waiting and state.waiting.reason == reason else None

    return wait_for(f"pod {name} waiting with {reason}", waiting, timeout=timeout)


def _chart_operator(image: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The operator Deployment as `helm template` renders the chart with `image` (a registry
    reference by digest): its pod securityContext, its container's, and its image."""
    repository, _, digest = image.partition("@")
    out = subprocess.run(
        [str(helm_binary()), "template", "rt", str(REPO / "charts" / "relaytrain"),
         "--set", f"image.repository={repository}", "--set", f"image.digest={digest}"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    deployment = next(d for d in yaml.safe_load_all(out) if d and d.get("kind") == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    return pod["securityContext"], container["securityContext"], container["image"]


def test_the_operator_image_runs_under_the_charts_security_context(
    real_node: RealNode, core: Any, namespace: str
) -> None:
    pod_sc, container_sc, image = _chart_operator(real_node.base_image)
    assert image == real_node.base_image  # pulled from the session's registry by digest
    core.create_namespaced_pod(
        namespace,
        _pod(
            real_node, "operator-self-check", image,
            command=["python", "-c", _SELF_CHECK],
            securityContext=container_sc, pod_security=pod_sc,
        ),
    )  # fmt: skip
    phase, terminated = _terminated(core, namespace, "operator-self-check")
    assert (phase, terminated.exit_code) == ("Succeeded", 0), terminated.message
    got = json.loads(terminated.message)
    # The chart's numeric user; its read-only root filesystem refuses a write; every
    # capability dropped; no privilege escalation; the runtime's default seccomp filter.
    assert got == {
        "uid": 65532,
        "gid": 65532,
        "write /": "EROFS",
        "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000",
        "NoNewPrivs": "1",
        "Seccomp": "2",
    }


def test_an_image_digest_the_registry_lacks_is_reported_by_the_runtime(
    real_node: RealNode, core: Any, namespace: str
) -> None:
    repository = real_node.base_image.partition("@")[0]
    missing = f"{repository}@sha256:{hashlib.sha256(b'never pushed').hexdigest()}"
    core.create_namespaced_pod(namespace, _pod(real_node, "no-such-image", missing))
    waiting = _waiting(core, namespace, "no-such-image", "ErrImagePull")
    # containerd's own words, passed on by the kubelet.
    assert f'failed to pull and unpack image "{missing}"' in waiting.message, waiting.message
    assert "not found" in waiting.message, waiting.message
    # Then the kubelet backs off, as it does for any pull that fails.
    backoff = _waiting(core, namespace, "no-such-image", "ImagePullBackOff")
    assert missing in backoff.message, backoff.message


def test_a_root_image_is_refused_under_run_as_non_root(
    real_node: RealNode, core: Any, namespace: str
) -> None:
    as_root = derive_image(real_node.base_image, "as-root", user="")  # no USER: root
    core.create_namespaced_pod(
        namespace,
        _pod(real_node, "root-refused", as_root, pod_security={"runAsNonRoot": True}),
    )
    waiting = _waiting(core, namespace, "root-refused", "CreateContainerConfigError", 120)
    assert waiting.message.startswith("container has runAsNonRoot and image will run as root"), (
        waiting.message
    )
    assert _state(core, namespace, "root-refused")[0] == "Pending"


def test_a_container_over_its_memory_limit_is_oom_killed(
    real_node: RealNode, core: Any, namespace: str
) -> None:
    core.create_namespaced_pod(
        namespace,
        _pod(
            real_node, "over-limit", real_node.base_image,
            # Python is PID 1 and touches 256 MiB under a 64 MiB limit.
            command=["python", "-c", "data = b'x' * (256 << 20)"],
            resources={"limits": {"memory": "64Mi"}, "requests": {"memory": "64Mi"}},
        ),
    )  # fmt: skip
    phase, terminated = _terminated(core, namespace, "over-limit")
    assert (phase, terminated.reason, terminated.exit_code) == ("Failed", "OOMKilled", 137)
