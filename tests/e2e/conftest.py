"""Fixtures of the e2e tier (the cluster and MinIO ones are relaytrain_testkit.harness's)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from relaytrain_contract.prefork import SOCKET_ENV

if TYPE_CHECKING:
    from relaytrain_testkit.demo_job import MadeDemo


@pytest.fixture(scope="session")
def made_demo() -> MadeDemo:
    """`make demo` as a user types it, run once per session (2 to 3½ minutes on the 2-core
    machine, by how busy it is): its output, and the working folder it leaves
    (loss-history.json among it). test_doc_commands_e2e checks what it prints;
    test_loss_curves compares its losses with the committed curve. Each asserts that the
    run succeeded itself."""
    # Imported here: relaytrain_testkit.demo_job imports torch (through the tiny models), and
    # this conftest is loaded by every session that collects tests/, `make test-fast` too.
    from relaytrain_testkit.demo_job import make_demo

    return make_demo(timeout=1800)


@pytest.fixture(scope="session", autouse=True)
def _shared_prefork(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """In a session with e2e tests on no cluster (those that run `relaytrain run --local`),
    one prefork server for all their runs (local_jobs.shared_prefork): each run forks its
    stages from it instead of importing torch, transformers and peft in a server of its own.
    Not where the environment names a server already or turns forking off
    (RELAYTRAIN_PREFORK=0). A test that must start its own server clears SOCKET_ENV."""
    local = any(
        item.get_closest_marker("e2e") and not item.get_closest_marker("cluster")
        for item in request.session.items
    )
    if not local or os.environ.get(SOCKET_ENV) or os.environ.get("RELAYTRAIN_PREFORK") == "0":
        yield
        return
    from relaytrain_testkit.local_jobs import shared_prefork  # imports torch (tiny models)

    with shared_prefork(tmp_path_factory.mktemp("shared-prefork")):
        yield
