"""What a kubelet mounts into a container, for the kwok process runner: projected volumes
(the ServiceAccount token, the cluster CA, the namespace) written to a folder, and a
private mount namespace that shows that folder at the container's `mountPath`.

The API server's ServiceAccount admission adds a `kube-api-access-*` projected volume at
/var/run/secrets/kubernetes.io/serviceaccount to every pod that does not opt out
(`automountServiceAccountToken: false`). A kubelet fills it with a token it asks the
TokenRequest API for (bound to the pod, so it stops working when the pod is deleted), the
`ca.crt` of the namespace's `kube-root-ca.crt` ConfigMap and the namespace from the
downward API. The kubernetes client's in-cluster loader (and kopf, which uses it) reads
exactly that path, which a test cannot write. So the container's process starts in a
mount namespace of its own (`unshare --user --map-root-user --mount`, no privileges
needed) where a fresh tmpfs covers /run, as a container image has its own, and the
pod's volume folder is bind-mounted read-only at the mount path. Nothing in the operator
knows it is not in a pod.

Other volume kinds are not mounted: an emptyDir is the pod's own TMPDIR and HOME (what the
runner already gives every pod).
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

# Where a container's own /run starts (a tmpfs in the mount namespace); /var/run links to it.
_RUN_ROOTS = (PurePosixPath("/run"), PurePosixPath("/var/run"))
DEFAULT_TOKEN_SECONDS = 3607  # what the ServiceAccount admission asks for


@dataclass(frozen=True)
class Mount:
    """A folder on this machine shown at `target` inside the container."""

    source: Path
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class IssuedToken:
    """A projected ServiceAccount token the kubelet wrote, and its lifetime in seconds."""

    path: Path
    seconds: int


def project_volumes(
    core: Any, pod: Any, container: Any, root: Path
) -> tuple[list[Mount], list[IssuedToken]]:
    """Writes the container's projected volumes under `root` and returns where each is
    mounted, and the tokens issued (the TokenRequest API, bound to the pod). Called again,
    it refreshes them in place, as a kubelet does before a token expires."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    mounts: list[Mount] = []
    tokens: list[IssuedToken] = []
    for mount in container.volume_mounts or []:
        volume = volumes.get(mount.name)
        if volume is None or volume.projected is None:
            continue
        # Rewritten in place when called again (a token refresh): the bind mount shows the
        # folder, so the folder must stay the same one.
        folder = root / "volumes" / mount.name
        folder.mkdir(parents=True, exist_ok=True)
        for source in volume.projected.sources or []:
            tokens += _write_source(core, pod, source, folder)
        mounts.append(Mount(folder, mount.mount_path, read_only=bool(mount.read_only)))
    return mounts, tokens


def _write_source(core: Any, pod: Any, source: Any, folder: Path) -> list[IssuedToken]:
    meta = pod.metadata
    if source.service_account_token is not None:
        sat = source.service_account_token
        seconds = int(sat.expiration_seconds or DEFAULT_TOKEN_SECONDS)
        spec: dict[str, Any] = {
            "expirationSeconds": seconds,
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta.name,
                "uid": meta.uid,
            },
        }
        if sat.audience:
            spec["audiences"] = [sat.audience]
        review = core.create_namespaced_service_account_token(
            pod.spec.service_account_name or "default", meta.namespace, {"spec": spec}
        )
        path = folder / sat.path
        _write(path, review.status.token)
        return [IssuedToken(path, seconds)]
    if source.config_map is not None:
        cm = core.read_namespaced_config_map(source.config_map.name, meta.namespace)
        items = source.config_map.items or [_Item(k, k) for k in cm.data or {}]
        for item in items:
            _write(folder / item.path, (cm.data or {})[item.key])
    elif source.secret is not None:
        raise NotImplementedError("projected secret sources are not mounted by this runner")
    elif source.downward_api is not None:
        for item in source.downward_api.items or []:
            _write(folder / item.path, pod_field(pod, item.field_ref.field_path))
    return []


@dataclass(frozen=True)
class _Item:
    key: str
    path: str


def pod_field(pod: Any, path: str) -> str:
    """A downward-API field of a pod (the ones the runner's pods use)."""
    values = {
        "metadata.name": pod.metadata.name,
        "metadata.namespace": pod.metadata.namespace,
        "metadata.uid": pod.metadata.uid,
        "spec.nodeName": pod.spec.node_name or "",
        "spec.serviceAccountName": pod.spec.service_account_name or "",
        "status.podIP": "127.0.0.1",
    }
    return str(values.get(path, ""))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)  # atomic, as the kubelet swaps its ..data link


def in_mount_namespace(argv: list[str], mounts: list[Mount]) -> list[str]:
    """`argv` started in a mount namespace of its own where each mount is in place.

    A target under /run (or /var/run) gets a fresh tmpfs at /run first (a container's /run
    is its own); any other target must already exist here (nothing is created on this
    machine's filesystem). The process is the same pid as the `unshare` started (it execs),
    so signals and the exit status are the container's.
    """
    if not mounts:
        return argv
    if shutil.which("unshare") is None:
        raise RuntimeError("the fake kubelet needs util-linux's `unshare` to mount volumes")
    script = ["set -e"]
    if any(_under_run(m.target) for m in mounts):
        script.append("mount -t tmpfs -o mode=0755 tmpfs /run")
    for m in mounts:
        if not _under_run(m.target) and not Path(m.target).is_dir():
            raise RuntimeError(f"cannot mount a volume at {m.target}: it does not exist here")
        target = shlex.quote(m.target)
        script.append(f"mkdir -p {target}")
        script.append(f"mount --bind {shlex.quote(str(m.source))} {target}")
        if m.read_only:
            script.append(f"mount -o remount,bind,ro {target}")
    script.append('exec "$@"')
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "\n".join(script),
        "sh",
        *argv,
    ]


def _under_run(target: str) -> bool:
    path = PurePosixPath(target)
    return any(path == root or root in path.parents for root in _RUN_ROOTS)
