"""The test kubelet's Secret volumes (relaytrain_testkit.harness.kubelet_volumes) are laid
out as a real kubelet's atomic writer lays them out, and follow their Secret as it does:
a change swaps `..data` to a new folder, no change writes nothing. tests/k8s/
test_kwok_runner.py mounts one in a running process."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from relaytrain_testkit.harness.kubelet_volumes import (
    FileProjection,
    MountError,
    project_volumes,
    refresh_secret_volumes,
    secret_payload,
    write_atomically,
)

pytestmark = pytest.mark.unit


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _stamped(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("..2") and p.is_dir())


def test_the_files_are_links_through_data_to_a_timestamped_folder(tmp_path: Path) -> None:
    folder = tmp_path / "link"
    payload = {
        "ca.crt": FileProjection(b"CA", 0o440),
        "tls.key": FileProjection(b"KEY", 0o400),
        "sub/extra": FileProjection(b"X", 0o644),
    }
    assert write_atomically(folder, payload) is True

    (stamped,) = _stamped(folder)
    assert os.readlink(folder / "..data") == stamped
    assert stamped.startswith("..") and len(stamped.split(".")[2]) == len("2026_11_26_21_40_00")
    assert os.readlink(folder / "ca.crt") == "..data/ca.crt"
    assert os.readlink(folder / "sub") == "..data/sub"  # a nested path: its first part links
    assert (folder / "tls.key").read_bytes() == b"KEY"
    assert (folder / "sub" / "extra").read_bytes() == b"X"
    assert {p: _mode(folder / stamped / p) for p in payload} == {
        "ca.crt": 0o440,
        "tls.key": 0o400,
        "sub/extra": 0o644,
    }
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["..data", stamped, "ca.crt", "tls.key", "sub"]
    )


def test_an_update_swaps_data_and_removes_the_old_folder_and_names(tmp_path: Path) -> None:
    folder = tmp_path / "link"
    write_atomically(
        folder, {"tls.crt": FileProjection(b"old", 0o644), "gone": FileProjection(b"g", 0o644)}
    )
    (first,) = _stamped(folder)
    visible = folder / "tls.crt"
    before = os.lstat(visible)

    assert write_atomically(folder, {"tls.crt": FileProjection(b"new", 0o644)}) is True

    (second,) = _stamped(folder)
    assert second != first and os.readlink(folder / "..data") == second
    assert visible.read_bytes() == b"new"
    # The name the container opens is the same link: only `..data` moved.
    assert os.lstat(visible).st_ino == before.st_ino
    assert not (folder / "gone").exists() and not os.path.lexists(folder / "gone")
    assert not os.path.lexists(folder / "..data_tmp")


def test_unchanged_data_is_not_written_again(tmp_path: Path) -> None:
    folder = tmp_path / "link"
    payload = {"tls.crt": FileProjection(b"same", 0o644)}
    write_atomically(folder, payload)
    (stamped,) = _stamped(folder)
    written = (folder / stamped / "tls.crt").stat().st_mtime_ns

    assert write_atomically(folder, dict(payload)) is False
    assert _stamped(folder) == [stamped]
    assert (folder / stamped / "tls.crt").stat().st_mtime_ns == written


def _other_group() -> int:
    """A group the files are not in already (only root may give them to any group)."""
    if os.geteuid() != 0:
        pytest.skip("giving files to another group needs root")
    return 4242


def test_fs_group_owns_the_files_and_may_read_them(tmp_path: Path) -> None:
    folder = tmp_path / "link"
    gid = _other_group()
    write_atomically(folder, {"tls.key": FileProjection(b"k", 0o400)}, fs_group=gid)
    (stamped,) = _stamped(folder)
    key = folder / stamped / "tls.key"
    assert key.stat().st_gid == gid and _mode(key) == 0o440
    assert (folder / stamped).stat().st_mode & stat.S_ISGID


@pytest.mark.parametrize("path", ["/abs", "../up", "a/../../up", "..data", "..hidden/x"])
def test_paths_outside_the_volume_or_hidden_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(ValueError, match="invalid path"):
        write_atomically(tmp_path / "link", {path: FileProjection(b"x", 0o644)})


class FakeCore:
    """The one call the Secret volume makes, answered from a dict of Secrets."""

    def __init__(self, secrets: dict[str, dict[str, str]]) -> None:
        self.secrets = secrets
        self.reads = 0

    def read_namespaced_secret(self, name: str, namespace: str) -> client.V1Secret:
        self.reads += 1
        if name not in self.secrets:
            raise ApiException(status=404, reason="Not Found")
        data: dict[str, bytes | str] = {
            k: base64.b64encode(v.encode()).decode() for k, v in self.secrets[name].items()
        }
        return client.V1Secret(data=data)


def _pod(source: client.V1SecretVolumeSource, fs_group: int | None = None) -> Any:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p0-s1", namespace="ns", uid="u"),
        spec=client.V1PodSpec(
            security_context=client.V1PodSecurityContext(fs_group=fs_group),
            volumes=[client.V1Volume(name="link", secret=source)],
            containers=[
                client.V1Container(
                    name="worker",
                    volume_mounts=[
                        client.V1VolumeMount(
                            name="link", mount_path="/var/run/relaytrain/link", read_only=True
                        )
                    ],
                )
            ],
        ),
    )


LINK_ITEMS = [
    client.V1KeyToPath(key="ca.crt", path="ca.crt"),
    client.V1KeyToPath(key="p0-s1.crt", path="tls.crt"),
    client.V1KeyToPath(key="p0-s1.key", path="tls.key", mode=0o400),
]
LINK_DATA = {"ca.crt": "CA", "p0-s1.crt": "CRT", "p0-s1.key": "KEY", "p1-s0.key": "OTHER"}


def test_items_and_modes_pick_what_the_volume_shows(tmp_path: Path) -> None:
    core = FakeCore({"job-link": LINK_DATA})
    source = client.V1SecretVolumeSource(
        secret_name="job-link", default_mode=0o440, items=LINK_ITEMS
    )
    pod = _pod(source)
    mounts, tokens = project_volumes(core, pod, pod.spec.containers[0], tmp_path)

    folder = tmp_path / "volumes" / "link"
    assert [(m.source, m.target, m.read_only) for m in mounts] == [
        (folder, "/var/run/relaytrain/link", True)
    ]
    assert tokens == []
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("..")) == [
        "ca.crt",
        "tls.crt",
        "tls.key",
    ]
    assert (folder / "tls.crt").read_text() == "CRT"
    assert {name: _mode(folder / name) for name in ("ca.crt", "tls.crt", "tls.key")} == {
        "ca.crt": 0o440,
        "tls.crt": 0o440,
        "tls.key": 0o400,
    }
    # Without items: every key, named as the key, mode 0644.
    every = secret_payload(
        core,
        pod,
        client.V1Volume(name="v", secret=client.V1SecretVolumeSource(secret_name="job-link")),
    )
    assert {p: (f.data, f.mode) for p, f in every.items()} == {
        k: (v.encode(), 0o644) for k, v in LINK_DATA.items()
    }


def test_a_renewed_secret_reaches_the_folder_and_an_unchanged_one_does_not(
    tmp_path: Path,
) -> None:
    core = FakeCore({"job-link": dict(LINK_DATA)})
    pod = _pod(client.V1SecretVolumeSource(secret_name="job-link", items=LINK_ITEMS))
    container = pod.spec.containers[0]
    project_volumes(core, pod, container, tmp_path)
    folder = tmp_path / "volumes" / "link"
    (first,) = _stamped(folder)

    assert refresh_secret_volumes(core, pod, container, tmp_path) == []
    core.secrets["job-link"]["p1-s0.key"] = "not projected"  # a key the volume leaves out
    assert refresh_secret_volumes(core, pod, container, tmp_path) == []
    assert _stamped(folder) == [first]

    core.secrets["job-link"].update({"p0-s1.crt": "CRT2", "p0-s1.key": "KEY2"})
    assert refresh_secret_volumes(core, pod, container, tmp_path) == ["link"]
    (second,) = _stamped(folder)
    assert second != first
    assert ((folder / "tls.crt").read_text(), (folder / "tls.key").read_text()) == (
        "CRT2",
        "KEY2",
    )
    assert (folder / "ca.crt").read_text() == "CA"


def test_a_missing_secret_or_key_fails_the_mount_in_the_kubelets_words(tmp_path: Path) -> None:
    pod = _pod(client.V1SecretVolumeSource(secret_name="job-link", items=LINK_ITEMS))
    container = pod.spec.containers[0]
    with pytest.raises(MountError) as missing:
        project_volumes(FakeCore({}), pod, container, tmp_path)
    assert str(missing.value) == (
        'MountVolume.SetUp failed for volume "link" : secret "job-link" not found'
    )
    assert (missing.value.reason, missing.value.event_reason) == (
        "ContainerCreating",
        "FailedMount",
    )
    no_key = FakeCore({"job-link": {"ca.crt": "CA", "p0-s1.crt": "CRT"}})
    with pytest.raises(
        MountError, match=r'"link" : references non-existent secret key: p0-s1.key$'
    ):
        project_volumes(no_key, pod, container, tmp_path)
    assert not (tmp_path / "volumes" / "link" / "..data").exists()  # nothing half written


def test_an_optional_secret_may_be_missing(tmp_path: Path) -> None:
    source = client.V1SecretVolumeSource(secret_name="job-link", items=LINK_ITEMS, optional=True)
    pod = _pod(source)
    project_volumes(FakeCore({}), pod, pod.spec.containers[0], tmp_path)
    folder = tmp_path / "volumes" / "link"
    assert os.readlink(folder / "..data").startswith("..2")
    assert [p.name for p in folder.iterdir() if not p.name.startswith("..")] == []
    partial = FakeCore({"job-link": {"ca.crt": "CA"}})
    assert refresh_secret_volumes(partial, pod, pod.spec.containers[0], tmp_path) == ["link"]
    assert [p.name for p in folder.iterdir() if not p.name.startswith("..")] == ["ca.crt"]


def test_the_pods_fs_group_owns_a_secret_volume(tmp_path: Path) -> None:
    gid = _other_group()
    pod = _pod(client.V1SecretVolumeSource(secret_name="job-link", items=LINK_ITEMS), fs_group=gid)
    project_volumes(FakeCore({"job-link": LINK_DATA}), pod, pod.spec.containers[0], tmp_path)
    key = tmp_path / "volumes" / "link" / "tls.key"
    assert key.stat().st_gid == gid and _mode(key) == 0o440


class FakeConfigMaps:
    """The one call a ConfigMap volume makes, answered from a dict of ConfigMaps."""

    def __init__(self, maps: dict[str, dict[str, str]]) -> None:
        self.maps = maps

    def read_namespaced_config_map(self, name: str, namespace: str) -> client.V1ConfigMap:
        if name not in self.maps:
            raise ApiException(status=404, reason="Not Found")
        return client.V1ConfigMap(data=dict(self.maps[name]))


def test_a_config_map_volume_shows_its_text_and_follows_it(tmp_path: Path) -> None:
    """The operator's GPU catalog comes in one (the chart's gpuCatalog)."""
    core = FakeConfigMaps({"catalog": {"gpu-catalog.yaml": "A: {}\n"}})
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="op", namespace="ns", uid="u"),
        spec=client.V1PodSpec(
            volumes=[
                client.V1Volume(
                    name="gpu-catalog",
                    config_map=client.V1ConfigMapVolumeSource(name="catalog"),
                )
            ],
            containers=[
                client.V1Container(
                    name="operator",
                    volume_mounts=[
                        client.V1VolumeMount(
                            name="gpu-catalog", mount_path="/etc/relaytrain", read_only=True
                        )
                    ],
                )
            ],
        ),
    )
    mounts, _ = project_volumes(core, pod, pod.spec.containers[0], tmp_path)
    folder = tmp_path / "volumes" / "gpu-catalog"
    assert [(m.source, m.target, m.read_only) for m in mounts] == [
        (folder, "/etc/relaytrain", True)
    ]
    assert (folder / "gpu-catalog.yaml").read_text() == "A: {}\n"
    assert _mode(folder / "gpu-catalog.yaml") == 0o644
    core.maps["catalog"] = {"gpu-catalog.yaml": "B: {}\n"}
    assert refresh_secret_volumes(core, pod, pod.spec.containers[0], tmp_path) == ["gpu-catalog"]
    assert (folder / "gpu-catalog.yaml").read_text() == "B: {}\n"
    # Gone: the container waits, in the kubelet's words.
    core.maps.clear()
    with pytest.raises(MountError, match='configmap "catalog" not found'):
        project_volumes(core, pod, pod.spec.containers[0], tmp_path)
