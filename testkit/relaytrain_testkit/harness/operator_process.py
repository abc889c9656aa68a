"""The operator as users start it (`python -m relaytrain_operator`), as a child process with
its Prometheus /metrics on a free port, and what those metrics say.

The per-job pass counter (`relaytrain_reconcile_passes_total`) is how a test knows the
operator looked at a job again: "nothing changes" is checked after N more passes of the
job, not after a guessed sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from relaytrain_testkit import REPO
from relaytrain_testkit.harness import procs
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.waiting import wait_for

PASSES = "relaytrain_reconcile_passes_total"


class OperatorProcess:
    """`python -m relaytrain_operator ARGS --metrics-port PORT`, its output in `log`."""

    def __init__(self, kubeconfig: Path | str, log: Path, *args: str) -> None:
        self.kubeconfig = kubeconfig
        self.log = log
        self.args = args
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        """Starts it (again: a restart keeps the port) and waits until /metrics answers."""
        env = {
            # The test cluster's GPUs are simulated: stages compute on this machine's CPU.
            "RELAYTRAIN_WORKER_DEVICE": "cpu",
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO)]),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "relaytrain_operator", *self.args]
        argv += ["--metrics-port", str(self.metrics_port)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for("the operator's metrics endpoint", self._metrics_up, timeout=timeout)
        except AssertionError as err:
            self.stop()
            raise AssertionError(f"{err}\nThe operator's log ends:\n{self.tail()}") from None

    def _metrics_up(self) -> bool:
        if not self.alive():
            raise AssertionError(f"the operator exited ({self.returncode()})")
        try:
            self.metrics()
        except OSError:
            return False
        return True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a node dies under the operator."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, as Kubernetes stops a pod; SIGKILL if it has not exited in 15 s."""
        if self.proc is not None:
            procs.stop(self.proc, grace=15)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of /metrics now: (name, labels) → value."""
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(self.metrics())
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample's value now; None when the operator does not report it."""
        return self.samples().get((name, frozenset(labels.items())))

    def passes(self, namespace: str, job: str) -> int:
        """Finished reconcile passes of the job since this operator process started."""
        return int(self.samples().get((PASSES, _labels(namespace, job)), 0))

    def wait_for_passes(self, namespace: str, *jobs: str, more: int, timeout: float = 60) -> None:
        """Waits until the operator has finished `more` passes of each job that began after
        this call (the pass under way now may have read the cluster before the caller
        looked, so it does not count)."""

        def counts() -> dict[str, int]:
            samples = self.samples()
            return {job: int(samples.get((PASSES, _labels(namespace, job)), 0)) for job in jobs}

        want = {job: n + more + 1 for job, n in counts().items()}
        wait_for(
            f"{more} more passes of {', '.join(jobs)} in {namespace}",
            lambda: all(n >= want[job] for job, n in counts().items()),
            timeout=timeout,
        )

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _labels(namespace: str, job: str) -> frozenset[tuple[str, str]]:
    return frozenset({"namespace": namespace, "finetunejob": job}.items())
