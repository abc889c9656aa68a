"""A real node for the tests: containerd and a real kubelet joining the session's cluster.

kwok (harness/cluster.py) simulates nodes, and the kwok runner (harness/kwok_runner.py,
harness/containers.py) imitates what a kubelet enforces. This node is the real thing: the
kubelet built from the pinned Kubernetes module (hack/gocomponents.sh) with Debian's
containerd and runc (CONTAINER_TOOLS in hack/versions.env) registers as Node `real-0` with
the session's API server and runs pods there: it pulls images from the session's registry
(plain HTTP on loopback) and applies securityContext, runAsNonRoot, memory limits and
termination messages as any cluster's kubelet does. kwok manages only nodes annotated
`kwok.x-k8s.io/node=fake`, so it leaves this Node alone.

What it is and is not:

- Pods must use `hostNetwork: true`. containerd gets a loopback-only CNI configuration (so
  the runtime reports its network ready and the Node turns Ready) and nothing else: no pod
  network, no bridge, no iptables rules (`makeIPTablesUtilChains: false`).
- The Node is tainted `relaytrain.io/real-node:NoSchedule`: only pods that tolerate it and
  select it (`RealNode.placement()`) land here.
- The kubelet authenticates with the cluster's admin kubeconfig (the simplest credentials
  that work; a real node's would be `system:node:real-0`).
- cgroup v1 with the cgroupfs driver (`failCgroupV1: false`, `cgroupDriver: cgroupfs`),
  `failSwapOn: false`, a non-loopback `--node-ip` (the kubelet refuses 127.0.0.1).
- containerd's `restrict_oom_score_adj = true`: the kubelet asks for oom_score_adj -998 (the
  sandbox) and -997 (Guaranteed pods), which needs CAP_SYS_RESOURCE; a VM that withholds it
  from root (as this machine's does) makes runc fail every sandbox with "can't get final
  child's PID from pipe: EOF". With the setting, containerd raises those values to its own
  (0). OOM kills through the memory cgroup are unaffected.
- The sandbox ("pause") image is the operator image with `sleep infinity` as its entrypoint,
  a config-only copy made in the registry (`derive_image`): nothing is pulled from outside.

It needs root (cgroups, mounts, namespaces). Its state lives in a folder of the session
(containerd root/state, runc root, kubelet root-dir, cert-dir, pod logs); what the kubelet
and containerd put elsewhere whatever they are told, the teardown removes, and only if it
was not there before: /var/lib/kubelet (device-plugins), /var/log/containers, /var/log/pods,
/run/containerd (the shims' sockets), the /kubepods cgroups, and the host sysctls the
kubelet rewrites (kernel.panic, kernel.panic_on_oops, vm.overcommit_memory, ...), which are
recorded before it starts and written back. One real node per host at a time: a lock file
in /run serializes test sessions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack import toolpaths
from relaytrain_testkit.harness.cluster import KubeCluster
from relaytrain_testkit.harness.containers import require_image
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.procs import alive, stop
from relaytrain_testkit.harness.registry import Registry
from relaytrain_testkit.harness.waiting import wait_for

NODE_NAME = "real-0"
TAINT_KEY = "relaytrain.io/real-node"
LOCK_FILE = Path("/run/relaytrain-real-kubelet.lock")
CNI_BIN_DIR = Path("/usr/lib/cni")
# Created by the kubelet or containerd whatever their root/state folders say.
HOST_PATHS = [
    Path("/var/lib/kubelet"),
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/run/containerd"),
    Path("/run/containerd/s"),
]
# What the kubelet writes at start (protectKernelDefaults: false) and the teardown restores.
SYSCTLS = [
    "kernel/panic",
    "kernel/panic_on_oops",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
]
_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


class RealNodeError(RuntimeError):
    """The real node could not start (or this machine cannot run one): what and why."""


@dataclass
class RealNode:
    """A running real node of `cluster`."""

    name: str
    cluster: KubeCluster
    workdir: Path
    base_image: str
    """The registry reference (by digest) the sandbox image was derived from."""
    sandbox_image: str

    def placement(self) -> dict[str, Any]:
        """Pod spec fields that put a pod on this node, and only there."""
        return {
            "nodeSelector": {"kubernetes.io/hostname": self.name},
            "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
        }

    def log_tail(self, component: str, lines: int = 40) -> str:
        """The end of the log of `containerd` or `kubelet`."""
        return _tail(self.workdir / f"{component}.log", lines)


@dataclass
class _Started:
    workdir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    host_paths: dict[Path, bool] = field(default_factory=dict)
    cgroups: dict[Path, bool] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"


def missing_requirements() -> list[str]:
    """What this machine lacks to run a real node (empty when nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append(
            f"root (running as uid {os.geteuid()}): the kubelet and containerd need it for "
            "cgroups, mounts and namespaces"
        )
    for tool in ("containerd", "ctr", "runc"):
        if shutil.which(tool, path=_path()) is None:
            missing.append(f"`{tool}` (run `bash hack/images.sh tools` as root)")
    if not (CNI_BIN_DIR / "loopback").is_file():
        missing.append(
            f"the CNI loopback plugin {CNI_BIN_DIR}/loopback (containernetworking-plugins)"
        )
    try:
        toolpaths.binary("kubelet")
    except FileNotFoundError as exc:
        missing.append(str(exc))
    return missing


@contextlib.contextmanager
def real_kubelet_node(
    cluster: KubeCluster,
    registry: Registry,
    base_image: str,
    workdir: Path,
    name: str = NODE_NAME,
    lock_timeout: float = 600.0,
) -> Iterator[RealNode]:
    """Starts containerd and a kubelet registered with `cluster` as Node `name`, waits until
    the Node is Ready, and on exit removes everything it started or changed. `base_image` is
    a reference in `registry` by digest of an image with `sleep` on its PATH (the sandbox
    image is made from it). Raises RealNodeError, with the component's log, when a part
    does not start; never skips."""
    missing = missing_requirements()
    if missing:
        raise RealNodeError("a real kubelet node needs " + "; ".join(missing))
    workdir.mkdir(parents=True, exist_ok=True)
    with _host_lock(lock_timeout):
        started = _Started(workdir)
        _record_host(started)
        try:
            sandbox = derive_image(base_image, "pause", entrypoint=["sleep", "infinity"])
            _start_containerd(started, registry.address, sandbox)
            _start_kubelet(started, cluster, name)
            node = RealNode(name, cluster, workdir, base_image, sandbox)
            _wait_node_ready(started, cluster, name)
        except BaseException:
            errors = _teardown(started, cluster, name)
            if errors:
                print("real node teardown: " + "; ".join(errors))
            raise
        try:
            yield node
        finally:
            errors = _teardown(started, cluster, name)
            if errors:
                raise RealNodeError("real node teardown left: " + "; ".join(errors))


@pytest.fixture(scope="module")
def real_node(
    kube_cluster: KubeCluster, image_registry: Registry, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    """A real node for one test module (pytest plugin), gone before the next module runs, so
    no other test sees Node `real-0`. Its sandbox image is made from the operator image
    `make images` built, pushed to the session's registry."""
    operator = image_registry.push(_fresh("operator"))
    with real_kubelet_node(
        kube_cluster, image_registry, operator, tmp_path_factory.mktemp("real-node")
    ) as node:
        yield node


def _fresh(image: str) -> str:
    require_image(image)  # fails, saying to run `make images`, unless built from this tree
    return image


# --- images -------------------------------------------------------------------------------


def derive_image(
    ref: str,
    tag: str,
    *,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    user: str | None = None,
) -> str:
    """A copy of image `ref` (`host:port/repo@sha256:...` in a registry served over plain
    HTTP) whose config says another entrypoint, command or user, tagged `tag` in the same
    repository; its reference by digest. Only a new config blob and manifest are uploaded:
    the layers are the same blobs."""
    name, _, digest = ref.partition("@")
    host, _, repo = name.partition("/")
    base = f"http://{host}/v2/{repo}"
    manifest_raw, media_type = _get(f"{base}/manifests/{digest}", accept=_MANIFEST_TYPES)
    if media_type not in _MANIFEST_TYPES:
        raise RealNodeError(f"{ref} is a {media_type}, not one image's manifest")
    manifest = json.loads(manifest_raw)
    config = json.loads(_get(f"{base}/blobs/{manifest['config']['digest']}")[0])
    own = config.setdefault("config", {})
    if entrypoint is not None:
        own["Entrypoint"] = entrypoint
    if cmd is not None or entrypoint is not None:
        own["Cmd"] = cmd
    if user is not None:
        own["User"] = user
    blob = json.dumps(config, separators=(",", ":")).encode()
    blob_digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    with urllib.request.urlopen(
        urllib.request.Request(f"{base}/blobs/uploads/", method="POST"), timeout=30
    ) as resp:
        location = resp.headers["Location"]
    if location.startswith("/"):
        location = f"http://{host}{location}"
    sep = "&" if "?" in location else "?"
    _send("PUT", f"{location}{sep}digest={blob_digest}", blob, "application/octet-stream")
    manifest["config"] = {**manifest["config"], "digest": blob_digest, "size": len(blob)}
    body = json.dumps(manifest, separators=(",", ":")).encode()
    _send("PUT", f"{base}/manifests/{tag}", body, media_type)
    return f"{name}@sha256:{hashlib.sha256(body).hexdigest()}"


def _get(url: str, accept: tuple[str, ...] = ()) -> tuple[bytes, str]:
    req = urllib.request.Request(url, headers={"Accept": ", ".join(accept)} if accept else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read(), resp.headers.get("Content-Type", "")


def _send(method: str, url: str, body: bytes, content_type: str) -> None:
    req = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(req, timeout=30):
            pass
    except urllib.error.HTTPError as exc:
        raise RealNodeError(f"{method} {url}: {exc.code} {exc.read()[:500]!r}") from exc


# --- start --------------------------------------------------------------------------------


@contextlib.contextmanager
def _host_lock(timeout: float) -> Iterator[None]:
    """One real node per host: the kubelet's cgroups, device-plugin folder, log links and the
    host sysctls are global. A second session waits here."""
    with LOCK_FILE.open("a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RealNodeError(
                        f"another session has held {LOCK_FILE} (a real node on this host) "
                        f"for over {timeout:g}s"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _record_host(started: _Started) -> None:
    for key in SYSCTLS:
        path = Path("/proc/sys") / key
        if path.exists():
            started.sysctls[key] = path.read_text().strip()
    started.host_paths = {p: p.exists() for p in HOST_PATHS}
    started.cgroups = {p: p.exists() for p in _kubepods_cgroups()}


def _kubepods_cgroups() -> list[Path]:
    """The kubelet's QoS cgroup (cgroupfs driver, cgroupRoot /) in each hierarchy."""
    root = Path("/sys/fs/cgroup")
    candidates = [root / "kubepods"] + [d / "kubepods" for d in root.iterdir() if d.is_dir()]
    return [p for p in candidates if p.parent.is_dir() and _is_cgroup_dir(p.parent)]


def _is_cgroup_dir(path: Path) -> bool:
    return (path / "cgroup.procs").exists()


def _start_containerd(started: _Started, registry: str, sandbox_image: str) -> None:
    d = started.workdir
    certs = d / "certs.d" / registry
    certs.mkdir(parents=True, exist_ok=True)
    # The session's registry serves plain HTTP on loopback.
    (certs / "hosts.toml").write_text(
        f'server = "http://{registry}"\n\n'
        f'[host."http://{registry}"]\n  capabilities = ["pull", "resolve"]\n'
    )
    cni = d / "cni"
    cni.mkdir(exist_ok=True)
    # Loopback only: enough for containerd to call its network ready; pods use hostNetwork.
    (cni / "10-relaytrain-loopback.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "0.4.0",
                "name": "relaytrain-real-node",
                "plugins": [{"type": "loopback"}],
            }
        )
    )
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    runc = shutil.which("runc", path=_path())
    config = f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{started.socket}"
[ttrpc]
  address = "{started.socket}.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"
[{cri}]
  sandbox_image = "{sandbox_image}"
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # This VM withholds CAP_SYS_RESOURCE from root: oom_score_adj below 0 fails in runc.
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
        Root = "{d}/runc"
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni}"
  [{cri}.registry]
    config_path = "{d}/certs.d"
"""
    (d / "containerd.toml").write_text(config)
    started.socket.parent.mkdir(parents=True, exist_ok=True)
    started.processes["containerd"] = _spawn(
        ["containerd", "--config", str(d / "containerd.toml")], d / "containerd.log"
    )

    def ready() -> bool:
        _alive(started, "containerd")
        return _ctr(started, "version").returncode == 0

    _wait(started, "containerd", "containerd to serve its socket", ready, timeout=30)


def _start_kubelet(started: _Started, cluster: KubeCluster, name: str) -> None:
    d = started.workdir
    healthz = free_port()
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine: cgroup v1, cgroupfs (no systemd), swap allowed to be on.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{started.socket}",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True}},
        "authorization": {"mode": "Webhook"},
        "address": _node_ip(),
        "port": free_port(),
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "cgroupsPerQOS": True,
        "cgroupRoot": "/",
        # A test machine's disk may be fuller than a node's defaults allow.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "resolvConf": "/etc/resolv.conf",
        "registerNode": True,
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        "podLogsDir": str(d / "pod-logs"),
        "volumePluginDir": str(d / "volume-plugins"),
        # No iptables chains on the host (KUBE-FIREWALL and the canaries).
        "makeIPTablesUtilChains": False,
    }
    (d / "kubelet.yaml").write_text(yaml.safe_dump(config))
    argv = [
        str(toolpaths.binary("kubelet")),
        "--config", str(d / "kubelet.yaml"),
        "--kubeconfig", str(cluster.kubeconfig),
        "--root-dir", str(d / "kubelet"),
        "--cert-dir", str(d / "kubelet-pki"),
        "--hostname-override", name,
        "--node-ip", str(config["address"]),
        "--v", "1",
    ]  # fmt: skip
    started.processes["kubelet"] = _spawn(argv, d / "kubelet.log")

    def healthy() -> bool:
        _alive(started, "kubelet")
        try:
            url = f"http://127.0.0.1:{healthz}/healthz"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    _wait(started, "kubelet", "the kubelet's /healthz", healthy, timeout=60)


def _wait_node_ready(started: _Started, cluster: KubeCluster, name: str) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(cluster.api_client())

    def ready() -> bool:
        _alive(started, "kubelet")
        nodes = core.list_node(field_selector=f"metadata.name={name}").items
        if not nodes:
            return False
        node = nodes[0]
        is_ready = any(
            c.type == "Ready" and c.status == "True" for c in node.status.conditions or []
        )
        # Until the node lifecycle controller lifts node.kubernetes.io/not-ready nothing
        # schedules here.
        others = [t.key for t in node.spec.taints or [] if t.key != TAINT_KEY]
        return is_ready and not others

    _wait(started, "kubelet", f"Node {name} Ready and untainted but for {TAINT_KEY}", ready, 90)


def _node_ip() -> str:
    """An address of this machine other than loopback (the kubelet refuses 127.0.0.1): the
    default route's interface's, else the first global one."""
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "default"]) or "[]")
    addrs = json.loads(_run(["ip", "-j", "-4", "addr", "show", "scope", "global"]) or "[]")
    devices = [r.get("dev") for r in routes] + [a["ifname"] for a in addrs]
    for dev in devices:
        for a in addrs:
            if a["ifname"] == dev and a.get("addr_info"):
                return str(a["addr_info"][0]["local"])
    raise RealNodeError("this machine has no IPv4 address but loopback for the kubelet's node IP")


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def _path() -> str:
    return os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin"


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PATH": _path()},
        )


def _alive(started: _Started, component: str) -> None:
    proc = started.processes[component]
    if proc.poll() is not None:
        raise RealNodeError(
            f"{component} exited with {proc.returncode} while starting; the end of its log "
            f"({started.workdir / (component + '.log')}):\n"
            + _tail(started.workdir / f"{component}.log")
        )


def _wait(started: _Started, component: str, what: str, probe: Any, timeout: float) -> None:
    try:
        wait_for(what, probe, timeout=timeout, interval=0.1)
    except AssertionError as exc:
        raise RealNodeError(
            f"{exc}; the end of the {component} log ({started.workdir / (component + '.log')}):\n"
            + _tail(started.workdir / f"{component}.log")
        ) from None


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _ctr(started: _Started, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ctr", "--address", str(started.socket), "--namespace", "k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "PATH": _path()},
    )


# --- teardown -----------------------------------------------------------------------------


def _teardown(started: _Started, cluster: KubeCluster, name: str) -> list[str]:
    """Stops and removes everything `started` holds; what could not be undone."""
    errors: list[str] = []

    def step(what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # every step runs; each failure is reported
            errors.append(f"{what}: {exc}")

    step("deleting the node's pods", _delete_pods, cluster, name)
    step("stopping the kubelet", _stop, started, "kubelet")
    if "containerd" in started.processes:
        step("removing the containers", _remove_containers, started)
    step("killing what is left in /kubepods", _kill_kubepods, started)
    step("stopping containerd", _stop, started, "containerd")
    step("killing the shims", _kill_shims, started)
    step("unmounting", _unmount_under, started.workdir)
    step("removing cgroups", _remove_cgroups, started)
    step("removing host folders", _remove_host_paths, started)
    step("restoring sysctls", _restore_sysctls, started)
    step("deleting the Node", _delete_node, cluster, name)
    return errors


def _delete_pods(cluster: KubeCluster, name: str) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(cluster.api_client())
    for pod in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}").items:
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
            )


def _delete_node(cluster: KubeCluster, name: str) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(cluster.api_client())
    try:
        core.delete_node(name)
    except client.ApiException as exc:
        if exc.status != 404:
            raise


def _stop(started: _Started, component: str) -> None:
    proc = started.processes.pop(component, None)
    if proc is not None:
        stop(proc)


def _remove_containers(started: _Started) -> None:
    """Every task killed and deleted (which unmounts its root filesystem and ends its shim),
    then every container record, through containerd itself."""
    tasks = [line.split()[0] for line in _ctr(started, "tasks", "ls", "-q").stdout.splitlines()]
    for task in tasks:
        _ctr(started, "tasks", "kill", "--all", "--signal", "SIGKILL", task)
    for task in tasks:
        _ctr(started, "tasks", "delete", "--force", task)
    containers = _ctr(started, "containers", "ls", "-q").stdout.split()
    if containers:
        _ctr(started, "containers", "delete", *containers)


def _cgroup_procs(root: Path) -> list[int]:
    pids: list[int] = []
    for procs in root.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in procs.read_text().split()]
    return pids


def _kill_kubepods(started: _Started) -> None:
    """SIGKILL to any process still in a /kubepods cgroup this node made (a container whose
    shim is gone)."""
    for root, existed in started.cgroups.items():
        if not existed and root.is_dir():
            _kill_cgroup(root)


def _kill_cgroup(root: Path) -> None:
    for pid in _cgroup_procs(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(f"no process left in {root}", lambda: not _cgroup_procs(root), timeout=15)


def _kill_shims(started: _Started) -> None:
    """containerd-shim-runc-v2 processes outlive containerd: those of this node's socket."""
    address = str(started.socket)
    mine = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and address.encode() in argv:
                mine.append(int(proc.name))
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for("the shims to exit", lambda: not any(alive(p) for p in mine), 15)


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder`, deepest first."""
    targets = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].encode().decode("unicode_escape")
        if target == str(folder) or target.startswith(f"{folder}/"):
            targets.append(target)
    return sorted(targets, key=lambda t: t.count("/"), reverse=True)


def _unmount_under(folder: Path) -> None:
    for target in mounts_under(folder):
        if subprocess.run(["umount", target], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", target], capture_output=True, check=True)
    left = mounts_under(folder)
    if left:
        raise RealNodeError(f"still mounted: {left}")


def _remove_cgroups(started: _Started) -> None:
    for root, existed in started.cgroups.items():
        if existed or not root.is_dir():
            continue
        for sub in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            sub.rmdir()
        root.rmdir()


def _remove_host_paths(started: _Started) -> None:
    for path, existed in started.host_paths.items():  # parents before their children
        if not existed and (path.exists() or path.is_symlink()):
            shutil.rmtree(path)


def _restore_sysctls(started: _Started) -> None:
    for key, value in started.sysctls.items():
        path = Path("/proc/sys") / key
        if path.read_text().strip() != value:
            path.write_text(value + "\n")
