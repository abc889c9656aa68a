"""The images `make images` built (hack/images.sh), run by podman with runc from this tree's
build, as a kubelet runs them under the chart's and the stage pods' securityContext: a
numeric non-root user, a read-only root filesystem, every capability dropped, no privilege
escalation. What each image installed is exactly the lock's list, and it says what it is
(OCI labels). tests/e2e/test_operator_e2e.py trains a job in containers of the worker image."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.markers import Marker
from relaytrain_testkit.harness.containers import images_sh, podman, require_image

from hack import toolpaths

# `cluster`: the machine's container runtime, which the real kubelet's tests use too; they
# run in one session (hack/test-tiers.sh), one at a time.
pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
IMAGES = {
    # name: (uid, the extra it installs, modules it must import, modules it must not have)
    "operator": (65532, "operator", ["relaytrain_operator", "kopf", "kubernetes"], ["torch"]),
    "worker": (10001, "worker", ["relaytrain_worker", "torch", "peft", "transformers"], ["kopf"]),
}
LOCKED_DOWN = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]

_PROBE = """
import errno, importlib, json, os, shutil, sys
out = {"uid": os.getuid(), "gid": os.getgid(), "writes": {}, "imports": {}}
for path in ("/opt/venv/x", "/x", "/tmp/x"):
    try:
        open(path, "w").close()
        out["writes"][path] = "written"
    except OSError as exc:
        out["writes"][path] = errno.errorcode[exc.errno]
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out["imports"][name] = True
    except ModuleNotFoundError:
        out["imports"][name] = False
out["tools"] = {t: shutil.which(t) for t in ("uv", "pip", "gcc")}
print(json.dumps(out))
"""


def _run(ref: str, *args: str, entrypoint: str = "python") -> str:
    return podman(
        "run", "--rm", "--pull", "never", "--network", "none", *LOCKED_DOWN,
        "--tmpfs", "/tmp", "--entrypoint", entrypoint, ref, *args, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_image_runs_as_its_numeric_user_under_a_read_only_root(name: str) -> None:
    ref = require_image(name)
    uid, _, must, must_not = IMAGES[name]
    got = json.loads(_run(ref, "-c", _PROBE, *must, *must_not))
    assert (got["uid"], got["gid"]) == (uid, uid), got
    # Only the volumes the pods mount take a write; the root filesystem refuses one.
    assert got["writes"] == {"/opt/venv/x": "EROFS", "/x": "EROFS", "/tmp/x": "written"}, got
    assert got["imports"] == {**dict.fromkeys(must, True), **dict.fromkeys(must_not, False)}
    assert got["tools"] == {"uv": None, "pip": None, "gcc": None}, "build tools left behind"
    # The image's own entrypoint, as the pods run it.
    usage = podman("run", "--rm", "--pull", "never", "--network", "none", *LOCKED_DOWN,
                   "--tmpfs", "/tmp", ref, "--help", timeout=300)  # fmt: skip
    assert usage.startswith(f"usage: python -m relaytrain_{name}"), usage


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_image_installs_the_lock_and_says_what_it_is(name: str) -> None:
    ref = require_image(name)
    _, extra, _, _ = IMAGES[name]
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", ref))
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "charts/relaytrain/Chart.yaml").read_text())
    assert labels["org.opencontainers.image.version"] == version == chart["appVersion"]
    # The commit it was built at: this one, or an earlier one with the same sources (the
    # source digest, which require_image checked) — a change to tests or docs alone does not
    # rebuild the images.
    revision = labels["org.opencontainers.image.revision"]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", revision, "HEAD"],
                              cwd=REPO, capture_output=True, text=True, check=False)  # fmt: skip
    assert ancestor.returncode == 0, f"{revision} is not HEAD or before it: {ancestor.stderr}"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://github.com/")
    # The list the image carries is the lock's, and what is installed is that list.
    listed = _run(ref, "/opt/venv/PACKAGES.txt", entrypoint="cat")
    locked = subprocess.run(
        [str(toolpaths.uv()), "export", "--locked", "--offline", "--no-hashes", "--no-header",
         "--no-emit-project", "--no-default-groups", "--extra", extra],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert listed == locked
    pins = {}  # what the lock installs on the images' Linux and Python 3.11
    where = {"sys_platform": "linux", "platform_system": "Linux", "python_version": "3.11",
             "python_full_version": "3.11.2", "platform_machine": "x86_64"}  # fmt: skip
    for line in listed.splitlines():
        requirement, _, marker = line.partition(";")
        applies = not marker.strip() or Marker(marker).evaluate(where)
        if "==" in requirement and not line.startswith(" ") and applies:
            package, pin = requirement.strip().split("==")
            pins[package] = pin
    installed = json.loads(_run(ref, "-c", _INSTALLED))
    assert {k: installed.get(k) for k in pins} == pins
    assert set(installed) - set(pins) == {"relaytrain"}, "installed beyond the lock"


_INSTALLED = """
import importlib.metadata as m, json, re
print(json.dumps({re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
                  for d in m.distributions()}))
"""


def test_a_build_without_room_stops_before_it_starts_and_says_how_much() -> None:
    require_image("worker")  # built: the figure asked for is the rebuild's
    done = images_sh("build", env={"IMAGES_MIN_FREE_GB": str(10**7)}, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs about 10000000 GiB" in done.stderr
    assert "GiB free" in done.stderr and "RELAYTRAIN_CACHE" in done.stderr
    assert "STEP" not in done.stdout  # buildah never started
