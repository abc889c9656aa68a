"""Runs the containers of pods on kwok nodes as local processes.

kwok simulates nodes and marks their pods Running, but nothing executes. For the demo
and the e2e tier we want the real worker to train, so this runner plays the kubelet's
part for pods that carry the label `relaytrain.io/job`:

- a pod that kwok reports Running is started as a local process: its container's args
  (with `python` replaced by this interpreter), its environment with `value`,
  `secretKeyRef`, `configMapKeyRef` and `fieldRef` resolved from the API server;
- cluster DNS does not exist here, so each stable pod address `<hostname>.<subdomain>.
  <namespace>.svc:<port>` gets a loopback port of its own (kept for the life of the
  runner, so a replacement pod with the same hostname is reached at the same address,
  as DNS would give it), and the stage contract document is rewritten to use them; the
  replica links go by name instead, as their addresses also come from the job's store (a
  pipeline added: fleet.json): each replica listener's host gets a loopback IP of its own
  (127.x.y.z, at the document's port), named in a hosts file the runner keeps and mounts
  at the stage container's /etc/hosts;
- when the process exits the pod's status is posted as a kubelet would (Succeeded or
  Failed with the exit code and the termination message: what the process wrote to the
  file the container's `terminationMessagePath` names — here a file of the pod's own that
  `RELAYTRAIN_TERMINATION_LOG` points the worker at, where a kubelet would bind-mount it —
  or, under `FallbackToLogsOnError` after a failure with none, the end of its log); a pod
  that is deleted has its process stopped (SIGTERM, SIGKILL after its grace), and one gone
  with its node SIGKILLed at once, as a vanished machine takes its processes; a pod bound
  to a node that no longer exists never starts; and since the addresses above are a pod
  name's, where a kubelet's pod gets an IP of its own, a pod made again under a name whose
  earlier pod's process is still stopping waits until it is gone;
- a stage pod's `python -m relaytrain_worker` is forked from a server that imported the
  worker once (harness/prefork_pods.py on `relaytrain_worker.prefork`, which also serves
  `relaytrain run --local`), its volumes mounted in the child, instead of a new interpreter
  importing torch for each pod; `RELAYTRAIN_PREFORK=0` starts each as a program;
- every container gets what a kubelet gives it: `KUBERNETES_SERVICE_HOST/PORT` (here the
  real API server on loopback), its projected volumes — the ServiceAccount token from
  the TokenRequest API, the cluster CA, the namespace — and its Secret volumes (in the
  kubelet's atomic-writer layout), mounted where the pod says, in a mount namespace of its
  own (harness/kubelet_volumes.py). A pod that does not opt out of the token therefore
  authenticates as its ServiceAccount, and as nothing else. While the container runs, its
  Secret volumes follow their Secrets (read again about once a second; a change is swapped
  in atomically, as a kubelet does it) and its tokens are renewed before they expire. A
  Secret volume that cannot be set up (its Secret, or a key `items` names, is missing)
  holds the container as a kubelet does: Waiting (ContainerCreating) with a `FailedMount`
  Event, until it can.

A pod whose containers restart (`restartPolicy` Always or OnFailure: a Deployment's, such
as the operator's as the chart installs it) is the runner's from the moment it is bound:
it starts the process, posts the pod's status (Running; Ready only while the readiness
probe passes), runs its liveness and readiness probes (harness/probes.py), kills and
restarts the container when liveness fails or the process exits (restartCount, lastState,
the kubelet's back-off), posts the kubelet's `Unhealthy` and `Killing` Events, and on
deletion stops the process within the grace period and removes the pod. Stage pods
(`restartPolicy: Never`) keep kwok's status until their process exits.

A pod whose image is in `images` (the worker image `make images` built, in the e2e tier)
runs in a real container instead: podman and runc start it from that image with the pod's
securityContext, environment, emptyDir volumes and termination-message file
(harness/containers.py); `LocalPod.pid` is then its container's main process.

Nothing here is product code: it stands in for a kubelet and cluster DNS, which a real
cluster has. No library does this for kwok (kwok is built never to run containers).
On its own: `python -m relaytrain_testkit.harness.kwok_runner --kubeconfig K --workdir DIR`.
`selector` picks the pods it runs (default: stage pods, `relaytrain.io/job`).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kubernetes.client.exceptions import ApiException
from relaytrain_contract import CONFIG_ENV
from relaytrain_contract.exits import MESSAGE_LIMIT, TERMINATION_LOG_ENV
from relaytrain_contract.prefork import ForkedProcess, PreforkError, PreforkServer

from relaytrain_testkit.harness import containers, mount_ns
from relaytrain_testkit.harness.containers import ContainerConfigError
from relaytrain_testkit.harness.kubelet_volumes import (
    IssuedToken,
    MountError,
    pod_field,
    project_volumes,
    refresh_secret_volumes,
)
from relaytrain_testkit.harness.mount_ns import Mount
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.prefork_pods import SERVER, mounts_request
from relaytrain_testkit.harness.probes import ProbeLoop, probe_spec

JOB_LABEL = "relaytrain.io/job"
RESTARTING = ("Always", "OnFailure")
SECRET_SYNC_SECONDS = 1.0  # how often a running container's Secret volumes are read again
REQUEST_TIMEOUT = 10.0
"""Seconds a pass waits for the API server's answer to a read (urllib3 tries a read that
timed out three more times): a request with no timeout that got none would stop every pass,
and every pod's deletion with them."""
_SVC_ADDRESS = re.compile(r"^[a-z0-9.-]+\.svc(\.cluster\.local)?:\d+$")


@dataclass
class LocalPod:
    """One pod's local process."""

    namespace: str
    name: str
    uid: str
    process: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    metrics_port: int | None
    started_at: float = field(default_factory=time.time)
    restarts: int = 0
    """The container's restartCount when this process started."""
    grace: float = 30.0
    """The pod's terminationGracePeriodSeconds: its grace when the pod is gone from the API
    before the runner saw it terminating (kwok removes a deleted pod at once)."""
    ready: bool = False
    """The readiness probe's verdict (pods the runner keeps the status of)."""
    killed_by: str | None = None
    """Why the runner killed the process ("liveness", "startup"), if it did."""
    last_state: dict[str, Any] = field(default_factory=dict)
    """The previous container's end (lastState), once it was restarted."""
    probes: list[ProbeLoop] = field(default_factory=list)
    tokens: list[IssuedToken] = field(default_factory=list)
    tokens_at: float = field(default_factory=time.monotonic)
    secrets_at: float = field(default_factory=time.monotonic)
    """When its Secret volumes were last brought up to date."""
    mount_error: str | None = None
    """Why its Secret volumes could not be brought up to date last time, if they could not."""
    container: str | None = None
    """The podman container it runs in (harness/containers.py); None: a local process."""
    node: str | None = None
    """The node it runs on: a pod gone with its node dies with it, at once."""
    _pid: int | None = None

    @property
    def container_id(self) -> str:
        """What the pod's status says runs: the container, or the local process."""
        if self.container is not None:
            return f"podman://{self.container}"
        return f"local://{self.process.pid}"

    @property
    def pid(self) -> int:
        """The pid of the container's own process: the local process, or the main process
        of its container (podman's client is not it)."""
        if self.container is None:
            return self.process.pid
        if self._pid is None:
            self._pid = containers.pid(self.container)
            if self._pid is None:
                raise ProcessLookupError(f"container {self.container} is not running")
        return self._pid


@dataclass(frozen=True)
class _Restart:
    """A container that exited and will be started again (restartPolicy Always/OnFailure)."""

    count: int
    not_before: float
    last_state: dict[str, Any]


class KwokProcessRunner:
    """Polls the API server and keeps one local process per running relaytrain pod."""

    def __init__(
        self,
        api_client: Any,
        workdir: Path,
        namespace: str | None = None,
        selector: str = JOB_LABEL,
        images: frozenset[str] = frozenset(),
        registries: frozenset[str] = frozenset(),
    ) -> None:
        from urllib.parse import urlsplit

        from kubernetes import client

        self.core: Any = client.CoreV1Api(api_client)  # its objects are read as Any here
        self.selector = selector
        # Pods of these images, or of images in these registries (host:port; pulled first),
        # run in containers (harness/containers.py).
        self.images = images
        self.registries = registries
        server = urlsplit(api_client.configuration.host)
        self.service_env = {  # what a kubelet sets for the `kubernetes` Service
            "KUBERNETES_SERVICE_HOST": server.hostname or "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(server.port or 443),
        }
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.pods: dict[str, LocalPod] = {}  # by pod uid
        self.history: list[LocalPod] = []  # every process started, in order
        self.finished: dict[str, int] = {}  # pod uid -> exit code
        self.config_errors: dict[str, str] = {}  # pod uid -> why its container cannot start
        self.ports: dict[str, int] = {}  # stable DNS address -> loopback port
        self.ips: dict[str, str] = {}  # stable host name of a replica listener -> loopback IP
        self.hosts = self.workdir / "hosts"  # /etc/hosts of the stage containers: self.ips
        self.hosts.write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
        self._ip_base = random.randrange(2, 250)  # two runners at once draw apart
        self.errors: list[str] = []
        self._restarts: dict[str, _Restart] = {}  # by pod uid: containers waiting to restart
        self._ending: dict[str, threading.Thread] = {}  # by pod uid: processes being stopped
        self._held: set[tuple[str, str]] = set()  # (namespace, name prefix): `hold`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._forks = os.environ.get("RELAYTRAIN_PREFORK", "1") != "0"
        """Whether stage pods are forked from a prefork server (`_forked`)."""
        self._prefork: PreforkServer | None = None
        self._prefork_lock = threading.Lock()  # its start takes seconds: not under _lock
        self.passes = 0
        """Passes completed; a test that waits on the runner says it when it times out (a
        runner whose passes stopped is another fault than one that saw nothing)."""
        self.stalls: list[str] = []
        """Reads of a pass that got no answer in `REQUEST_TIMEOUT` seconds: retried on the
        next pass, as a kubelet retries; kept apart from `errors`."""

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kwok-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        with self._lock:
            for pod in list(self.pods.values()):
                for probe in pod.probes:
                    probe.stop()
                _stop(pod, why="the runner stops")
            self.pods.clear()
            ending = list(self._ending.values())
        for thread in ending:
            thread.join(timeout=30)
        with self._prefork_lock:
            server, self._prefork = self._prefork, None
        if server is not None:
            server.stop()

    def start_prefork(self) -> None:
        """Start the prefork server now rather than with the first stage pod (which would
        wait for its imports, seconds): for a test that times a job against another."""
        if self._forks:
            self._server()

    def _server(self) -> PreforkServer:
        with self._prefork_lock:
            if self._prefork is None:
                with (self.workdir / "prefork.log").open("ab") as own:
                    self._prefork = PreforkServer.start(_server_env(), log=own, module=SERVER)
            return self._prefork

    def _forked(
        self, argv: list[str], env: dict[str, str], cwd: Path, log: IO[bytes], mounts: list[Mount]
    ) -> ForkedProcess | None:
        """A stage pod's `python -m relaytrain_worker` forked from this runner's prefork
        server (prefork_pods.py: its volumes mounted as mount_ns.py mounts them), which
        starts with the first; None where it cannot (the pod then starts as a program)."""
        try:
            server = self._server()
            return server.spawn(
                argv[1:], env, cwd, stdout=log.fileno(), stderr=log.fileno(),
                extra=mounts_request(mounts),
            )  # fmt: skip
        except PreforkError as err:  # said where the runner's own output goes
            print(f"kwok runner: {err}; stage pods start as programs", file=sys.stderr)
            self._forks = False
            return None

    def _loop(self) -> None:
        from urllib3.exceptions import MaxRetryError
        from urllib3.exceptions import TimeoutError as RequestTimeout

        while not self._stop.is_set():
            try:
                self.sync()
                self.passes += 1
            except Exception as exc:  # a flaky list must not end the runner
                said = f"{type(exc).__name__}: {exc}"
                cause = exc.reason if isinstance(exc, MaxRetryError) else exc
                if isinstance(cause, RequestTimeout):  # no answer (urllib3 asked 4 times)
                    self.stalls.append(f"{time.strftime('%H:%M:%S')} {said}")
                else:
                    self.errors.append(said)
                print(f"kwok runner: {said}", file=sys.stderr)
            self._stop.wait(0.5)

    # -- what tests look at ------------------------------------------------------------
    def local_pod(self, namespace: str, name: str) -> LocalPod | None:
        with self._lock:
            for pod in self.pods.values():
                if pod.namespace == namespace and pod.name == name:
                    return pod
        return None

    def processes(self, namespace: str, prefix: str = "") -> list[str]:
        """The pods in `namespace` (named from `prefix`) whose process has not yet stopped.
        A pod's API object can go before its process does: kwok finalises the deletion of
        a pod whose process still has its grace period to run."""
        with self._lock:
            return sorted(
                p.name
                for p in self.pods.values()
                if p.namespace == namespace and p.name.startswith(prefix)
            )

    @contextlib.contextmanager
    def hold(self, namespace: str, prefix: str) -> Iterator[None]:
        """Within it, the pods in `namespace` named from `prefix` get no process, as a
        kubelet still pulling their image starts none: a test orders what follows (a job
        that would otherwise start, train and finish while the test still looks at what
        came before). Their processes start on the first pass after it."""
        with self._lock:
            self._held.add((namespace, prefix))
        try:
            yield
        finally:
            with self._lock:
                self._held.discard((namespace, prefix))

    def _is_held(self, pod: Any) -> bool:
        meta = pod.metadata
        with self._lock:
            return any(
                meta.namespace == ns and str(meta.name).startswith(prefix)
                for ns, prefix in self._held
            )

    def describe(self, local: LocalPod) -> str:
        """What the runner did and saw, for a test's message when a wait on it times out:
        its passes, stalled reads and errors, and what it did to `local`'s process."""
        kubelet = local.log_path.with_name("kubelet.log")
        did = kubelet.read_text().strip() if kubelet.exists() else "nothing"
        return (
            f"runner: {self.passes} passes, stalled reads {self.stalls}, errors {self.errors};"
            f" to {local.name}'s process (pid {local.process.pid}, exit"
            f" {local.process.poll()}): {did}"
        )

    def chronicle(self, namespace: str, prefix: str) -> str:
        """Every process started for the pods in `namespace` named from `prefix`, in order,
        one line each: when, the pod's uid and node, its exit (or "running"), what the
        runner did to it (kubelet.log) and its log's first and last lines — for a test's
        message when the processes a job ran are not the ones it expected."""
        with self._lock:
            started = [p for p in self.history if p.namespace == namespace]
        lines = []
        for p in started:
            if not p.name.startswith(prefix):
                continue
            code = p.process.poll()
            kubelet = p.log_path.with_name("kubelet.log")
            did = kubelet.read_text().strip().replace("\n", "; ") if kubelet.exists() else ""
            log = p.log_path.read_text(errors="replace").splitlines() if p.log_path.exists() else []
            said = [line for line in log if " relaytrain." in line] or log  # not urllib3's
            ends = [said[0][:200], said[-1][:200]] if said else []
            lines.append(
                f"{time.strftime('%H:%M:%S', time.localtime(p.started_at))} {p.name} "
                f"uid {p.uid[:8]} on {p.node} (restart {p.restarts}): "
                f"{'running' if code is None else f'exit {code}'}"
                f"{f', killed by {p.killed_by}' if p.killed_by else ''}"
                f"{f' [{did}]' if did else ''} | " + " ... ".join(ends)
            )
        return "\n".join(lines)

    # -- one pass ------------------------------------------------------------------------
    def sync(self) -> None:
        if self.namespace:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=self.selector, _request_timeout=REQUEST_TIMEOUT
            )
        else:
            pods = self.core.list_pod_for_all_namespaces(
                label_selector=self.selector, _request_timeout=REQUEST_TIMEOUT
            )
        seen = set()
        for pod in pods.items:
            uid = pod.metadata.uid
            seen.add(uid)
            with self._lock:
                local = self.pods.get(uid)
            if pod.metadata.deletion_timestamp is not None:
                remove = functools.partial(self._removed, pod) if _restarting(pod) else None
                if local:
                    grace = pod.metadata.deletion_grace_period_seconds
                    self._end(local, grace, then=remove, why=f"the pod was deleted (grace {grace})")
                elif remove is not None:
                    remove()
                continue
            if _restarting(pod):
                self._sync_restarting(pod, local)
            elif (
                local is None
                and uid not in self.finished
                and (pod.status.phase == "Running" or uid in self.config_errors)
                and not self._is_held(pod)
            ):
                if self._node_exists(pod.spec.node_name) and not self._address_held(pod):
                    self._try_start(pod)
            elif local is not None and local.process.poll() is not None:
                self._finish(pod, local)
            elif local is not None:
                self._refresh_volumes(pod, local)
        with self._lock:
            gone = [p for uid, p in self.pods.items() if uid not in seen]
        for local in gone:  # a node deleted: its pods' processes die with it, with no grace
            if self._node_exists(local.node):
                self._end(local, local.grace, why="the pod is gone from the API")
            else:
                self._end(local, 0, why=f"the pod is gone from the API, its node {local.node} too")

    def _end(
        self,
        local: LocalPod,
        grace: float | None,
        then: Callable[[], None] | None = None,
        why: str = "",
    ) -> None:
        """Stops a deleted pod's process (SIGTERM, SIGKILL after `grace`), then runs `then`,
        in a thread of its own, as a kubelet's pod workers do: a process that uses its grace
        period holds up neither the passes nor the deletion of any other pod (a stage asked
        to leave waits for its stage 0's SIGTERM). Once per process."""
        with self._lock:
            if local.uid in self._ending:
                return
            thread = threading.Thread(
                target=self._ended, args=(local, grace, then, why), name=f"end-{local.name}",
                daemon=True,
            )  # fmt: skip
            self._ending[local.uid] = thread
        thread.start()

    def _ended(
        self, local: LocalPod, grace: float | None, then: Callable[[], None] | None, why: str
    ) -> None:
        try:
            self._forget(local, kill=True, grace=local.grace if grace is None else grace, why=why)
            if then is not None:
                then()
        except Exception as exc:  # reported as a pass's error would be
            self.errors.append(f"stopping {local.name}: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._ending.pop(local.uid, None)

    def _removed(self, pod: Any) -> None:
        """A deleted pod whose containers restart, once its process stopped: never started
        again, and removed (its exit reads as the kubelet's SIGTERM unless it ended first)."""
        self._restarts.pop(pod.metadata.uid, None)
        self.finished.setdefault(pod.metadata.uid, -signal.SIGTERM)
        self._remove(pod)

    def _sync_restarting(self, pod: Any, local: LocalPod | None) -> None:
        """A pod whose container restarts: the runner is its kubelet from binding on."""
        uid = pod.metadata.uid
        if local is None:
            waiting = self._restarts.get(uid)
            if not pod.spec.node_name or uid in self.finished:
                return
            if not self._node_exists(pod.spec.node_name) or self._address_held(pod):
                return
            if self._is_held(pod):
                return
            if waiting is not None and time.monotonic() < waiting.not_before:
                return
            if waiting is None and uid not in self.config_errors:
                self._claim(pod)
            try:
                local = self._start(pod, restarts=waiting.count if waiting else 0)
            except (ContainerConfigError, MountError) as exc:
                self._hold(pod, exc)
                return
            self._restarts.pop(uid, None)
            self.config_errors.pop(uid, None)
            local.last_state = waiting.last_state if waiting else {}
            self._post_running(pod, local, first=True)
            # A startup probe holds the others off until it passes, as a kubelet's does.
            kinds = {p.spec.kind for p in local.probes}
            for probe in local.probes:
                if probe.spec.kind == "startup" or "startup" not in kinds:
                    probe.start()
        elif local.process.poll() is not None:
            code = _exit_code(local)
            if pod.spec.restart_policy == "OnFailure" and code == 0:
                self._finish(pod, local)
                return
            self._forget(local, kill=False, done=False)
            # The kubelet's back-off: at once the first time, then 10 s, 20 s, ... 5 min.
            delay = 0.0 if local.restarts == 0 else min(300.0, 10.0 * 2 ** (local.restarts - 1))
            reason = "Completed" if code == 0 else "Error"
            ended = _terminated(local, code, reason, pod.spec.containers[0])
            self._restarts[uid] = _Restart(
                local.restarts + 1, time.monotonic() + delay, {"terminated": ended}
            )
        else:
            self._refresh_volumes(pod, local)

    def _refresh_volumes(self, pod: Any, local: LocalPod) -> None:
        """What a kubelet keeps up to date in a running container's volumes: its Secret
        volumes follow their Secrets (rewritten only when the files would change), its
        projected tokens are renewed at 80% of their life. A Secret volume that cannot be
        brought up to date keeps its files and gets one `FailedMount` Event per reason."""
        now = time.monotonic()
        renew = bool(local.tokens) and now - local.tokens_at > 0.8 * min(
            t.seconds for t in local.tokens
        )
        if not renew and now - local.secrets_at < SECRET_SYNC_SECONDS:
            return
        container, root = pod.spec.containers[0], _pod_dir(self.workdir, pod)
        try:
            if renew:
                project_volumes(self.core, pod, container, root)
                local.tokens_at = now
            refresh_secret_volumes(self.core, pod, container, root)
        except MountError as exc:
            if local.mount_error != str(exc):
                self._event(pod, "Warning", exc.event_reason, str(exc))
            local.mount_error = str(exc)
        else:
            local.mount_error = None
        local.secrets_at = now

    def _node_exists(self, name: str | None) -> bool:
        """Whether a pod's node is there to run it. A pod bound to a node just deleted (a
        scheduler whose cache had not caught up, or kwok marking it Running first) has no
        kubelet: it never starts, as on a real cluster."""
        if not name:
            return False
        try:
            self.core.read_node(name, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _address_held(self, pod: Any) -> bool:
        """Whether an earlier pod of the same name still has a process (stopping within its
        grace): this runner's addresses and ports are a pod name's (its Service's DNS name),
        so a new pod's process would find them taken, where a kubelet's pod gets an IP of its
        own. Its start waits, as for an IP, until that process is gone."""
        meta = pod.metadata
        with self._lock:
            return any(
                p.namespace == meta.namespace and p.name == meta.name and p.uid != meta.uid
                for p in self.pods.values()
            )

    def _try_start(self, pod: Any) -> None:
        """Start a stage pod's container, or, while it cannot start, hold it (`_hold`),
        tried again on every pass until the Secret appears."""
        uid = pod.metadata.uid
        try:
            local = self._start(pod)
        except (ContainerConfigError, MountError) as exc:
            self._hold(pod, exc)
            return
        if self.config_errors.pop(uid, None) is not None:
            local.ready = True  # no probe runs for such pods; kwok would have said Ready
            self._post_running(pod, local, first=True)

    def _hold(self, pod: Any, exc: ContainerConfigError | MountError) -> None:
        """A container that cannot start, held as a kubelet holds it: Pending, the container
        Waiting with the kubelet's reason and message, one Warning Event per message — a
        missing Secret or key of the environment is CreateContainerConfigError and `Failed`,
        one of a Secret volume ContainerCreating and `FailedMount`."""
        uid = pod.metadata.uid
        if self.config_errors.get(uid) == str(exc):
            return
        self.config_errors[uid] = str(exc)
        self._claim(pod)
        self._post_waiting(pod, exc.reason, str(exc))
        if isinstance(exc, MountError):
            self._event(pod, "Warning", exc.event_reason, str(exc))
        else:
            self._event(pod, "Warning", "Failed", f"Error: {exc}")

    def _post_waiting(self, pod: Any, reason: str, message: str) -> None:
        container = pod.spec.containers[0]
        status = {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "False", "lastTransitionTime": _now()},
            ],
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image,
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
            ],
        }
        with contextlib.suppress(ApiException):  # a pod deleted meanwhile needs no status
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, {"status": status}
            )

    def _claim(self, pod: Any) -> None:
        # kwok leaves the status of pods annotated so to whoever posts it (here, us).
        self.core.patch_namespaced_pod(
            pod.metadata.name,
            pod.metadata.namespace,
            {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}},
        )

    def _post_running(self, pod: Any, local: LocalPod, first: bool = False) -> None:
        """The status a kubelet posts for a running container; Ready as its probe says."""
        container = pod.spec.containers[0]
        now = _now()
        ready = "True" if local.ready else "False"
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(local.started_at))
        status: dict[str, Any] = {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image,
                    "imageID": "",
                    "containerID": local.container_id,
                    "ready": local.ready,
                    "started": True,
                    "restartCount": local.restarts,
                    "state": {"running": {"startedAt": started}},
                    # The list is replaced as a whole by a patch: every post says it all.
                    "lastState": local.last_state,
                }
            ],
        }
        if first and pod.status.start_time is None:
            status["startTime"] = now
        try:
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, {"status": status}
            )
        except ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile needs no status
                self.errors.append(f"posting the status of {pod.metadata.name}: {exc}")

    def _probe_changed(self, pod: Any, local: LocalPod, kind: str, ok: bool, why: str) -> None:
        """A probe's verdict changed: Ready follows readiness; a passed startup probe starts
        the others; failed liveness or startup restarts the container."""
        container = pod.spec.containers[0].name
        if not ok:
            self._event(pod, "Warning", "Unhealthy", f"{kind.capitalize()} probe failed: {why}")
        if kind == "startup" and ok:
            for probe in local.probes:
                if probe.spec.kind == "startup":
                    probe.stop()
                elif local.process.poll() is None:
                    probe.start()
        elif kind == "readiness":
            with self._lock:
                if self.pods.get(local.uid) is not local or local.process.poll() is not None:
                    return
                local.ready = ok
            self._post_running(pod, local)
        elif not ok:
            self._event(
                pod,
                "Normal",
                "Killing",
                f"Container {container} failed {kind} probe, will be restarted",
            )
            local.killed_by = kind
            for probe in local.probes:
                if probe.spec.kind != kind:
                    probe.stop()
            _stop(local, grace=_grace(pod), why=f"its {kind} probe failed")

    def _event(self, pod: Any, type: str, reason: str, message: str) -> None:
        """An Event on the pod, from the kubelet, as `kubectl describe pod` shows them."""
        now = _now()
        container = pod.spec.containers[0].name
        event = {
            "metadata": {
                "generateName": f"{pod.metadata.name}.",
                "namespace": pod.metadata.namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": pod.metadata.namespace,
                "name": pod.metadata.name,
                "uid": pod.metadata.uid,
                "fieldPath": f"spec.containers{{{container}}}",
            },
            "type": type,
            "reason": reason,
            "message": message,
            "source": {"component": "kubelet", "host": pod.spec.node_name or ""},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(pod.metadata.namespace, event)
        except Exception as exc:  # an Event is best effort, as the kubelet's are
            self.errors.append(f"posting {reason} on {pod.metadata.name}: {exc}")

    def _remove(self, pod: Any) -> None:
        """The kubelet's last word on a deleted pod whose containers stopped: remove it."""
        try:
            # In the body: a body's options replace the query's.
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": pod.metadata.uid}},
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _start(self, pod: Any, restarts: int = 0) -> LocalPod:
        container = pod.spec.containers[0]
        tmp = _pod_dir(self.workdir, pod)
        tmp.mkdir(parents=True, exist_ok=True)
        in_container = container.image in self.images or containers.in_registry(
            container.image, self.registries
        )
        if in_container and containers.in_registry(container.image, self.registries):
            containers.pull(container.image)
        env = {
            **({} if in_container else _base_env()),
            **self.service_env,
            **self._resolve_env(pod, container.env or []),
        }
        metrics_port = None
        replicas = False
        if CONFIG_ENV in env:
            env[CONFIG_ENV], metrics_port = self._rewrite_config(pod, env[CONFIG_ENV])
            replicas = bool(json.loads(env[CONFIG_ENV]).get("replicas"))
        mounts, tokens = project_volumes(self.core, pod, container, tmp)
        if replicas:  # peers it learns of later (the store's fleet.json) go by name
            mounts.append(Mount(self.hosts, "/etc/hosts", read_only=True))
        termination_log = tmp / "termination-log"  # a fresh file for each container start
        name = None
        forked = False
        if in_container:
            launch = containers.launch(pod, env, tmp, mounts, termination_log)
            argv, env, name = launch.argv, launch.env, launch.name
            plain = argv
            containers.remove(name)  # one left by a runner that was stopped hard
        else:
            argv = list(container.command or []) + list(container.args or [])
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            forked = argv[:3] == [sys.executable, "-m", "relaytrain_worker"] and self._forks
            plain = mount_ns.command(argv, mounts)  # if it is not forked
            env["TMPDIR"] = str(tmp)
            env["HOME"] = str(tmp)
            if container.termination_message_path:
                env[TERMINATION_LOG_ENV] = str(termination_log)
                termination_log.write_bytes(b"")
        log_path = tmp / "container.log"
        with log_path.open("ab") as log:
            if restarts:
                log.write(f"--- kwok runner: restart {restarts}\n".encode())
                log.flush()
            process = (forked and self._forked(argv, env, tmp, log, mounts)) or subprocess.Popen(
                plain,
                env=env,
                cwd=tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        local = LocalPod(
            pod.metadata.namespace,
            pod.metadata.name,
            pod.metadata.uid,
            process,
            log_path,
            metrics_port,
            restarts=restarts,
            grace=_grace(pod),
            tokens=tokens,
            container=name,
            node=pod.spec.node_name,
        )
        if _restarting(pod):
            for kind, probe in (
                ("startup", container.startup_probe),
                ("liveness", container.liveness_probe),
                ("readiness", container.readiness_probe),
            ):
                if probe is not None:
                    local.probes.append(
                        ProbeLoop(
                            probe_spec(kind, probe, container),
                            functools.partial(self._probe_changed, pod, local, kind),
                            pod.metadata.name,
                        )
                    )
            local.ready = container.readiness_probe is None
        with self._lock:
            self.pods[pod.metadata.uid] = local
            self.history.append(local)
        return local

    def _finish(self, pod: Any, local: LocalPod) -> None:
        code = _exit_code(local)
        self._forget(local, kill=False)
        phase = "Succeeded" if code == 0 else "Failed"
        reason = "Completed" if code == 0 else ("OOMKilled" if code == -9 else "Error")
        now = _now()
        name = pod.spec.containers[0].name
        # kwok leaves the status of pods annotated so to whoever posts it (here, us).
        self.core.patch_namespaced_pod(
            pod.metadata.name,
            pod.metadata.namespace,
            {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}},
        )
        self.core.patch_namespaced_pod_status(
            pod.metadata.name,
            pod.metadata.namespace,
            {
                "status": {
                    "phase": phase,
                    "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                    "containerStatuses": [
                        {
                            "name": name,
                            "ready": False,
                            "restartCount": 0,
                            "image": pod.spec.containers[0].image,
                            "imageID": "",
                            "state": {
                                "terminated": _terminated(
                                    local, code, reason, pod.spec.containers[0]
                                )
                            },
                        }
                    ],
                }
            },
        )

    def _forget(
        self,
        local: LocalPod,
        *,
        kill: bool,
        grace: float | None = None,
        done: bool = True,
        why: str = "",
    ) -> None:
        for probe in local.probes:
            probe.stop()
        if kill:
            _stop(local, grace=10 if grace is None else grace, why=why)
        with self._lock:
            if self.pods.get(local.uid) is local:
                self.pods.pop(local.uid, None)
        # The exit code stays readable: 0 when the process ended by itself, -15 when the
        # pod's deletion stopped it, as a kubelet's SIGTERM would.
        if done:
            self.finished[local.uid] = _exit_code(local)

    # -- env and addresses ------------------------------------------------------------
    def _resolve_env(self, pod: Any, env: list[Any]) -> dict[str, str]:
        """The container's environment; ContainerConfigError, in the kubelet's words, when
        a Secret or ConfigMap (or a key of one) it names is missing."""
        out: dict[str, str] = {}
        ns = pod.metadata.namespace
        for var in env:
            if var.value is not None:
                out[var.name] = var.value
            elif var.value_from is not None:
                src = var.value_from
                if src.secret_key_ref is not None:
                    ref = src.secret_key_ref
                    data = self._read(self.core.read_namespaced_secret, "secret", ref.name, ns)
                    if ref.key not in data:
                        raise ContainerConfigError(
                            f"couldn't find key {ref.key} in Secret {ns}/{ref.name}"
                        )
                    out[var.name] = base64.b64decode(data[ref.key]).decode()
                elif src.config_map_key_ref is not None:
                    ref = src.config_map_key_ref
                    data = self._read(
                        self.core.read_namespaced_config_map, "configmap", ref.name, ns
                    )
                    if ref.key not in data:
                        raise ContainerConfigError(
                            f"couldn't find key {ref.key} in ConfigMap {ns}/{ref.name}"
                        )
                    out[var.name] = data[ref.key]
                elif src.field_ref is not None:
                    out[var.name] = pod_field(pod, src.field_ref.field_path)
        return out

    @staticmethod
    def _read(read: Any, kind: str, name: str, namespace: str) -> dict[str, str]:
        try:
            return dict(read(name, namespace).data or {})
        except ApiException as exc:
            if exc.status == 404:
                raise ContainerConfigError(f'{kind} "{name}" not found') from None
            raise

    def port_for(self, address: str) -> int:
        """The loopback port standing in for a stable pod address."""
        with self._lock:
            if address not in self.ports:
                self.ports[address] = free_port()
            return self.ports[address]

    def ip_for(self, host: str) -> str:
        """The loopback address standing in for the pod IP behind a stable host name, which
        `hosts` (the stage containers' /etc/hosts) then names: each replica listener binds
        its own at the port its document says, so an address read later from the job's
        store (a pipeline added: fleet.json) reaches it by name, as cluster DNS would."""
        with self._lock:
            if host not in self.ips:
                n = len(self.ips)
                ip = f"127.{self._ip_base}.{n // 250}.{n % 250 + 1}"
                self.ips[host] = ip
                # One appended line: a reader of the bind-mounted file sees it whole or not.
                with self.hosts.open("a") as hosts:
                    hosts.write(f"{ip} {host}\n")
            return self.ips[host]

    def _rewrite_config(self, pod: Any, raw: str) -> tuple[str, int | None]:
        doc = json.loads(raw)
        ns = pod.metadata.namespace
        own = f"{pod.spec.hostname}.{pod.spec.subdomain}.{ns}.svc"
        links = doc.get("links") or {}
        if links.get("listen"):
            port = links["listen"].rsplit(":", 1)[1]
            links["listen"] = f"127.0.0.1:{self.port_for(f'{own}:{port}')}"
        if links.get("next") and _SVC_ADDRESS.match(links["next"]):
            links["next"] = f"127.0.0.1:{self.port_for(links['next'])}"
        # Several pipelines: this stage's replica listener and its peers' (stable names too).
        replicas = doc.get("replicas") or {}
        if replicas.get("listen"):
            port = replicas["listen"].rsplit(":", 1)[1]
            replicas["listen"] = f"{self.ip_for(own)}:{port}"
        for peer in replicas.get("peers") or []:
            if peer.get("address") and _SVC_ADDRESS.match(peer["address"]):
                host, port = peer["address"].rsplit(":", 1)
                peer["address"] = f"{self.ip_for(host)}:{port}"
        metrics_port = None
        obs = doc.get("observability")
        if isinstance(obs, dict) and obs.get("port"):
            metrics_port = self.port_for(f"{own}:{obs['port']}")
            obs["port"] = metrics_port
        return json.dumps(doc), metrics_port


def _restarting(pod: Any) -> bool:
    return (pod.spec.restart_policy or "Always") in RESTARTING


def _pod_dir(workdir: Path, pod: Any) -> Path:
    """The pod's own folder: its TMPDIR and HOME, its volumes and its container's log."""
    meta = pod.metadata
    return workdir / str(meta.namespace) / str(meta.name) / str(meta.uid)[:8]


def _grace(pod: Any) -> float:
    seconds = pod.spec.termination_grace_period_seconds
    return 30.0 if seconds is None else float(seconds)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _terminated(local: LocalPod, code: int, reason: str, container: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "exitCode": code if code >= 0 else 128 - code,
        "reason": reason,
        "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(local.started_at)),
        "finishedAt": _now(),
    }
    message = _termination_message(local, code, container)
    if message:
        out["message"] = message
    return out


def _termination_message(local: LocalPod, code: int, container: Any) -> str:
    """What a kubelet reports as the container's termination message: the file at its
    terminationMessagePath (at most 4096 bytes); with `FallbackToLogsOnError`, after a
    failure that left it empty, the last 80 lines of its log (at most 2048 bytes)."""
    if not container.termination_message_path:
        return ""
    path = local.log_path.parent / "termination-log"
    with contextlib.suppress(OSError):
        written = path.read_bytes()[:MESSAGE_LIMIT]
        if written:
            return written.decode(errors="replace")
    if code == 0 or container.termination_message_policy != "FallbackToLogsOnError":
        return ""
    with contextlib.suppress(OSError):
        tail = b"\n".join(local.log_path.read_bytes().splitlines()[-80:])
        return tail[-2048:].decode(errors="replace")
    return ""


def _server_env() -> dict[str, str]:
    """The prefork server's: the stages' base environment, with the test kit importable
    (pytest puts it on the path, not in PYTHONPATH)."""
    env = _base_env()
    kit = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (kit, env.get("PYTHONPATH", "")) if p)
    return env


def _base_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "RELAYTRAIN_CACHE", "OMP_NUM_THREADS", "PYTHONPATH",
            "RELAYTRAIN_LOG_LEVEL")  # a test may ask for the stages' debug lines  # fmt: skip
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")  # several stages share a few cores
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop(local: LocalPod, grace: float = 10, why: str = "") -> None:
    """Stops a pod's process, and removes its container if it has one (a container whose
    podman client had to be killed would be left running). `kubelet.log`, beside the
    container's log, says when the runner signalled it, how and, where given, `why` (a
    stage that ended without a word of its own was killed by it, or crashed)."""

    def said(line: str) -> None:
        with (
            contextlib.suppress(OSError),
            local.log_path.with_name("kubelet.log").open("ab") as log,
        ):
            log.write(f"--- kwok runner {time.strftime('%H:%M:%S')}: {line}\n".encode())

    if local.process.poll() is None:
        how = f"SIGTERM (grace {grace:g} s)" if grace > 0 else "SIGKILL (grace 0)"
        said(f"{how}: {why}" if why else how)
        if _kill(local.process, grace=grace) and grace > 0:
            said(f"SIGKILL: still running {grace:g} s after SIGTERM")
    if local.container is not None:
        containers.remove(local.container)


def _exit_code(local: LocalPod) -> int:
    """The exit code of a pod's process that has ended (polled, or stopped and waited for;
    a forked one's comes from its server)."""
    code = local.process.returncode
    return int(code) if code is not None else local.process.wait(timeout=10)


def _kill(process: subprocess.Popen[bytes] | ForkedProcess, grace: float = 10) -> bool:
    """SIGTERM to the process group, SIGKILL after `grace` seconds (a stopped process
    keeps a SIGTERM pending, as a container's would: SIGKILL ends it; no grace: SIGKILL
    alone). True when it took the SIGKILL."""
    if process.poll() is not None:
        return False
    try:
        if grace <= 0:
            raise ProcessLookupError  # straight to the SIGKILL
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
        return False
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        return True


def main() -> int:
    import argparse

    from kubernetes import config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    api = config.new_client_from_config(args.kubeconfig)  # type: ignore[no-untyped-call]
    runner = KwokProcessRunner(api, Path(args.workdir))
    runner.start()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
