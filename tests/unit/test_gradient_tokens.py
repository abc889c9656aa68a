"""Gradients of a share of the tokens (`pipeline.gradientTokens`): the draw against its
definition (unbiased, the share kept, tokens without a gradient never sent), the link's
token code, a pipeline that trains with it, and the spec and the planner that take it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from relaytrain_operator.domain.planner import TrainingShape
from relaytrain_operator.domain.planner.link_cost import delta_gradient_bytes, wire_bytes_per_value
from relaytrain_operator.domain.stage_config import build_stage_configs, local_endpoints
from relaytrain_operator.spec import SpecError, parse_job
from relaytrain_testkit import bigram
from relaytrain_testkit.inputs import CLIPPED_TRAINING, even_splits
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.linkcreds import linked, stage_credentials
from relaytrain_testkit.pipelines import PipelineRun, run_pipeline_threads
from relaytrain_testkit.references import run_reference
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.pipeline import lowbit
from relaytrain_worker.pipeline.boundary import (
    GRADIENT_BITS,
    BoundaryCodec,
    bytes_per_value,
    codec_for,
    variant_of,
)
from relaytrain_worker.pipeline.frames import prepare
from relaytrain_worker.pipeline.sampling import (
    FRAME_BYTES,
    probabilities,
    sample_tokens,
    seed_of,
    share_within,
)
from relaytrain_worker.pipeline.transport import Frame, Link
from relaytrain_worker.state.data import MicroBatch

pytestmark = pytest.mark.unit


def _gradient(seed: int = 0) -> torch.Tensor:
    """[2, 32, 128]: tokens whose norms spread over two orders, as a fine-tune's do."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(2, 32, 128, generator=gen)
    return g * torch.rand(2, 32, 1, generator=gen).pow(4)


def test_the_probabilities_follow_the_norms_and_sum_to_the_share() -> None:
    norms = torch.tensor([0.0, 1.0, 2.0, 4.0, 100.0])
    p = probabilities(norms, 0.5)
    assert float(p.sum()) == pytest.approx(0.5 * 4)  # four tokens have a gradient
    assert p[0] == 0 and p[4] == 1  # no gradient: never; a large one: always
    assert float(p[2] / p[1]) == pytest.approx(2.0) and float(p[3] / p[1]) == pytest.approx(4.0)
    assert probabilities(norms, 1.0).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert probabilities(torch.zeros(3), 0.5).tolist() == [0.0, 0.0, 0.0]


def test_the_draw_is_unbiased_and_keeps_the_share() -> None:
    g = _gradient()
    g[0, :4] = 0  # tokens without a gradient (padding): never sent
    tokens = g.reshape(-1, g.shape[-1])
    p = probabilities(tokens.norm(dim=1), 0.25)
    draws = 2000
    kept = torch.zeros(tokens.shape[0])
    for d in range(draws):
        out = sample_tokens(g, 0.25, seed=d).reshape(-1, g.shape[-1])
        live = out.ne(0).any(dim=1)
        # A token sent is its gradient divided by its probability, so E[sent] = p g / p = g.
        want = (tokens[live].double() / p[live, None]).float()
        assert torch.allclose(out[live], want, rtol=1e-6, atol=0), d
        kept += live
    # Each token is sent as often as its probability says (binomial, 5 sigma), never one
    # without a gradient, and a quarter of the others on average.
    frequency = kept.double() / draws
    bound = 5 * (p * (1 - p) / draws).sqrt() + 1 / draws
    assert bool(((frequency - p).abs() <= bound).all()), (frequency - p).abs().max()
    assert not bool(kept[:4].any())
    assert float(kept.sum()) / draws == pytest.approx(0.25 * 60, rel=0.05)
    # The same seed, the same tokens; another step, micro-batch or stage, others.
    assert torch.equal(sample_tokens(g, 0.25, 7), sample_tokens(g, 0.25, 7))
    assert len({seed_of(0, s, m, k) for s in range(3) for m in range(3) for k in range(3)}) == 27
    assert sample_tokens(g, 1.0, 0) is g
    with pytest.raises(ValueError, match="above 0 and at most 1"):
        sample_tokens(g, 0.0, 0)


@pytest.fixture
def link() -> Iterator[tuple[Link, Link]]:
    with linked("tokens") as ends:
        yield ends


def test_a_gradient_with_zero_tokens_sends_only_the_others(link: tuple[Link, Link]) -> None:
    up, down = link
    g = sample_tokens(_gradient(1), 0.25, seed=3)
    live = g.reshape(-1, g.shape[-1]).ne(0).any(dim=1)
    up.send(Frame("gradient", 0, 0, {"grad": g}), "delta")
    got = down.recv(timeout=10).tensors["grad"]
    # A map of a bit a token, then the live tokens as every gradient is coded (2 bits by
    # default, each block's scale unshrunk).
    sent = int(live.sum())
    assert up.coded_bytes_sent == 64 // 8 + sent * 128 * (GRADIENT_BITS + 0.25) / 8
    flat = got.reshape(-1, g.shape[-1])
    assert not bool(flat[~live].any())
    want = lowbit.decode(
        lowbit.encode(
            g.reshape(-1, g.shape[-1])[live], GRADIENT_BITS, None, "unshrunk", variant_of(0, 0)
        )
    )
    assert torch.equal(flat[live], want)
    # A gradient of nothing but zeros is its map alone.
    up.send(Frame("gradient", 0, 1, {"grad": torch.zeros(2, 32, 128)}), "delta")
    assert not bool(down.recv(timeout=10).tensors["grad"].any())


def _bigram_steps(n_steps: int) -> list[list[MicroBatch]]:
    """Steps of 3 micro-batches of 2 rows of 16 tokens of the bigram language, 24 rows
    visited again every 4 steps (keyed, for delta's caches)."""
    ids = bigram.rows(24, 16, 0)
    mask = torch.ones(2, 16, dtype=torch.long)
    pos = torch.arange(16).expand(2, -1).contiguous()
    out = []
    for s in range(n_steps):
        micros = []
        for m in range(3):
            at = (s % 4) * 6 + 2 * m
            rows = torch.arange(at, at + 2)
            micros.append(MicroBatch(ids[rows], mask, pos, ids[rows].clone(), rows=rows))
        out.append(micros)
    return out


def test_a_pipeline_trains_with_a_quarter_of_the_gradient_tokens(tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path / "wide", layers=4, hidden=256)
    steps = _bigram_steps(12)
    training = CLIPPED_TRAINING.model_copy(update={"steps": 12, "max_grad_norm": 1.0})
    exact = run_reference(model, steps, training)
    runs = {
        share: run_pipeline_threads(
            model,
            even_splits(4, 2),
            steps,
            training,
            credentials=stage_credentials(2),
            compression="delta",
            gradient_tokens=share,
        )
        for share in (1.0, 0.25)
    }
    # The gradients going back (direction 1) cost about a quarter of their bytes.
    full, quarter = (runs[s].boundary_bytes[0][1] for s in (1.0, 0.25))
    assert quarter < 0.45 * full, (quarter, full)
    # It learns as exact training does, with the noise of a quarter of the tokens.
    assert runs[0.25].losses != runs[1.0].losses
    for share, run in runs.items():
        assert run.losses[-1] < 0.97 * run.losses[0], (share, run.losses)
        assert abs(run.losses[-1] - exact.losses[-1]) / exact.losses[-1] < 0.05, (
            share, run.losses, exact.losses,
        )  # fmt: skip


def _tokens(job: Job, share: float) -> Job:
    return job.set("spec.pipeline.gradientTokens", share)


def test_the_spec_takes_a_share_only_with_delta_and_the_planner_prices_it() -> None:
    job = parse_job(_tokens(Job().pipeline(compression="delta"), 0.25).build())
    assert job.spec.pipeline.gradient_tokens == 0.25
    for bad, words in ((0.0, "greater than 0"), (1.5, "less than or equal to 1")):
        with pytest.raises(SpecError, match=words) as info:
            parse_job(_tokens(Job().pipeline(compression="delta"), bad).build())
        assert "spec.pipeline.gradientTokens" in info.value.paths
    with pytest.raises(SpecError, match="needs compression: delta") as info:
        parse_job(_tokens(Job().pipeline(compression="int8"), 0.5).build())
    assert "spec.pipeline.gradientTokens" in info.value.paths
    shape = TrainingShape(1, 4, 256, compression="delta", gradient_tokens=0.25)
    back = wire_bytes_per_value(shape, backward=True)
    assert back == pytest.approx(delta_gradient_bytes(GRADIENT_BITS) / 4 + 1 / 512)
    assert wire_bytes_per_value(TrainingShape(1, 4, 256, compression="delta"), True) == (
        delta_gradient_bytes(GRADIENT_BITS)
    )


def test_the_stages_are_given_the_share_only_where_they_run_delta() -> None:
    job = parse_job(_tokens(Job().pipeline(compression="delta"), 0.25).build())
    ranges, ends = [(0, 2), (2, 4)], local_endpoints(2, 29500, 9400)
    docs = build_stage_configs(job, ranges, ends)
    assert [d["pipeline"]["gradientTokens"] for d in docs] == [0.25, 0.25]
    # `relaytrain run --local` sends nothing compressed over loopback, so no token is dropped.
    docs = build_stage_configs(job, ranges, ends, compression="none")
    assert [d["pipeline"]["gradientTokens"] for d in docs] == [1.0, 1.0]


# -- gradientFill: activations -------------------------------------------------------------


def test_the_filled_share_is_what_fits_in_the_room_between_the_floor_and_every_token() -> None:
    g = _gradient(2)
    g[1, 8:] = 0  # 40 of the 64 tokens have a gradient
    value = bytes_per_value(2)
    codes = 40 * 128 * value  # every live token's code
    fixed = FRAME_BYTES + 64 / 8  # the header and a bit a token
    assert share_within(g, 0.25, int(fixed + 0.5 * codes), value) == pytest.approx(0.5, abs=1e-3)
    assert share_within(g, 0.25, int(fixed + 0.1 * codes), value) == 0.25  # the floor
    assert share_within(g, 0.25, int(fixed + 2 * codes), value) == 1.0  # all, no more
    assert share_within(g, 1.0, 0, value) == 1.0  # every token already
    assert share_within(torch.zeros(2, 4, 8), 0.25, 10, value) == 1.0  # nothing to send


def test_a_received_frame_knows_its_bytes_on_the_link(link: tuple[Link, Link]) -> None:
    up, down = link
    frame = Frame("activation", 0, 0, {"hidden": _gradient(3)}, {"items": 5})
    prepared = prepare(frame, "int8")
    up.send(frame, "int8")
    assert down.recv(timeout=10).wire_bytes == 4 + len(prepared.head) + prepared.payload_bytes


def test_the_gradients_fill_what_their_activations_left_of_the_link(tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path / "wide", layers=4, hidden=256)
    steps = _bigram_steps(12)
    training = CLIPPED_TRAINING.model_copy(update={"steps": 12, "max_grad_norm": 1.0})

    def run(share: float, fill: bool, codec: Callable[[], BoundaryCodec]) -> PipelineRun:
        return run_pipeline_threads(
            model, even_splits(4, 2), steps, training, credentials=stage_credentials(2),
            compression="delta", gradient_tokens=share, gradient_fill=fill, codec=codec,
        )  # fmt: skip

    # Rows at int3's error, gradients at 4 bits: every token's gradient takes more bytes
    # than its activation, so the activations' bytes are what the gradients fill.
    dear = partial(codec_for, "int3", gradient_bits=4)
    floor, filled, every = run(0.1, False, dear), run(0.1, True, dear), run(1.0, False, dear)
    down, up = filled.boundary_bytes[0]
    assert floor.boundary_bytes[0][1] < 0.3 * down < every.boundary_bytes[0][1]
    assert 0.85 * down < up < 1.1 * down, (up, down)  # what was left, and about no more
    assert filled.losses[-1] < 0.97 * filled.losses[0], filled.losses
    assert floor.losses[-1] > filled.losses[-1] > every.losses[-1] - 0.01
    # With the defaults every token's gradient fits in its activation's bytes: all are
    # sent, bit for bit as with a share of 1.
    cheap = codec_for
    assert run(0.1, True, cheap).losses == run(1.0, False, cheap).losses


def test_the_spec_takes_a_fill_only_below_every_token_and_the_planner_prices_it() -> None:
    job = _tokens(Job().pipeline(compression="delta"), 0.25)
    parsed = parse_job(job.set("spec.pipeline.gradientFill", "activations").build())
    assert parsed.spec.pipeline.gradient_fill == "activations"
    with pytest.raises(SpecError, match="set gradientTokens below 1") as info:
        parse_job(Job().pipeline(compression="delta").set("spec.pipeline.gradientFill",
                                                          "activations").build())  # fmt: skip
    assert "spec.pipeline.gradientFill" in info.value.paths
    docs = build_stage_configs(parsed, [(0, 2), (2, 4)], local_endpoints(2, 29500, 9400))
    assert [d["pipeline"]["gradientFill"] for d in docs] == ["activations"] * 2
    # Priced at the share the activations' bytes leave room for: all of the tokens where a
    # row's first crossing (about 4.3 bits a value) outweighs every token's 2 bits, none
    # above; at int3's error and 4 bits, the activations' bytes themselves.
    quarter = TrainingShape(1, 4, 256, compression="delta", gradient_tokens=0.25)
    filled = TrainingShape(1, 4, 256, compression="delta", gradient_tokens=0.25,
                           gradient_fill=True)  # fmt: skip
    assert wire_bytes_per_value(filled, True) == delta_gradient_bytes(GRADIENT_BITS)
    assert wire_bytes_per_value(quarter, True) < wire_bytes_per_value(filled, True)
    dear = dataclasses.replace(filled, gradient_bits=4, activation_bits=3)
    forward = wire_bytes_per_value(dear)
    assert forward < delta_gradient_bytes(4)
    assert wire_bytes_per_value(dear, True) == pytest.approx(forward + 1 / 512)
