"""What a stage process imports before it trains: bitsandbytes only for QLoRA (peft would
import it whenever it is installed, a second of CPU at every start and every restart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from relaytrain_contract.exits import StageExit
from relaytrain_operator.domain.stage_config import build_stage_configs, pod_endpoints
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.stage_pods import JOB, PLAN

pytestmark = [pytest.mark.unit, pytest.mark.torch]


@pytest.mark.parametrize(("method", "imports"), [("lora", False), ("qlora", True)])
def test_bitsandbytes_is_imported_by_qlora_stages_only(
    tmp_path: Path, method: str, imports: bool
) -> None:
    # No link credentials where the document says: the stage imports what it trains with,
    # then stops at once, before it reads anything from a store.
    job = JOB.method(method)
    config = build_stage_configs(parse_job(job.build()), PLAN, pod_endpoints("smol", "t", 2))[0]
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "relaytrain_worker", "--config", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == StageExit.LINK_REFUSED, done.stderr[-2000:]
    assert "link credentials" in done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "peft" in imported
    # A blocked import still gets a line of its own (microseconds); a real one loads the
    # package's modules.
    loaded = {name for name in imported if name.startswith("bitsandbytes.")}
    assert bool(loaded) is imports, sorted(loaded)[:5]
