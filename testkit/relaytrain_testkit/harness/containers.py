"""Real containers for the kwok process runner: a pod whose image is one of ours (built by
`make images`, hack/images.sh) runs in a container that podman starts with runc from that
image, as a kubelet's container runtime would, instead of as a local process.

What the pod says is applied the way a kubelet applies it:

- the image's own entrypoint, or the container's `command`/`args`;
- the container's environment (resolved by the runner), and nothing of this machine's;
- `securityContext` (the container's over the pod's): `runAsUser`/`runAsGroup` as the
  numeric user, `runAsNonRoot` refused for an image whose user is root (the kubelet's
  CreateContainerConfigError), `readOnlyRootFilesystem`, `capabilities.drop`,
  `allowPrivilegeEscalation: false` as no-new-privileges;
- each `emptyDir` volume as a folder of the pod's, owned by `fsGroup`, at its mount path;
  projected volumes (the ServiceAccount token) as the runner writes them, read-only;
- the termination-message file bind-mounted at `terminationMessagePath`;
- a memory limit as the container's own.

The container shares this machine's network namespace (`--network host`): there is no pod
network or cluster DNS here, and the runner's loopback ports stand in for the stable pod
addresses (kwok_runner.py) for containers as for processes. That, and CPU limits (left out
on 2 cores shared by several stages), are the differences from a real node
(docs/development.md says which tests use which).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.toolpaths import cache_dir
from relaytrain_testkit.harness.mount_ns import Mount

REPO = Path(__file__).resolve().parents[3]
IMAGES_SH = REPO / "hack" / "images.sh"


def podman_env() -> dict[str, str]:
    return {**os.environ, "RELAYTRAIN_CACHE": str(cache_dir())}


def images_sh(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`hack/images.sh ARGS...` on the project's container storage, its output captured."""
    return subprocess.run(
        ["bash", str(IMAGES_SH), *args],
        env={**podman_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    """Runs podman on the project's container storage (hack/images.sh) and returns stdout."""
    proc = images_sh("podman", *args, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
    return proc.stdout


def image_ref(name: str) -> str:
    """The local reference of image `name` ("operator", "worker") as `make images` tags it."""
    out = images_sh("ref", name)
    out.check_returncode()
    return out.stdout.strip()


def require_image(name: str) -> str:
    """The reference of image `name`; fails, saying what to run, unless `make images` built
    it from this tree (an image of other code would test that code)."""
    proc = images_sh("fresh", name)
    if proc.returncode != 0:
        raise AssertionError(proc.stderr.strip())
    return image_ref(name)


def container_name(pod: Any) -> str:
    """The container of a pod, named as dockershim named them."""
    meta = pod.metadata
    name = pod.spec.containers[0].name
    return f"k8s_{name}_{meta.name}_{meta.namespace}_{str(meta.uid)[:8]}"


class ContainerConfigError(Exception):
    """The container cannot start as its pod says: the kubelet's CreateContainerConfigError."""

    reason = "CreateContainerConfigError"


class ImagePullError(ContainerConfigError):
    """The image cannot be pulled from its registry: the kubelet's ErrImagePull."""

    reason = "ErrImagePull"


def in_registry(image: str, registries: frozenset[str]) -> bool:
    """Whether `image` names one of `registries` (host:port)."""
    return "/" in image and image.split("/", 1)[0] in registries


def pull(image: str) -> None:
    """Pulls `image` from its registry (plain HTTP on loopback, as the test registry
    serves) unless the storage has it, as a kubelet with `IfNotPresent` does; by digest
    when the reference has one."""
    if images_sh("podman", "image", "exists", image, timeout=60).returncode == 0:
        return
    proc = images_sh("podman", "pull", "--quiet", "--tls-verify=false", image, timeout=600)
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ImagePullError(f'failed to pull image "{image}": {said[0]}')


@dataclass(frozen=True)
class Launch:
    """How to start one container: podman's argv and the environment podman itself gets
    (`--env NAME` passes a variable from it, so values never reach a command line)."""

    argv: list[str]
    env: dict[str, str]
    name: str


def launch(
    pod: Any, env: dict[str, str], pod_dir: Path, projected: list[Mount], log_file: Path | None
) -> Launch:
    """The `podman run` of the pod's (first) container; `pod_dir` holds its volumes."""
    container = pod.spec.containers[0]
    pod_sc = pod.spec.security_context
    sc = container.security_context
    name = container_name(pod)
    argv = [
        "bash", str(IMAGES_SH), "podman", "run", "--rm", "--name", name,
        "--pull", "never", "--network", "host", "--init=false",
    ]  # fmt: skip
    user = _first(sc, pod_sc, "run_as_user")
    group = _first(sc, pod_sc, "run_as_group")
    non_root = _first(sc, pod_sc, "run_as_non_root")
    if user is not None:
        argv += ["--user", f"{user}:{group if group is not None else user}"]
    elif non_root:
        image_user = podman("image", "inspect", "--format", "{{.Config.User}}", container.image)
        if image_user.strip().split(":")[0] in ("", "0", "root"):
            raise ContainerConfigError(
                "container has runAsNonRoot and image will run as root "
                f"(pod: {pod.metadata.name}, container: {container.name})"
            )
    if non_root and user == 0:
        raise ContainerConfigError("container's runAsUser breaks non-root policy")
    if sc is not None:
        if sc.read_only_root_filesystem:
            argv.append("--read-only")
        if sc.allow_privilege_escalation is False:
            argv += ["--security-opt", "no-new-privileges"]
        if sc.capabilities is not None:
            for cap in sc.capabilities.drop or []:
                argv += ["--cap-drop", cap]
            for cap in sc.capabilities.add or []:
                argv += ["--cap-add", cap]
    fs_group = getattr(pod_sc, "fs_group", None) if pod_sc is not None else None
    volumes = {v.name: v for v in pod.spec.volumes or []}
    for mount in container.volume_mounts or []:
        volume = volumes.get(mount.name)
        if volume is not None and volume.empty_dir is not None:
            folder = pod_dir / "volumes" / mount.name
            folder.mkdir(parents=True, exist_ok=True)
            # fsGroup owns the volume and may write it, as the kubelet sets it up.
            os.chown(folder, 0, int(fs_group) if fs_group is not None else 0)
            folder.chmod(0o2777 if fs_group is None else 0o2775)
            argv += ["--volume", f"{folder}:{mount.mount_path}:rw"]
    for m in projected:
        argv += ["--volume", f"{m.source}:{m.target}:{'ro' if m.read_only else 'rw'}"]
    if log_file is not None and container.termination_message_path:
        log_file.write_bytes(b"")
        log_file.chmod(0o666)
        argv += ["--volume", f"{log_file}:{container.termination_message_path}:rw"]
    limits = (container.resources.limits or {}) if container.resources else {}
    if "memory" in limits:
        argv += ["--memory", _bytes(limits["memory"])]
    # podman's own environment must stay this machine's: those variables go on the command
    # line (none is a secret); every other one is passed by name from podman's environment.
    own = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "RELAYTRAIN_CACHE": str(cache_dir()),
    }
    for key in sorted(env):
        argv += ["--env", f"{key}={env[key]}" if key in own else key]
    if container.command:
        argv += ["--entrypoint", _json_list(container.command)]
    argv.append(container.image)
    argv += list(container.args or [])
    return Launch(argv, {**env, **own}, name)


def pid(name: str) -> int | None:
    """The host pid of the container's main process (None while it is not running)."""
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        out = podman("inspect", "--format", "{{.State.Pid}}", name, timeout=30).strip()
        return int(out) if out and out != "0" else None
    return None


def remove(name: str) -> None:
    """Stops and removes the container (what is left when its podman client was killed)."""
    podman("rm", "--force", "--time", "0", name, check=False, timeout=60)


def exec_in(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Runs `argv` in the running container, as `kubectl exec` would."""
    return images_sh("podman", "exec", name, *argv)


def _first(sc: Any, pod_sc: Any, attr: str) -> Any:
    for ctx in (sc, pod_sc):
        value = getattr(ctx, attr, None) if ctx is not None else None
        if value is not None:
            return value
    return None


def _bytes(quantity: str) -> str:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6,
             "G": 10**9}  # fmt: skip
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return str(int(float(quantity[: -len(suffix)]) * factor))
    return str(int(float(quantity)))


def _json_list(items: list[str]) -> str:
    import json

    return json.dumps(list(items))
