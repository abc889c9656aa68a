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
  as DNS would give it), and the stage contract document is rewritten to use them;
- when the process exits the pod's status is posted as a kubelet would (Succeeded or
  Failed with the exit code); a pod that is deleted has its process killed.

Nothing here is product code: it stands in for a kubelet and cluster DNS, which a real
cluster has. No library does this for kwok (kwok is built never to run containers).
On its own: `python -m tests.harness.kwok_runner --kubeconfig K --workdir DIR`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaytrain_contract import CONFIG_ENV

from tests.harness.ports import free_port

JOB_LABEL = "relaytrain.io/job"
_SVC_ADDRESS = re.compile(r"^[a-z0-9.-]+\.svc(\.cluster\.local)?:\d+$")


@dataclass
class LocalPod:
    """One pod's local process."""

    namespace: str
    name: str
    uid: str
    process: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int | None
    started_at: float = field(default_factory=time.time)


class KwokProcessRunner:
    """Polls the API server and keeps one local process per running relaytrain pod."""

    def __init__(self, api_client: Any, workdir: Path, namespace: str | None = None) -> None:
        from kubernetes import client

        self.core: Any = client.CoreV1Api(api_client)  # its objects are read as Any here
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.pods: dict[str, LocalPod] = {}  # by pod uid
        self.history: list[LocalPod] = []  # every process started, in order
        self.finished: dict[str, int] = {}  # pod uid -> exit code
        self.ports: dict[str, int] = {}  # stable DNS address -> loopback port
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

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
                _kill(pod.process)
            self.pods.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # a flaky list must not end the runner
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.5)

    # -- what tests look at ------------------------------------------------------------
    def local_pod(self, namespace: str, name: str) -> LocalPod | None:
        with self._lock:
            for pod in self.pods.values():
                if pod.namespace == namespace and pod.name == name:
                    return pod
        return None

    # -- one pass ------------------------------------------------------------------------
    def sync(self) -> None:
        if self.namespace:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=JOB_LABEL).items
        else:
            pods = self.core.list_pod_for_all_namespaces(label_selector=JOB_LABEL).items
        seen = set()
        for pod in pods:
            uid = pod.metadata.uid
            seen.add(uid)
            with self._lock:
                local = self.pods.get(uid)
            if pod.metadata.deletion_timestamp is not None:
                if local:
                    self._forget(local, kill=True)
                continue
            if local is None and uid not in self.finished and pod.status.phase == "Running":
                self._start(pod)
            elif local is not None and local.process.poll() is not None:
                self._finish(pod, local)
        with self._lock:
            gone = [p for uid, p in self.pods.items() if uid not in seen]
        for local in gone:
            self._forget(local, kill=True)

    def _start(self, pod: Any) -> None:
        container = pod.spec.containers[0]
        env = {**_base_env(), **self._resolve_env(pod, container.env or [])}
        metrics_port = None
        if CONFIG_ENV in env:
            env[CONFIG_ENV], metrics_port = self._rewrite_config(pod, env[CONFIG_ENV])
        argv = list(container.command or []) + list(container.args or [])
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        tmp = self.workdir / pod.metadata.namespace / pod.metadata.name / pod.metadata.uid[:8]
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
        env["HOME"] = str(tmp)
        log_path = tmp / "container.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
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
        )
        with self._lock:
            self.pods[pod.metadata.uid] = local
            self.history.append(local)

    def _finish(self, pod: Any, local: LocalPod) -> None:
        code = local.process.returncode
        self._forget(local, kill=False)
        phase = "Succeeded" if code == 0 else "Failed"
        reason = "Completed" if code == 0 else ("OOMKilled" if code == -9 else "Error")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        exit_code = code if code >= 0 else 128 - code
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
                                "terminated": {
                                    "exitCode": exit_code,
                                    "reason": reason,
                                    "finishedAt": now,
                                    "startedAt": time.strftime(
                                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(local.started_at)
                                    ),
                                }
                            },
                        }
                    ],
                }
            },
        )

    def _forget(self, local: LocalPod, *, kill: bool) -> None:
        if kill:
            _kill(local.process)
        with self._lock:
            self.pods.pop(local.uid, None)
        # The exit code stays readable: 0 when the process ended by itself, -15 when the
        # pod's deletion stopped it, as a kubelet's SIGTERM would.
        self.finished[local.uid] = local.process.returncode

    # -- env and addresses ------------------------------------------------------------
    def _resolve_env(self, pod: Any, env: list[Any]) -> dict[str, str]:
        out: dict[str, str] = {}
        for var in env:
            if var.value is not None:
                out[var.name] = var.value
            elif var.value_from is not None:
                src = var.value_from
                if src.secret_key_ref is not None:
                    secret = self.core.read_namespaced_secret(
                        src.secret_key_ref.name, pod.metadata.namespace
                    )
                    out[var.name] = base64.b64decode(secret.data[src.secret_key_ref.key]).decode()
                elif src.config_map_key_ref is not None:
                    cm = self.core.read_namespaced_config_map(
                        src.config_map_key_ref.name, pod.metadata.namespace
                    )
                    out[var.name] = cm.data[src.config_map_key_ref.key]
                elif src.field_ref is not None:
                    out[var.name] = _field(pod, src.field_ref.field_path)
        return out

    def port_for(self, address: str) -> int:
        """The loopback port standing in for a stable pod address."""
        with self._lock:
            if address not in self.ports:
                self.ports[address] = free_port()
            return self.ports[address]

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
            replicas["listen"] = f"127.0.0.1:{self.port_for(f'{own}:{port}')}"
        for peer in replicas.get("peers") or []:
            if peer.get("address") and _SVC_ADDRESS.match(peer["address"]):
                peer["address"] = f"127.0.0.1:{self.port_for(peer['address'])}"
        metrics_port = None
        obs = doc.get("observability")
        if isinstance(obs, dict) and obs.get("port"):
            metrics_port = self.port_for(f"{own}:{obs['port']}")
            obs["port"] = metrics_port
        return json.dumps(doc), metrics_port


def _field(pod: Any, path: str) -> str:
    values = {
        "metadata.name": pod.metadata.name,
        "metadata.namespace": pod.metadata.namespace,
        "metadata.uid": pod.metadata.uid,
        "spec.nodeName": pod.spec.node_name or "",
        "status.podIP": "127.0.0.1",
    }
    return str(values.get(path, ""))


def _base_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "RELAYTRAIN_CACHE", "OMP_NUM_THREADS", "PYTHONPATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")  # several stages share a few cores
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


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
