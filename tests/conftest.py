"""Test-session wiring shared by every tier.

Markers are registered (strictly) in pyproject.toml, and `chaos` here (`make chaos`; changing
pyproject.toml would change what a fresh machine installs). Tests marked `gpu` run only where
CUDA exists; elsewhere they are deselected with the reason printed, never silently.
Tests marked `torch` (put here on every test whose module imports torch, directly or through
what it imports: relaytrain_testkit.tiers) are what `make test-fast` leaves out, with the
cluster and MinIO tiers. The local cluster and MinIO fixtures live in
relaytrain_testkit.harness (with the rest of what tests run against) and are session-scoped:
one cluster per test session, stopped when the session ends for any reason: failures,
Ctrl-C, and SIGTERM or SIGHUP too (relaytrain_testkit.harness.interrupt).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from relaytrain_testkit.doc_commands import AHEAD
from relaytrain_testkit.tiers import can_select, needs_torch

pytest_plugins = [
    "relaytrain_testkit.harness.interrupt",
    "relaytrain_testkit.harness.cluster",
    "relaytrain_testkit.harness.minio_fixture",
    "relaytrain_testkit.harness.kueue",
    "relaytrain_testkit.harness.registry",
    "relaytrain_testkit.harness.real_kubelet",
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: the chaos schedule with real training (make chaos)")
    config.addinivalue_line(
        "markers",
        "fleet_chaos: a schedule of faults or fleet changes for a job of several pipelines "
        "(tests/e2e/test_chaos_fleet.py, test_churn.py): run by `make chaos`, or when its "
        "module is named; skipped, saying so, in a session that names neither",
    )
    config.addinivalue_line(
        "markers",
        "cluster: a test on a local control plane (the session's, or `make demo`'s own) or "
        "the machine's container runtime; put here on every test that uses a control plane "
        "(CLUSTER_FIXTURES), so that hack/test-tiers.sh can run the e2e tests that use "
        "neither beside them",
    )
    config.addinivalue_line(
        "markers",
        "demo: a test on `make demo`'s run (DEMO_FIXTURE), which starts a cluster of its own; "
        "hack/test-tiers.sh runs these with the e2e tests on no cluster",
    )


DEMO_FIXTURE = "made_demo"
"""`make demo`'s run (tests/e2e/conftest.py): a test using it is marked `demo`."""
CLUSTER_FIXTURES = frozenset({"kube_cluster", DEMO_FIXTURE})
"""Fixtures that start a control plane: a test using one, directly or through another
fixture, is marked `cluster`."""


FLEET_CHAOS_SKIP = (
    "a schedule of faults or fleet changes for two pipelines (3 to 4 minutes each, over the "
    "test session's budget): `make chaos` runs it"
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test module that needs torch is not even imported where `-m` selects no test marked
    `torch` (`make test-fast`): importing torch was 12 of its 30 s of collection."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if can_select(config.option.markexpr or "", "torch"):
        return None
    return True if needs_torch(collection_path) else None


def _asked_for(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether the session selects chaos by marker (`-m chaos`, as `make chaos` does; not a
    marker expression of other tiers, as hack/test-tiers.sh's) or names `item`'s module (or
    a test in it)."""
    if "chaos" in (config.option.markexpr or ""):
        return True
    rootpath = config.rootpath
    return any((rootpath / arg.split("::")[0]).resolve() == item.path for arg in config.args)


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


TIER_ORDER = ("unit", "contract", "e2e", "k8s")
"""The order the tiers run in one session: the tiers without a cluster first, before the
session's cluster, MinIO and registry exist (their background load slowed the thread-heavy
unit tests by up to 2x when they ran last), then e2e, then k8s, whose session-long
operators and releases would load the e2e tier's training (with e2e after k8s a whole
session took 27 minutes instead of 21). Within a tier, the collection's order, but for
RUN_AHEAD's checks, which come last. `make test` runs four sessions instead, in two lanes
side by side (hack/test-tiers.sh: k8s then the e2e tests on a cluster; unit and contract
then the e2e tests on neither and `make demo`'s), which this order serves as well."""


def _tier(item: pytest.Item) -> int:
    for rank, tier in enumerate(TIER_ORDER):
        if item.get_closest_marker(tier):
            return rank
    return len(TIER_ORDER)


RUN_AHEAD = "test_unit_command_runs_as_written"
"""The test (tests/unit/test_doc_commands.py) whose commands start when collection ends, on
the core the session leaves idle, and whose checks run last in their tier, by when the
commands have run beside the tests before them (relaytrain_testkit.doc_commands.RunAhead)."""


def _runs_ahead(item: pytest.Item) -> bool:
    return isinstance(item, pytest.Function) and item.originalname == RUN_AHEAD


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        AHEAD.start(item.callspec.params["entry"] for item in session.items if _runs_ahead(item))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each tier keeps its files' and tests' order, but for RUN_AHEAD's, its last.
    items.sort(key=lambda item: (_tier(item), _runs_ahead(item)))
    torch_files = {path for path in {item.path for item in items} if needs_torch(path)}
    for item in items:
        if item.path in torch_files:
            item.add_marker(pytest.mark.torch)
        fixtures = set(getattr(item, "fixturenames", ()))
        if CLUSTER_FIXTURES & fixtures:
            item.add_marker(pytest.mark.cluster)
        if DEMO_FIXTURE in fixtures:
            item.add_marker(pytest.mark.demo)
        if item.get_closest_marker("fleet_chaos") and not _asked_for(config, item):
            item.add_marker(pytest.mark.skip(reason=FLEET_CHAOS_SKIP))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; this machine has no GPU")
    for item in gpu_items:
        item.add_marker(skip)
