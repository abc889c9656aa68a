"""`pipeline.activationError` (the error a `delta` row's code is held to) and
`pipeline.activationBasis` (what a token's change is coded in), from the spec through the
stage documents to the links a stage makes, what the planner prices, and what the codes
cost and leave over a real link."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from relaytrain_contract import GRADIENT_BITS, StageConfig
from relaytrain_operator.domain.planner import ModelShape, Pool, TrainingShape, link_cost
from relaytrain_operator.domain.planner.catalog import DEFAULT_CATALOG
from relaytrain_operator.domain.planner.cost import CostSettings, pool_cost
from relaytrain_operator.domain.planner.link_cost import (
    DELTA_FIRST_BYTES,
    LinkCost,
    wire_bytes_per_value,
)
from relaytrain_operator.domain.stage_config import build_stage_configs, local_endpoints
from relaytrain_operator.spec import SpecError, parse_job
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.linkcreds import link_pair, stage_credentials
from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG
from relaytrain_worker.pipeline import transform
from relaytrain_worker.pipeline.boundary import ROWS, codec_for
from relaytrain_worker.pipeline.lowbit import DISTORTION
from relaytrain_worker.pipeline.peers import link_chain
from relaytrain_worker.pipeline.transport import Frame, listen

pytestmark = pytest.mark.unit

RANGES = [(0, 2), (2, 4)]


def _job(error: str, compression: str = "delta", basis: str = "identity", bits: int = 3) -> Job:
    return (
        Job()
        .pipeline(compression=compression)
        .set("spec.pipeline.activationError", error)
        .set("spec.pipeline.activationBasis", basis)
        .set("spec.pipeline.gradientBits", bits)
    )


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
    # A row's first crossing is priced at int3's bits instead of int4's: a bit a value less,
    # but for its sink's token, at 8 bits in either (5 bits more than int3's, 4 than int4's).
    int3 = TrainingShape(1, 4, 256, compression="delta", activation_bits=3)
    int4 = TrainingShape(1, 4, 256, compression="delta")
    assert wire_bytes_per_value(int3) == pytest.approx(DELTA_FIRST_BYTES - 1 / 8 + 5 / 8 / 256)
    assert wire_bytes_per_value(int4) == pytest.approx(DELTA_FIRST_BYTES + 4 / 8 / 256)
    with pytest.raises(ValueError, match="activation_bits must be 3 or 4"):
        TrainingShape(1, 4, 256, compression="delta", activation_bits=2)


def test_the_spec_takes_a_fitted_basis_with_delta_or_auto_and_the_planner_counts_its_memory() -> (
    None
):
    for compression in ("delta", "auto"):
        job = parse_job(_job("int4", compression, basis="fitted").build())
        assert job.spec.pipeline.activation_basis == "fitted"
    assert parse_job(Job().build()).spec.pipeline.activation_basis == "identity"
    with pytest.raises(SpecError, match="should be 'identity' or 'fitted'") as info:
        parse_job(_job("int4", basis="pca").build())
    assert "spec.pipeline.activationBasis" in info.value.paths
    with pytest.raises(SpecError, match="fitted needs compression: delta or auto") as info:
        parse_job(_job("int4", compression="int4", basis="fitted").build())
    assert "spec.pipeline.activationBasis" in info.value.paths
    # Device memory: a stage that sends activations holds two float64 moments and two float32
    # bases, one that receives them two bases; the identity and the other codes nothing.
    model = ModelShape.from_hf_config(SMOLLM2_135M_CONFIG)
    h = model.hidden_size
    pool = Pool("h100", "NVIDIA-H100-80GB-HBM3", 4, 1000.0, 10.0)
    gpu = DEFAULT_CATALOG[pool.product]

    def fixed(training: TrainingShape, first: bool, last: bool) -> int:
        return pool_cost(model, training, pool, gpu, CostSettings()).fixed_bytes(first, last)

    delta = TrainingShape(1, 4, 256, compression="delta")
    fitted = replace(delta, activation_basis="fitted")
    for first, last, extra in ((True, False, 24), (False, False, 32), (False, True, 8)):
        assert fixed(fitted, first, last) - fixed(delta, first, last) == extra * h * h
    # 32 h^2 on a middle stage: 512 MiB at hidden 4096.
    assert 32 * 4096 * 4096 == 512 << 20
    int4 = replace(fitted, compression="int4")
    assert fixed(int4, False, False) == fixed(replace(delta, compression="int4"), False, False)
    with pytest.raises(ValueError, match="activation_basis 'pca' is not one of identity, fitted"):
        replace(delta, activation_basis="pca")


def test_the_planner_charges_each_frame_a_share_of_a_fitted_basis_bytes_and_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The planner refits as often as the worker, and prices a basis at what one of every
    # vector at 8 bits costs on the wire: the most any basis the worker sends costs.
    assert link_cost.BASIS_REFIT == transform.REFIT
    # ... and charges both ends' QR of a basis where the worker runs it on the frames' way
    beside = link_cost.BASIS_QR_BESIDE_WIDTH
    assert transform.switch_frames(beside - 1) == 0 < transform.switch_frames(beside)
    qr = 2 * link_cost.BASIS_QR_SECONDS_PER_H3
    fit = link_cost.basis_fit_seconds
    # (a basis a block wider costs less on the frames' way where its QRs leave them)
    assert fit(beside - 64) - qr * (beside - 64) ** 3 < fit(beside) < fit(beside - 64)
    h = 128
    gen = torch.Generator().manual_seed(0)
    vectors = torch.linalg.qr(torch.randn(h, h, generator=gen, dtype=torch.float64)).Q.float()
    spread = torch.logspace(8, -8, h)
    for energies in (torch.ones(h), spread, torch.cat([torch.tensor([1e6]), torch.ones(h - 1)])):
        msg = transform.BasisMessage.code(True, 1, vectors, energies)
        assert 0 < msg.nbytes <= link_cost.basis_bytes(h)
    assert transform.vector_bits(spread).max() == transform.MAX_BITS
    monkeypatch.setattr(transform, "vector_bits", lambda e: torch.full_like(e, 8).long())
    assert transform.BasisMessage.code(True, 1, vectors, spread).nbytes == (
        link_cost.basis_bytes(h)
    )
    # Each activation frame pays a REFIT-th of a basis's bytes (deflated like the rest) and of
    # its fit; the rows, the gradients and the other codes cost what they cost without it.
    model = ModelShape.from_hf_config(SMOLLM2_135M_CONFIG)
    h = model.hidden_size
    delta = TrainingShape(2, 4, 1024, compression="delta", epochs=3)
    fitted = LinkCost.of(model, replace(delta, activation_basis="fitted"))
    plain = LinkCost.of(model, delta)
    share = link_cost.basis_bytes(h) / link_cost.BASIS_REFIT
    assert fitted.forward_bytes - plain.forward_bytes == pytest.approx(
        share * (1 - link_cost.DEFLATE_FORWARD_SAVES)
    )
    fit = link_cost.basis_fit_seconds(h) / link_cost.BASIS_REFIT
    assert fit > 0
    assert fitted.forward_codec_seconds - plain.forward_codec_seconds == pytest.approx(
        fit + share * link_cost.INFLATE_SECONDS_PER_BYTE
    )
    assert fitted.backward_bytes == plain.backward_bytes
    assert fitted.backward_codec_seconds == plain.backward_codec_seconds
    int4 = TrainingShape(2, 4, 1024, compression="int4")
    assert LinkCost.of(model, replace(int4, activation_basis="fitted")) == LinkCost.of(model, int4)


@pytest.mark.parametrize(
    ("error", "basis", "bits"), [("int3", "identity", 1), ("int4", "fitted", 3)]
)
def test_a_stages_links_code_as_its_document_names(error: str, basis: str, bits: int) -> None:
    job = parse_job(_job(error, basis=basis, bits=bits).build())
    ends = local_endpoints(2, 29500, 9400)
    docs = build_stage_configs(job, RANGES, ends)
    assert [d["pipeline"]["activationError"] for d in docs] == [error, error]
    assert [d["pipeline"]["activationBasis"] for d in docs] == [basis, basis]
    assert [d["pipeline"]["gradientBits"] for d in docs] == [bits, bits]
    # `relaytrain run --local` sends nothing compressed over loopback: int4's error, no basis.
    plain = build_stage_configs(job, RANGES, ends, compression="none")
    assert [d["pipeline"]["activationError"] for d in plain] == ["int4", "int4"]
    assert [d["pipeline"]["activationBasis"] for d in plain] == ["identity", "identity"]
    assert [d["pipeline"]["gradientBits"] for d in plain] == [GRADIENT_BITS, GRADIENT_BITS]
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
        for link in (down.next.link, up.prev.link):
            config = link.codec.sender.config
            assert config.full_bits == int(error.removeprefix("int"))
            assert config.transform is (basis == "fitted")
            assert link.codec.gradient_bits == bits
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
            sent[error] = up.coded_bytes_sent  # the codes, before deflate
        bits = int(error.removeprefix("int"))
        assert worst < 1.3 * DISTORTION[bits], (error, worst)
    values = rows.numel()
    # A row's first code costs about the held code's bits a value.
    assert 3.9 < (sent["int4"] - 8 * 2) * 8 / values < 4.4, sent
    assert 2.9 < (sent["int3"] - 8 * 2) * 8 / values < 3.4, sent
    with pytest.raises(ValueError, match="activation_error must be one of int4, int3"):
        codec_for("int2")
