"""What a kubelet mounts into a container, for the kwok process runner: projected volumes
(the ServiceAccount token, the cluster CA, the namespace), Secret and ConfigMap volumes
written to a folder each, and a private mount namespace that shows that folder at the container's
`mountPath`.

The API server's ServiceAccount admission adds a `kube-api-access-*` projected volume at
/var/run/secrets/kubernetes.io/serviceaccount to every pod that does not opt out
(`automountServiceAccountToken: false`). A kubelet fills it with a token it asks the
TokenRequest API for (bound to the pod, so it stops working when the pod is deleted), the
`ca.crt` of the namespace's `kube-root-ca.crt` ConfigMap and the namespace from the
downward API. The kubernetes client's in-cluster loader (and kopf, which uses it) reads
exactly that path, which a test cannot write. So the container's process starts in a
mount namespace of its own (and a user namespace: no privileges needed) where a fresh tmpfs
covers /run, as a container image has its own, and the pod's volume folder is bind-mounted
read-only at the mount path (mount_ns.py). Nothing in the operator knows it is not in a
pod.

A `secret` volume is written as a kubelet's atomic writer writes it: the volume's folder
holds `..data`, a link to a timestamped hidden folder (`..2026_11_26_21_40_00.abcd1234`)
with the files, and each name the container sees links through it (`tls.crt ->
..data/tls.crt`); `items`, their `mode`, `defaultMode` (0644), `optional` and the pod's
`fsGroup` (which then owns the files and may read them) count as a kubelet counts them.
When the Secret changes while the pod runs (`refresh_secret_volumes`, which the runner
calls about once a second; a kubelet takes up to a minute), the new files go to a new
timestamped folder and one rename swaps `..data` to it, so a reader sees the old set or the
new one, never a mix; unchanged data is not written again. The folder is bind-mounted as a
folder, so the swap shows inside the mount namespace (and inside a podman container) at
once. A Secret that is missing (or lacks a key that `items` names) leaves the container
waiting, as a kubelet's `FailedMount` does (`MountError`).

A `configMap` volume is written and refreshed the same way (its `data` is text).

Other volume kinds are not mounted: an emptyDir is the pod's own TMPDIR and HOME (what the
runner already gives every pod).
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes.client.exceptions import ApiException

from relaytrain_testkit.harness.mount_ns import Mount

DEFAULT_TOKEN_SECONDS = 3607  # what the ServiceAccount admission asks for
DEFAULT_SECRET_MODE = 0o644  # a secret volume's defaultMode when the pod gives none
DATA_LINK = "..data"  # the atomic writer's link to the current timestamped folder


class MountError(Exception):
    """A volume cannot be set up: a kubelet leaves the container Waiting (reason
    ContainerCreating) and posts a `FailedMount` Warning Event with this message, trying
    again until it can."""

    reason = "ContainerCreating"
    event_reason = "FailedMount"


@dataclass(frozen=True)
class FileProjection:
    """One file of an atomically written volume: its bytes and its mode."""

    data: bytes
    mode: int


@dataclass(frozen=True)
class IssuedToken:
    """A projected ServiceAccount token the kubelet wrote, and its lifetime in seconds."""

    path: Path
    seconds: int


def project_volumes(
    core: Any, pod: Any, container: Any, root: Path
) -> tuple[list[Mount], list[IssuedToken]]:
    """Writes the container's projected and Secret volumes under `root` and returns where
    each is mounted, and the tokens issued (the TokenRequest API, bound to the pod). Called
    again, it refreshes them in place, as a kubelet does before a token expires. MountError
    when a Secret volume cannot be set up."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    mounts: list[Mount] = []
    tokens: list[IssuedToken] = []
    for mount in container.volume_mounts or []:
        volume = volumes.get(mount.name)
        if volume is not None and (volume.secret is not None or volume.config_map is not None):
            if mount.sub_path:
                raise NotImplementedError("subPath mounts are not mounted by this runner")
            folder = root / "volumes" / mount.name
            write_atomically(folder, volume_payload(core, pod, volume), _fs_group(pod))
            # A secret volume is read-only whatever the mount says, as a kubelet mounts it.
            mounts.append(Mount(folder, mount.mount_path, read_only=True))
            continue
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


def refresh_secret_volumes(core: Any, pod: Any, container: Any, root: Path) -> list[str]:
    """Brings the container's Secret (and ConfigMap) volumes under `root` up to date, as
    a kubelet's periodic sync does, and returns the names of those it rewrote (only those
    whose files would change). MountError when a Secret is gone or lacks a key: the files
    already there stay, as a kubelet leaves them."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    changed: list[str] = []
    for mount in container.volume_mounts or []:
        volume = volumes.get(mount.name)
        if volume is None or (volume.secret is None and volume.config_map is None):
            continue
        payload = volume_payload(core, pod, volume)
        if write_atomically(root / "volumes" / mount.name, payload, _fs_group(pod)):
            changed.append(mount.name)
    return changed


def volume_payload(core: Any, pod: Any, volume: Any) -> dict[str, FileProjection]:
    """The files of a `secret` or `configMap` volume (`secret_payload`, `config_map_payload`)."""
    if volume.secret is not None:
        return secret_payload(core, pod, volume)
    return config_map_payload(core, pod, volume)


def config_map_payload(core: Any, pod: Any, volume: Any) -> dict[str, FileProjection]:
    """The files a `configMap` volume shows, as `secret_payload` makes a Secret's (a
    ConfigMap's `data` is text, not base64)."""
    source = volume.config_map
    try:
        cm = core.read_namespaced_config_map(source.name, pod.metadata.namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        if source.optional:
            return {}
        raise MountError(f'{_failed(volume)}configmap "{source.name}" not found') from None
    data = {key: text.encode() for key, text in (cm.data or {}).items()}
    return _projected(volume, source, data, "configmap references non-existent config key")


def secret_payload(core: Any, pod: Any, volume: Any) -> dict[str, FileProjection]:
    """The files a `secret` volume shows (path -> bytes and mode), as a kubelet makes them:
    every key, or the `items` named (each with its own `mode` or the `defaultMode`); an
    `optional` volume whose Secret or key is missing leaves it out. MountError, in the
    kubelet's words, otherwise."""
    source = volume.secret
    ns = pod.metadata.namespace
    try:
        encoded: Mapping[str, str] = core.read_namespaced_secret(source.secret_name, ns).data or {}
    except ApiException as exc:
        if exc.status != 404:
            raise
        if source.optional:
            return {}
        raise MountError(f'{_failed(volume)}secret "{source.secret_name}" not found') from None
    data = {key: base64.b64decode(value) for key, value in encoded.items()}
    return _projected(volume, source, data, "references non-existent secret key")


def _failed(volume: Any) -> str:
    return f'MountVolume.SetUp failed for volume "{volume.name}" : '


def _projected(
    volume: Any, source: Any, data: Mapping[str, bytes], no_key: str
) -> dict[str, FileProjection]:
    """What a Secret's or ConfigMap's `data` shows through `source`'s `items`, modes and
    `optional` (a key missing: MountError saying `no_key`)."""
    default = DEFAULT_SECRET_MODE if source.default_mode is None else int(source.default_mode)
    payload: dict[str, FileProjection] = {}
    for item in source.items or [_Item(key, key) for key in sorted(data)]:
        if item.key not in data:
            if source.optional:
                continue
            raise MountError(f"{_failed(volume)}{no_key}: {item.key}")
        mode = default if getattr(item, "mode", None) is None else int(item.mode)
        payload[item.path] = FileProjection(data[item.key], mode)
    return payload


def write_atomically(
    folder: Path, payload: Mapping[str, FileProjection], fs_group: int | None = None
) -> bool:
    """Makes `folder` show exactly `payload` (relative path -> file) the way a kubelet's
    atomic writer does, and returns whether it wrote anything (nothing when every file
    already reads the same).

    The files go to a new timestamped hidden folder; a `..data_tmp` link to it is renamed
    over `..data` (one atomic step: a reader that opens `tls.crt -> ..data/tls.crt` gets
    the old set or the new one); the names the container sees are links through `..data`
    (for `dir/file`, `dir -> ..data/dir`), those no longer in the payload are removed, and
    so is the old folder. With `fs_group` that group owns the files and may read them.
    """
    for path in payload:
        parts = PurePosixPath(path).parts
        if not parts or PurePosixPath(path).is_absolute() or any(p == ".." for p in parts):
            raise ValueError(f"invalid path {path!r} in a volume")
        if parts[0].startswith(".."):
            raise ValueError(f"invalid path {path!r} in a volume: it may not start with '..'")
    folder.mkdir(parents=True, exist_ok=True)
    data_link = folder / DATA_LINK
    old = os.readlink(data_link) if data_link.is_symlink() else None
    if old is not None and _reads(folder / old) == {p: f.data for p, f in payload.items()}:
        return False
    # As a kubelet names it: `..` and the UTC time, then a random suffix.
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
    new = Path(tempfile.mkdtemp(prefix=stamp, dir=folder))
    new.chmod(0o755)
    for path, file in payload.items():
        target = new / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(file.data)
        target.chmod(file.mode)
    if fs_group is not None:
        _own(new, fs_group)
    tmp_link = folder / f"{DATA_LINK}_tmp"
    tmp_link.unlink(missing_ok=True)
    os.symlink(new.name, tmp_link)
    os.replace(tmp_link, data_link)
    visible = {PurePosixPath(path).parts[0] for path in payload}
    for name in sorted(visible):
        link = folder / name
        if not link.is_symlink():
            os.symlink(f"{DATA_LINK}/{name}", link)
    for entry in folder.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in visible:
            entry.unlink()
    if old is not None and old != new.name:
        shutil.rmtree(folder / old, ignore_errors=True)
    return True


def _reads(folder: Path) -> dict[str, bytes] | None:
    """Every file under `folder` (relative path -> bytes); None if it cannot be read."""
    try:
        return {
            str(path.relative_to(folder)): path.read_bytes()
            for path in folder.rglob("*")
            if path.is_file()
        }
    except OSError:
        return None


def _own(folder: Path, gid: int) -> None:
    """What a kubelet does for a pod's fsGroup on a read-only volume: the group owns every
    file and folder, may read the files and enter the folders (setgid)."""
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, -1, gid)
        if path.is_dir():
            path.chmod(path.stat().st_mode & 0o7777 | 0o2550)
        else:
            path.chmod(path.stat().st_mode & 0o7777 | 0o440)


def _fs_group(pod: Any) -> int | None:
    context = pod.spec.security_context
    group = getattr(context, "fs_group", None) if context is not None else None
    return None if group is None else int(group)


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
