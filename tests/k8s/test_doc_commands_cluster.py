"""The docs' cluster commands (docs/commands.yaml, `run: cluster`), run as written.

Each fenced shell block of README.md and docs/*.md that holds such commands runs them in
order in one bash session (what one exports, the next sees), with KUBECONFIG set, the
pinned kubectl and helm on PATH, and each entry's output checked. They run against a
cluster this module starts with the README's own `make cluster-up` under a name of its own
(RELAYTRAIN_CLUSTER, KWOK_WORKDIR), not the session's cluster: `helm install` installs the
CRD, which the session cluster's tests install without helm. A block that starts a cluster
itself (`make cluster-up` ... `make cluster-down`) gets one more cluster of its own. Before
and after each doc file, what the previous one created (release, namespace, CRD, jobs) is
removed, so the files run in any order.
"""

from __future__ import annotations

import json
import os
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from relaytrain_testkit.doc_commands import (
    REPO,
    Block,
    Shell,
    block_commands,
    by_command,
    check,
    clean_env,
    doc_blocks,
)
from relaytrain_testkit.harness.cluster import established_args
from relaytrain_testkit.harness.waiting import wait_for

from hack import toolpaths

pytestmark = pytest.mark.k8s

ENTRIES = by_command()
POOLS = REPO / "hack" / "pools.yaml"


def _cluster_blocks() -> dict[str, list[Block]]:
    """Doc file -> its blocks that hold cluster commands, in order."""
    files: dict[str, list[Block]] = {}
    for block in doc_blocks():
        if any("cluster" in ENTRIES[c.text].run for c in block_commands(block)
               if c.text in ENTRIES):  # fmt: skip
            files.setdefault(block.path, []).append(block)
    return files


BLOCKS = _cluster_blocks()


def _starts_a_cluster(block: Block) -> bool:
    return any(c.text == "make cluster-up" for c in block_commands(block))


def _env(workdir: Path, name: str) -> dict[str, str]:
    env = clean_env(
        RELAYTRAIN_CLUSTER=name,
        KWOK_WORKDIR=str(workdir),
        RELAYTRAIN_POOLS=str(POOLS),
        RELAYTRAIN_CACHE=str(toolpaths.cache_dir()),
    )
    first, _, rest = env["PATH"].partition(os.pathsep)
    tools = [str(toolpaths.binary("helm").parent), str(toolpaths.binary("kubectl").parent)]
    env["PATH"] = os.pathsep.join([first, *tools, rest])
    return env


def _run_block(shell: Shell, block: Block) -> None:
    """The block's cluster commands in order; stops at the first that fails its check."""
    for command in block_commands(block):
        entry = ENTRIES[command.text]
        if "cluster" not in entry.run:
            continue
        if entry.background:
            assert entry.then is not None
            result = shell.run_background(command.text, entry.then, timeout=180)
        else:
            result = shell.run(command.text, timeout=600, then=entry.then)
        problems = check(entry, result)
        assert problems == [], f"{command.where()}: {command.text}\n{problems}\n{result.output}"


def _kubectl(shell: Shell, *args: str) -> str:
    result = Shell(shell.env, REPO).run("kubectl " + " ".join(args), timeout=180)
    return result.output


def _reset(shell: Shell) -> None:
    """Removes what the docs' commands create: jobs (finalizers first: no operator runs
    now), the helm release, its namespace, the CRD."""
    listed = _kubectl(shell, "get", "finetunejobs", "-A", "-o", "json", "2>/dev/null")
    try:
        jobs = json.loads(listed).get("items", [])
    except ValueError:
        jobs = []
    for job in jobs:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        _kubectl(shell, "patch", "finetunejob", name, "-n", ns, "--type=merge",
                 "-p", "'{\"metadata\":{\"finalizers\":null}}'")  # fmt: skip
        _kubectl(shell, "delete", "finetunejob", name, "-n", ns, "--ignore-not-found")
    Shell(shell.env, REPO).run(
        "helm uninstall relaytrain -n relaytrain-system --ignore-not-found", timeout=180
    )
    for kind, name in [("namespace", "relaytrain-system"), ("crd", "finetunejobs.relaytrain.io")]:
        _kubectl(shell, "delete", kind, name, "--ignore-not-found", "--wait", "--timeout=120s")


def _wait_nodes_ready(shell: Shell, timeout: float = 120.0) -> None:
    want = sum(int(p["nodes"]) for p in yaml.safe_load(POOLS.read_text())["pools"])

    def ready() -> int:
        try:
            nodes = json.loads(_kubectl(shell, "get", "nodes", "-o", "json"))["items"]
        except ValueError:
            nodes = []
        return sum(
            1
            for n in nodes
            for c in n.get("status", {}).get("conditions", [])
            if c["type"] == "Ready" and c["status"] == "True"
        )

    wait_for(f"{want} kwok nodes Ready", lambda: ready() >= want, timeout=timeout, interval=1)


@pytest.fixture(scope="module")
def cluster_shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    """A shell whose KUBECONFIG is a cluster of this module's own (README's make cluster-up)."""
    env = _env(tmp_path_factory.mktemp("doc-kwok"), f"rt-doc-{uuid.uuid4().hex[:8]}")
    shell = Shell(env, REPO)
    try:
        up = shell.run("make cluster-up", timeout=600)
        assert up.rc == 0, up.output
        shell.env["KUBECONFIG"] = up.output.strip().splitlines()[-1]
        _wait_nodes_ready(shell)
        yield shell
    finally:
        Shell(env, REPO).run("make cluster-down", timeout=300)


def test_every_cluster_command_is_in_a_block_this_module_runs() -> None:
    ran = {c.text for blocks in BLOCKS.values() for b in blocks for c in block_commands(b)}
    cluster = {command for command, entry in ENTRIES.items() if "cluster" in entry.run}
    assert cluster - ran == set()


@pytest.mark.parametrize("path", sorted(BLOCKS))
def test_cluster_commands_run_as_written(path: str, cluster_shell: Shell, tmp_path: Path) -> None:
    shared = [b for b in BLOCKS[path] if not _starts_a_cluster(b)]
    own = [b for b in BLOCKS[path] if _starts_a_cluster(b)]
    if shared:
        shell = Shell(cluster_shell.env, REPO)
        _reset(shell)
        if path == "docs/api.md":
            # The page shows `kubectl get ftj` on a cluster that has the CRD and a job.
            shell.run("kubectl apply --server-side --force-conflicts -f crds/", timeout=120)
            wait = ["kubectl", "wait", *established_args("finetunejobs.relaytrain.io")]
            shell.run(shlex.join(wait), timeout=150)
            shell.run("kubectl apply -f examples/finetunejob-lora.yaml", timeout=120)
        try:
            for block in shared:
                _run_block(Shell(cluster_shell.env, REPO), block)
        finally:
            _reset(shell)
    for block in own:
        env = _env(tmp_path / "own-kwok", f"rt-doc-own-{uuid.uuid4().hex[:8]}")
        try:
            _run_block(Shell(env, REPO), block)
        finally:
            Shell(env, REPO).run("make cluster-down", timeout=300)
