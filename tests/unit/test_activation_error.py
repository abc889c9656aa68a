"""`pipeline.activationError`: the error a `delta` row's code is held to, from the spec through
the stage documents to the links a stage makes, what the planner prices, and what the codes
cost and leave over a real link."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from relaytrain_contract import StageConfig
from relaytrain_operator.domain.planner import TrainingShape
from relaytrain_operator.domain.planner.cost import DELTA_FIRST_BYTES, _wire_bytes_per_value
from relaytrain_operator.domain.stage_config import build_stage_configs, local_endpoints
from relaytrain_operator.spec import SpecError, parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.linkcreds import link_pair, stage_credentials
from relaytrain_worker.pipeline.boundary import ROWS, codec_for
from relaytrain_worker.pipeline.lowbit import DISTORTION
from relaytrain_worker.pipeline.peers import link_chain
from relaytrain_worker.pipeline.transport import Frame, listen

pytestmark = pytest.mark.unit

RANGES = [(0, 2), (2, 4)]


def _job(error: str, compression: str = "delta") -> Job:
    return Job().pipeline(compression=compression).set("spec.pipeline.activationError", error)


def test_the_spec_takes_int3_only_with_delta_and_the_planner_prices_it() -> None:
    assert parse_job(_job("int3").build()).spec.pipeline.activation_error == "int3"
    assert parse_job(
        Job().pipeline(compression="delta").build()
    ).spec.pipeline.activation_error == ("int4")
    with pytest.raises(SpecError, match="should be 'int4' or 'int3'") as info:
        parse_job(_job("int2").build())
    assert "spec.pipeline.activationError" in info.value.paths
    with pytest.raises(SpecError, match="int3 needs compression: delta") as info:
        parse_job(_job("int3", compression="int8").build())
    assert "spec.pipeline.activationError" in info.value.paths
    # A row's first crossing is priced at int3's bits instead of int4's: a bit a value less.
    int3 = TrainingShape(1, 4, 256, compression="delta", activation_bits=3)
    assert _wire_bytes_per_value(int3) == pytest.approx(DELTA_FIRST_BYTES - 1 / 8)
    assert _wire_bytes_per_value(TrainingShape(1, 4, 256, compression="delta")) == (
        DELTA_FIRST_BYTES
    )
    with pytest.raises(ValueError, match="activation_bits must be 3 or 4"):
        TrainingShape(1, 4, 256, compression="delta", activation_bits=2)


def test_a_stages_links_code_to_the_error_its_document_names() -> None:
    job = parse_job(_job("int3").build())
    ends = local_endpoints(2, 29500, 9400)
    docs = build_stage_configs(job, RANGES, ends)
    assert [d["pipeline"]["activationError"] for d in docs] == ["int3", "int3"]
    # `relaytrain run --local` sends nothing compressed over loopback: the error is int4's.
    plain = build_stage_configs(job, RANGES, ends, compression="none")
    assert [d["pipeline"].get("activationError", "int4") for d in plain] == ["int4", "int4"]
    namespace, name = docs[0]["links"]["identity"].split("/")[2:4]
    creds = stage_credentials(2, namespace=namespace, job=name)
    listener = listen("127.0.0.1:0", credentials=creds[1], expect=creds[0].identity)
    port = listener.address[1]
    docs = build_stage_configs(job, RANGES, local_endpoints(2, port - 1, 9400))
    first, second = (StageConfig.from_json(d) for d in docs)
    with ThreadPoolExecutor(1) as pool:
        accepting = pool.submit(link_chain, second, creds[1], listener, 10.0)
        down = link_chain(first, creds[0], None, 10.0)
        up = accepting.result()
    try:
        assert down.next is not None and up.prev is not None
        assert down.next.link.codec.sender.config.full_bits == 3
        assert up.prev.link.codec.sender.config.full_bits == 3
    finally:
        down.close()
        up.close()
        listener.close()


def test_int3_codes_take_fewer_bits_within_int3s_error_and_any_end_decodes_them() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 32, 128, generator=gen)
    sent: dict[str, float] = {}
    for error in ("int4", "int3"):
        up, down = link_pair(stage_credentials(2, job="error"), "error")
        # Only the sender reads its config: a receiver made for int4 decodes int3's codes.
        up.codec = codec_for(error)
        with up, down:
            worst = 0.0
            for m in range(4):
                index = torch.arange(2 * m, 2 * m + 2)
                up.send(Frame("activation", 0, m, {"hidden": rows[index], ROWS: index}), "delta")
                got = down.recv(timeout=10).tensors["hidden"]
                for i, row in enumerate(index.tolist()):
                    err = (got[i] - rows[row]).square().sum() / rows[row].square().sum()
                    worst = max(worst, float(err))
            sent[error] = up.payload_bytes_sent
        bits = int(error.removeprefix("int"))
        assert worst < 1.3 * DISTORTION[bits], (error, worst)
    values = rows.numel()
    # A row's first code costs about the held code's bits a value.
    assert 3.9 < (sent["int4"] - 8 * 2) * 8 / values < 4.4, sent
    assert 2.9 < (sent["int3"] - 8 * 2) * 8 / values < 3.4, sent
    with pytest.raises(ValueError, match="activation_error must be one of int4, int3"):
        codec_for("int2")
