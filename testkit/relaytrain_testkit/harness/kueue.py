"""Kueue's real controller against the session's cluster: built by the bootstrap from
sigs.k8s.io/kueue at the pin of hack/versions.env, with the CRDs and webhook configurations
of that same module.

Kueue runs here as the control plane's other components do, a local process with the
cluster's admin kubeconfig. Its webhooks (defaulting and validation of its own objects, and
the conversion between v1beta1 and v1beta2) are served on loopback with a CA made here, and
the API server calls them by URL: the module's CRDs get the conversion webhook Kueue's own
kustomization patches in, and of its webhook configurations those for Kueue's own objects
are installed (the job integrations' are left out: no job kind but ours is queued here).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from hack import toolpaths
from relaytrain_testkit.harness import procs
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.waiting import wait_for

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
FRAMEWORK = "FineTuneJob.v1alpha1.relaytrain.io"
"""relaytrain's kind as an external framework of Kueue (Kueue treats pods owned by it as
managed by their owner, not queued one by one)."""


NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,  # PKCS#1: what Kueue's rotator reads
        serialization.NoEncryption(),
    )


def _certificates() -> dict[str, bytes]:
    """The Secret Kueue's certificate rotator keeps its webhook certificates in, made here:
    a CA it accepts as its own (named kueue-ca) and a serving certificate for its Service's
    name, which the rotator checks, and for 127.0.0.1, where the API server calls it. Valid
    for ten years: the rotator replaces what expires within 90 days."""
    now = datetime.datetime.now(datetime.UTC)
    years = datetime.timedelta(days=3650)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "kueue-ca"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kueue"),
        ]
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + years)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("kueue-ca")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{SERVICE}.{NAMESPACE}.svc")])
        )
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + years)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(f"{SERVICE}.{NAMESPACE}.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "ca.key": _pem_key(ca_key),
        "tls.crt": cert.public_bytes(serialization.Encoding.PEM),
        "tls.key": _pem_key(key),
    }


def _client_config(url: str, ca: bytes, path: str) -> dict[str, Any]:
    return {"url": f"{url}{path}", "caBundle": base64.b64encode(ca).decode()}


def kueue_manifests(url: str, ca: bytes) -> list[dict[str, Any]]:
    """The module's CRDs (with the conversion webhook where Kueue's kustomization puts one)
    and its webhook configurations for Kueue's own objects, all calling `url`."""
    files = toolpaths.component_files("kueue") / "config" / "components"
    # The conversion patches Kueue's kustomization applies (it lists some and leaves others
    # commented out).
    kustomization = yaml.safe_load((files / "crd" / "kustomization.yaml").read_text())
    converted = set()
    for entry in kustomization.get("patches") or []:
        doc = yaml.safe_load((files / "crd" / entry["path"]).read_text())
        if (doc.get("spec") or {}).get("conversion"):
            converted.add(doc["metadata"]["name"])
    docs: list[dict[str, Any]] = []
    for path in sorted((files / "crd" / "bases").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["metadata"]["name"] in converted:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": _client_config(url, ca, "/convert"),
                    "conversionReviewVersions": ["v1"],
                },
            }
        docs.append(crd)
    for config in yaml.safe_load_all((files / "webhook" / "manifests.yaml").read_text()):
        if not config:
            continue
        hooks = [
            hook
            for hook in config.get("webhooks") or []
            if any(GROUP in (rule.get("apiGroups") or []) for rule in hook.get("rules") or [])
        ]
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = _client_config(url, ca, path)
        config["metadata"]["name"] = f"kueue-{config['metadata']['name']}"
        config["webhooks"] = hooks
        docs.append(config)
    return docs


@dataclass
class Kueue:
    """The running controller."""

    process: subprocess.Popen[bytes]
    log: Path
    health_port: int

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/readyz", timeout=2
            ) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False


def start_kueue(cluster: Any, workdir: Path) -> Kueue:
    """Install Kueue's CRDs and webhooks into `cluster` and start its controller."""
    port, health = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    pki = _certificates()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "data": {k: base64.b64encode(v).decode() for k, v in pki.items()},
    }
    certs = workdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    for name in ("tls.crt", "tls.key"):  # what the rotator would write there from the Secret
        (certs / name).write_bytes(pki[name])
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    manifests = workdir / "kueue-manifests.yaml"
    manifests.write_text(
        yaml.safe_dump_all([namespace, secret, *kueue_manifests(url, pki["ca.crt"])])
    )
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifests))
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        # Kueue's own certificate management, on the certificates made above (it keeps them:
        # they are valid) — without it Kueue wants its metrics certificates in /etc.
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [FRAMEWORK]},
    }
    (workdir / "kueue-config.yaml").write_text(yaml.safe_dump(config))
    log = workdir / "kueue.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [
                str(toolpaths.binary("kueue")),
                f"--config={workdir / 'kueue-config.yaml'}",
                f"--kubeconfig={cluster.kubeconfig}",
                # The on-demand visibility API would listen on a fixed port; nothing here reads it.
                "--feature-gates=VisibilityOnDemand=false",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    kueue = Kueue(process, log, health)

    def serving() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"kueue exited with {process.returncode}:\n{kueue.logs()[-4000:]}")
        if not kueue.ready():
            return False
        # The webhooks answer: a dry-run create of a ResourceFlavor passes through them.
        flavor = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceFlavor",
            "metadata": {"name": "relaytrain-probe"},
        }
        probe = workdir / "probe.json"
        probe.write_text(json.dumps(flavor))
        created = cluster.kubectl("create", "--dry-run=server", "-f", str(probe), check=False)
        return bool(created.returncode == 0)

    try:
        wait_for("kueue ready with its webhooks serving", serving, timeout=120, interval=1)
    except BaseException:
        stop_kueue(kueue)
        raise
    return kueue


def stop_kueue(kueue: Kueue) -> None:
    procs.stop(kueue.process, grace=30)


@pytest.fixture(scope="session")
def kueue(kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kueue]:
    """Kueue, once per test session, on the session's cluster."""
    running = start_kueue(kube_cluster, tmp_path_factory.mktemp("kueue"))
    try:
        yield running
    finally:
        stop_kueue(running)
