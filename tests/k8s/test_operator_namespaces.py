"""A namespace made while the operator starts is served like any other (issue 25 item 3).

The operator serves the namespaces that match `--namespace rtns-<tag>-*`. Namespaces, each
with a suspended job, are made one after the other as fast as the API server takes them:
before the operator starts, while it starts (from its process's first moment until seconds
after its /metrics answer) and after. Every job must get a status within 20 s, whenever its
namespace was made. With kopf's own namespace scan, a namespace made between its listing
and its watch was never served: 2 of 54 jobs in one of three runs (2026-11-26,
docs/operator.md, "Namespaces made at any time").
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from relaytrain_testkit.harness.chart_rbac import chart_rbac_kubeconfig
from relaytrain_testkit.harness.operator_cases import (
    GROUP,
    PLURAL,
    VERSION,
    cluster_job,
    install_crd,
)
from relaytrain_testkit.harness.operator_process import OperatorProcess
from relaytrain_testkit.harness.waiting import wait_for
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.k8s


def test_a_namespace_made_while_the_operator_starts_is_reconciled(
    kube_cluster: Any, tmp_path: Path
) -> None:
    api = kube_cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    install_crd(kube_cluster, api)
    identity = chart_rbac_kubeconfig(
        kube_cluster, tmp_path / "operator.kubeconfig", release="rtns",
        namespace="relaytrain-nstest", watch=[],
    )  # fmt: skip
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG))
    tag = uuid.uuid4().hex[:4]
    made: list[tuple[str, float]] = []
    stop = threading.Event()

    def make(k: int) -> None:
        name = f"rtns-{tag}-{k}"
        core.create_namespace({"metadata": {"name": name}})
        job = cluster_job("j", str(tmp_path / "model"), name).suspend().build()
        custom.create_namespaced_custom_object(GROUP, VERSION, name, PLURAL, job)
        made.append((name, time.monotonic()))

    def keep_making() -> None:
        k = 1
        while not stop.is_set():
            make(k)
            k += 1

    make(0)
    args = ("--namespace", f"rtns-{tag}-*", "--resync-seconds", "30")
    operator = OperatorProcess(identity.kubeconfig, tmp_path / "operator.log", *args)
    maker = threading.Thread(target=keep_making, daemon=True)
    try:
        maker.start()
        operator.start()
        # Namespaces keep coming while kopf sets its watches up (no sleep stands in for a
        # state here: the window is the operator's start, and this is how long it lasts).
        time.sleep(3)
        stop.set()
        maker.join()

        def status_of(ns: str) -> Any:
            job = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "j")
            return (job.get("status") or {}).get("phase")

        def unreconciled() -> list[str]:
            return [ns for ns, _ in made if not status_of(ns)]

        try:
            wait_for("every job reconciled", lambda: not unreconciled(), timeout=20)
        except AssertionError:
            missed = unreconciled()
            tail = operator.tail(60)
            raise AssertionError(
                f"{len(missed)} of {len(made)} jobs never reconciled: {missed}\n{tail}"
            ) from None
    finally:
        stop.set()
        operator.stop()
        for ns, _ in made:
            core.delete_namespace(ns)
