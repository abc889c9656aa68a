"""The kstatus library's verdict on objects (what Flux and `kubectl wait` follow), through
kstatus-check: a small Go program built from sigs.k8s.io/cli-utils at its pin
(hack/gomod/kstatus, built by hack/build-go-binaries.sh)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from hack import toolpaths


def kstatus(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(status, message) of each FineTuneJob in `objects` (whole objects, apiVersion and kind
    included): InProgress, Current, Failed, ..."""
    proc = subprocess.run(
        [str(toolpaths.binary("kstatus-check"))],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == len(objects), proc.stdout
    return [(o["status"], o["message"]) for o in out]


def expected_kstatus(obj: dict[str, Any]) -> str:
    """What kstatus should say of a job, from docs/operator.md "GitOps health"."""
    status = obj.get("status") or {}
    if not status:
        return "Current"  # no status written yet: kstatus cannot tell (see the docs)
    if status.get("observedGeneration", 0) < obj["metadata"]["generation"]:
        return "InProgress"
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    if conditions.get("Stalled") == "True":
        return "Failed"
    if conditions.get("Reconciling") == "True" or conditions.get("Ready") == "False":
        return "InProgress"
    return "Current"
