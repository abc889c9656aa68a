"""A kubelet's container probes, for the kwok process runner.

`ProbeLoop` runs one probe (startup, liveness or readiness) of one running container as a kubelet
does: after `initialDelaySeconds`, every `periodSeconds`, a check that fails when it takes
longer than `timeoutSeconds`; `failureThreshold` failures in a row make the probe fail,
`successThreshold` successes make it pass again. What a result means is the caller's:
the runner flips the pod's Ready condition on readiness, starts the other two once startup
passes, and restarts the container when liveness or startup fails, as a kubelet would.
HTTP GET and TCP probes (what our pods use); an exec probe is reported as failing, with a
message that says it is not supported here.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProbeSpec:
    """The fields of a Kubernetes probe the runner acts on, with Kubernetes' defaults."""

    kind: str  # "startup", "liveness" or "readiness"
    check: Callable[[float], str | None]  # timeout → None when healthy, else why not
    initial_delay: float = 0
    period: float = 10
    timeout: float = 1
    failure_threshold: int = 3
    success_threshold: int = 1


def probe_spec(kind: str, probe: Any, container: Any) -> ProbeSpec:
    """A ProbeSpec from the client's V1Probe of `container` (its ports resolve names)."""
    ports = {p.name: p.container_port for p in container.ports or [] if p.name}
    if probe.http_get is not None:
        get = probe.http_get
        port = ports[get.port] if isinstance(get.port, str) and not get.port.isdigit() else get.port
        check = _http_check(get.host or "127.0.0.1", int(port), get.path or "/")
    elif probe.tcp_socket is not None:
        tcp = probe.tcp_socket
        port = ports[tcp.port] if isinstance(tcp.port, str) and not tcp.port.isdigit() else tcp.port
        check = _tcp_check(tcp.host or "127.0.0.1", int(port))
    else:

        def check(timeout: float) -> str | None:
            return "only httpGet and tcpSocket probes are run by the kwok process runner"

    return ProbeSpec(
        kind=kind,
        check=check,
        initial_delay=float(probe.initial_delay_seconds or 0),
        period=float(probe.period_seconds or 10),
        timeout=float(probe.timeout_seconds or 1),
        failure_threshold=int(probe.failure_threshold or 3),
        success_threshold=int(probe.success_threshold or 1),
    )


def _http_check(host: str, port: int, path: str) -> Callable[[float], str | None]:
    def check(timeout: float) -> str | None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", path, headers={"User-Agent": "kube-probe/kwok-runner"})
            status = conn.getresponse().status
        except OSError as err:  # refused, reset, or timed out
            return f'Get "http://{host}:{port}{path}": {err or type(err).__name__}'
        finally:
            conn.close()
        if 200 <= status < 400:
            return None
        return f"HTTP probe failed with statuscode: {status}"

    return check


def _tcp_check(host: str, port: int) -> Callable[[float], str | None]:
    def check(timeout: float) -> str | None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as err:
            return f"dial tcp {host}:{port}: {err}"
        return None

    return check


class ProbeLoop:
    """Runs `spec` in a thread until stopped; calls `on_change(passing, message)` each time
    the probe's verdict changes (the first verdict included), never from two threads."""

    def __init__(
        self, spec: ProbeSpec, on_change: Callable[[bool, str], None], name: str = ""
    ) -> None:
        self.spec = spec
        self.on_change = on_change
        self.passing: bool | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._thread = threading.Thread(
            target=self._run, name=f"probe-{spec.kind}-{name}", daemon=True
        )

    def start(self) -> None:
        """Starts the thread (once; a later call, or one after `stop`, does nothing)."""
        with self._lock:
            if self._started or self._stop.is_set():
                return
            self._started = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.spec.timeout + 5)

    def _run(self) -> None:
        spec = self.spec
        if self._stop.wait(spec.initial_delay):
            return
        failures = successes = 0
        while not self._stop.is_set():
            problem = spec.check(spec.timeout)
            if problem is None:
                successes, failures = successes + 1, 0
                if self.passing is not True and successes >= spec.success_threshold:
                    self._verdict(True, "")
            else:
                successes, failures = 0, failures + 1
                if self.passing is not False and failures >= spec.failure_threshold:
                    self._verdict(False, problem)
            if self._stop.wait(spec.period):
                return

    def _verdict(self, passing: bool, message: str) -> None:
        self.passing = passing
        if not self._stop.is_set():
            self.on_change(passing, message)
