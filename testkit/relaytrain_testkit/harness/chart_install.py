"""The operator as users install it: `helm install` of charts/relaytrain, its pod run by
the kwok process runner as the chart's ServiceAccount.

`ChartRelease` installs, upgrades and uninstalls one release with the real helm (the
pinned build in the cache, or RELAYTRAIN_HELM), and runs the release's operator pod:
a `KwokProcessRunner` that runs only the pods of that release's Deployment. The chart's
command is `python -m relaytrain_operator`; the runner starts it with this checkout's
interpreter (the venv, where the operator is installed editable), so the operator that
runs is this checkout's, in the in-cluster environment a kubelet gives (a bound token of
the chart's ServiceAccount, the CA, KUBERNETES_SERVICE_HOST/PORT) and no kubeconfig.

`python -m relaytrain_testkit.harness.chart_install VERB RESOURCE[.GROUP]` is a helm post-renderer
(`--post-renderer`): it reads the rendered manifests and writes them back without that one
grant in any (Cluster)Role, which is how a test shows what a missing grant does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from relaytrain_testkit import REPO
from relaytrain_testkit.harness.kwok_runner import KwokProcessRunner, LocalPod
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.waiting import wait_for

CHART = REPO / "charts" / "relaytrain"


def helm_binary() -> Path:
    """RELAYTRAIN_HELM, else the bootstrap's pinned build in the cache."""
    if os.environ.get("RELAYTRAIN_HELM"):
        return Path(os.environ["RELAYTRAIN_HELM"])
    from hack import toolpaths

    return toolpaths.binary("helm")


def restricted_namespace(core: Any, name: str) -> str:
    """A namespace whose pods must meet the Pod Security Standard `restricted`, enforced by
    the API server's PodSecurity admission."""
    core.create_namespace(
        {
            "metadata": {
                "name": name,
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                },
            }
        }
    )
    wait_for(
        f"the default ServiceAccount of {name}",
        lambda: (
            core.list_namespaced_service_account(name, field_selector="metadata.name=default").items
        ),
    )
    return name


def chart_values(jobs_namespace: str) -> dict[str, Any]:
    """Values for a release under test (and the demo): its jobs' namespace, free ports (the
    operator process listens on this machine), and probes quick enough to see them act."""
    return {
        "watchNamespaces": [jobs_namespace],
        # The nodes' GPUs are simulated (kwok's capacity, the real kubelet's extended
        # resource): stages compute on this machine's CPU.
        "workerDevice": "cpu",
        "resyncSeconds": 1,
        # The test kubelet refreshes a mounted Secret every second (a real one within a
        # minute or so: the chart's default is 90).
        "secretPropagationSeconds": 3,
        # A tiny model's pipeline loads and rejoins in seconds (a real one's in minutes).
        "joinSeconds": 5,
        "metrics": {"port": free_port()},
        "healthPort": free_port(),
        "probes": {
            # However slow this machine is to start Python, liveness waits for startup.
            "startup": {
                "initialDelaySeconds": 0,
                "periodSeconds": 1,
                "timeoutSeconds": 5,
                "failureThreshold": 120,
            },
            "liveness": {
                "initialDelaySeconds": 0,
                "periodSeconds": 2,
                "timeoutSeconds": 2,
                "failureThreshold": 3,
            },
            "readiness": {
                "initialDelaySeconds": 0,
                "periodSeconds": 1,
                "timeoutSeconds": 1,
                "failureThreshold": 1,
            },
        },
        "terminationGracePeriodSeconds": 5,
    }


@dataclass
class ChartRelease:
    """One release of the chart in `namespace`, installed with `kubeconfig` (admin)."""

    name: str
    namespace: str
    kubeconfig: Path
    api_client: Any
    workdir: Path
    runner: KwokProcessRunner | None = field(default=None, init=False)

    # --- helm ---------------------------------------------------------------------------
    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            # The post-renderer is a module of this harness (which imports hack/).
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), str(REPO / "testkit"), os.environ.get("PYTHONPATH", "")]
            ),
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }
        proc = subprocess.run(
            [str(helm_binary()), *args, "--namespace", self.namespace],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env=env,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
                f"{self.diagnostics()}"
            )
        return proc

    def _values_file(self, values: dict[str, Any], tag: str) -> Path:
        path = self.workdir / f"values-{tag}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    def install(
        self,
        values: dict[str, Any],
        *,
        drop_grant: str | None = None,
        wait: bool = True,
        timeout: str = "180s",
    ) -> subprocess.CompletedProcess[str]:
        """`helm install` (the CRD adopted if a test already applied it); with `wait`, until
        the operator pod is Ready. `drop_grant` ("create pods") renders the chart without it."""
        args = ["install", self.name, str(CHART), "-f", str(self._values_file(values, "install"))]
        args += ["--take-ownership"]  # a CRD another test applied becomes the release's
        if drop_grant:
            args += ["--post-renderer", sys.executable]
            for arg in ("-m", "relaytrain_testkit.harness.chart_install", *drop_grant.split()):
                args.append(f"--post-renderer-args={arg}")
        if wait:
            args += ["--wait", "--timeout", timeout]
        return self.helm(*args)

    def upgrade(self, values: dict[str, Any], *, timeout: str = "180s") -> None:
        """`helm upgrade --wait`: the Deployment's new pod Ready, the old one gone."""
        path = self._values_file(values, "upgrade")
        self.helm("upgrade", self.name, str(CHART), "-f", str(path), "--wait", "--timeout", timeout)

    def uninstall(self) -> None:
        self.helm("uninstall", self.name, "--wait", "--timeout", "120s")

    # --- the operator pod -------------------------------------------------------------
    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=operator"

    def start_kubelet(self, registries: frozenset[str] = frozenset()) -> KwokProcessRunner:
        """The kwok process runner for this release's operator pods (start before install:
        `helm install --wait` waits for the pod the runner makes Ready). An operator image in
        one of `registries` is pulled and run in a container (harness/containers.py)."""
        runner = KwokProcessRunner(
            self.api_client,
            self.workdir / "pods",
            self.namespace,
            selector=self.selector,
            registries=registries,
        )
        runner.start()
        self.runner = runner
        return runner

    def stop_kubelet(self) -> None:
        if self.runner is not None:
            self.runner.stop()

    def operator_pods(self) -> list[Any]:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client)
        pods = core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
        return [p for p in pods if p.metadata and p.metadata.deletion_timestamp is None]

    def operator_pod(self) -> Any:
        """The one live operator pod (fails when there are none or several)."""
        pods = self.operator_pods()
        assert len(pods) == 1, [p.metadata.name for p in pods]
        return pods[0]

    def ready_operator(self, timeout: float = 120) -> tuple[Any, LocalPod]:
        """Waits until the operator pod is Ready by the runner's probes (not by kwok), and
        returns it with its local process."""

        def ready() -> tuple[Any, LocalPod] | None:
            pods = self.operator_pods()
            if len(pods) != 1 or not pod_ready(pods[0]) or self.runner is None:
                return None
            local = self.runner.local_pod(self.namespace, pods[0].metadata.name)
            statuses = pods[0].status.container_statuses or []
            if local is None or not statuses:
                return None
            if statuses[0].container_id != local.container_id:
                return None
            return pods[0], local

        try:
            result: tuple[Any, LocalPod] = wait_for("the operator pod Ready", ready, timeout)
        except AssertionError as err:
            raise AssertionError(f"{err}{self.diagnostics()}") from None
        return result

    def operator_log(self) -> str:
        logs = sorted((self.workdir / "pods").rglob("container.log"))
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}" for p in logs)

    def diagnostics(self) -> str:
        errors = self.runner.errors[-5:] if self.runner else []
        return f"\nRunner errors: {errors}\nOperator pod logs:\n{self.operator_log()}"


def pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def drop_grant(docs: list[dict[str, Any]], verb: str, resource: str) -> list[dict[str, Any]]:
    """The manifests with `verb` on `resource` (`pods`, `finetunejobs.relaytrain.io`)
    removed from every Role and ClusterRole rule that grants it."""
    plural, _, group = resource.partition(".")
    out = []
    for doc in docs:
        if doc.get("kind") in ("ClusterRole", "Role"):
            rules = []
            for rule in doc.get("rules") or []:
                hit = (
                    group in rule.get("apiGroups", [])
                    and plural in rule.get("resources", [])
                    and verb in rule.get("verbs", [])
                )
                if not hit:
                    rules.append(rule)
                    continue
                others = [r for r in rule["resources"] if r != plural]
                if others:
                    rules.append({**rule, "resources": others})
                verbs = [v for v in rule["verbs"] if v != verb]
                if verbs:
                    rules.append({**rule, "resources": [plural], "verbs": verbs})
            out.append({**doc, "rules": rules})
        else:
            out.append(doc)
    return out


def main(argv: list[str]) -> int:
    """helm post-renderer: stdin → stdout, without the grant `VERB RESOURCE[.GROUP]`."""
    verb, resource = argv
    docs = [d for d in yaml.safe_load_all(sys.stdin.read()) if d]
    sys.stdout.write(yaml.safe_dump_all(drop_grant(docs, verb, resource)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
