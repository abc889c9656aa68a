"""Fixtures of the e2e tier (the cluster and MinIO ones are relaytrain_testkit.harness's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

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
