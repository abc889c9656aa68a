"""A host with no S3 client (a GPU host running `relaytrain run --local` against a local
folder has no `minio`): a stage that crashes there reports its own error, not a missing
module from sorting the error into store refusals and outages (docs/stage-contract.md,
the exit codes)."""

from __future__ import annotations

import sys

import pytest
from relaytrain_worker.__main__ import _store_failure
from relaytrain_worker.state.store import refusal, transient

pytestmark = pytest.mark.unit


@pytest.fixture
def no_s3_client(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("minio", "minio.error"):
        monkeypatch.setitem(sys.modules, name, None)  # `import minio` raises ImportError
    with pytest.raises(ImportError):
        import minio.error  # noqa: F401


@pytest.mark.usefixtures("no_s3_client")
def test_a_stages_own_crash_goes_up_as_itself() -> None:
    crash = RuntimeError("Cannot re-initialize CUDA in forked subprocess")
    assert refusal(crash) is None
    with pytest.raises(RuntimeError, match="re-initialize CUDA") as raised:
        _store_failure("stage 0", crash)
    assert raised.value is crash


@pytest.mark.usefixtures("no_s3_client")
def test_without_a_client_only_the_networks_own_errors_pass_by_themselves() -> None:
    assert transient(ConnectionResetError()) and transient(TimeoutError())
    assert not transient(RuntimeError("boom")) and not transient(FileNotFoundError("x"))
