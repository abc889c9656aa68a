"""The planner's settings for slow links. `pipeline.compression: auto` takes the most faithful
code that costs at most 5 % of the fastest plan's tokens/s, and the stage documents carry its
choice; `pipeline.forwardsAhead` is counted in every stage's memory but the last's, and
`forwardsAhead: auto` takes the fewest whose step, played out over the plan's links, is within
5 % of the fastest that memory allows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from relaytrain_operator.domain.planner import (
    AUTO_ORDER,
    ModelShape,
    Plan,
    Pool,
    TrainingShape,
    choose_compression,
    choose_forwards_ahead,
    link_cost,
    plan,
)
from relaytrain_operator.domain.planner.choose import AHEAD_MARGIN, AUTO_MARGIN
from relaytrain_operator.domain.planner.link_cost import LinkCost
from relaytrain_operator.domain.planner.problem import build_problem
from relaytrain_operator.domain.planner.steptime import StepShape, step_seconds
from relaytrain_operator.domain.planning import make_plan
from relaytrain_operator.domain.stage_config import build_pipeline_configs, local_endpoints
from relaytrain_operator.spec import parse_job
from relaytrain_testkit.decide_cases import node
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIG = json.loads(
    (REPO / "operator/relaytrain_operator/known_models/llama-3.1-8b.json").read_text()
)
LLAMA = ModelShape.from_hf_config(CONFIG)
TRAINING = TrainingShape(2, 16, 2048, method="qlora", lora_rank=16)


def _fleet(mbps: float, ms: float = 20.0) -> list[Pool]:
    """Four RTX 4090s, each on its own node behind a link of ``mbps`` and ``ms`` one way."""
    return [Pool("rtx", "NVIDIA-GeForce-RTX-4090", 4, mbps, ms)]


@pytest.mark.parametrize("mbps", [100.0, 1_000.0, 100_000.0])
def test_auto_takes_the_most_faithful_code_within_five_percent_of_the_fastest(
    mbps: float,
) -> None:
    pools = _fleet(mbps)
    every = {
        mode: plan(LLAMA, TrainingShape(**{**TRAINING.__dict__, "compression": mode}), pools)
        for mode in AUTO_ORDER
    }
    fastest = max(p.tokens_per_second for p in every.values())
    chosen, result = choose_compression(lambda t: plan(LLAMA, t, pools), TRAINING)
    assert result.tokens_per_second == every[chosen].tokens_per_second
    assert result.tokens_per_second >= (1 - AUTO_MARGIN) * fastest
    # Every more faithful code is more than 5 % slower than the fastest.
    for mode in AUTO_ORDER[: AUTO_ORDER.index(chosen)]:
        assert every[mode].tokens_per_second < (1 - AUTO_MARGIN) * fastest, mode
    if mbps >= 100_000:  # a link no code is waiting on: exact boundaries
        assert chosen == "none"
    if mbps <= 100:  # a home connection: the smallest code whose coding is not the bottleneck
        assert chosen == "int4"


def test_auto_weighs_the_cpu_time_of_the_delta_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 100 Mbit/s delta's wire bytes are the fewest (int4's forward, 3.25 bits back), but
    its codec costs about 17 ns a value forward on a GPU stage (bench/bench_codec_speed.py
    on an H200): 0.29 s of a micro-batch's 16.8 M boundary values, on each frame's way (its
    encoder, beside the compute), more than its bytes save. Free, the step would be shorter;
    a job of steps prices delta's activations at about int4's rate, so int4 stays ahead."""
    pools = _fleet(100.0)
    delta = TrainingShape(**{**TRAINING.__dict__, "compression": "delta"})
    int4 = TrainingShape(**{**TRAINING.__dict__, "compression": "int4"})
    link = LinkCost.of(LLAMA, delta)
    values = TRAINING.tokens_per_micro_batch * LLAMA.hidden_size
    coded = values * link_cost.wire_bytes_per_value(delta)  # what the receiver inflates back
    assert link.forward_codec_seconds == pytest.approx(
        values * link_cost.DELTA_FORWARD_CODEC_SECONDS + coded * link_cost.INFLATE_SECONDS_PER_BYTE
    )
    assert LinkCost.of(LLAMA, int4).forward_codec_seconds == 0
    coded = plan(LLAMA, delta, pools)
    assert coded.tokens_per_second < plan(LLAMA, int4, pools).tokens_per_second
    monkeypatch.setattr(link_cost, "DELTA_FORWARD_CODEC_SECONDS", 0.0)
    monkeypatch.setattr(link_cost, "DELTA_BACKWARD_CODEC_SECONDS", 0.0)
    assert plan(LLAMA, delta, pools).step_seconds < coded.step_seconds
    chosen, _ = choose_compression(lambda t: plan(LLAMA, t, pools), TRAINING)
    assert chosen == "int4"


def test_deflate_is_hidden_behind_a_slow_links_send_and_charged_beyond_a_fast_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A link's encoder thread deflates a frame while its sender sends the one before: at
    50 Mbit/s a byte takes longer to send than to deflate, and the stages' beat is the
    link's, deflate or not; at 10 Gbit/s the deflate outlasts the send, and the beat is the
    encoder's. Either way each frame waits for its own deflate (the step played out)."""
    delta = replace(TRAINING, compression="delta")

    def middle_stages_side() -> list[float]:
        """A middle stage's busiest resource beside its compute, at 50 Mbit/s and 10 Gbit/s."""
        sides = []
        for mbps in (50.0, 10_000.0):
            problem = build_problem(LLAMA, delta, _fleet(mbps))
            (rtx,) = problem.costs
            sides.append(problem.link.side_seconds(rtx, rtx, rtx))
        return sides

    slow, fast = middle_stages_side()
    slow_step = plan(LLAMA, delta, _fleet(100.0), stages=4).step_seconds
    monkeypatch.setattr(link_cost, "DEFLATE_SECONDS_PER_BYTE", 0.0)
    free_slow, free_fast = middle_stages_side()
    assert slow == free_slow
    assert fast > free_fast
    assert slow_step > plan(LLAMA, delta, _fleet(100.0), stages=4).step_seconds


def test_delta_is_priced_at_its_runs_mean_where_the_job_counts_epochs() -> None:
    """A job of epochs pays delta's first-crossing rate for one of them and
    ``DELTA_LATER_SHARE`` of it for the rest; a job of steps (passes unknown) is priced at the
    first epoch's rate; either less deflate's floor. Gradients and the other codes do not
    depend on the epochs."""
    saves = 1 - link_cost.DEFLATE_FORWARD_SAVES
    first = link_cost.delta_first_bytes(4, TRAINING.sequence_length) * saves
    share = link_cost.DELTA_LATER_SHARE
    delta = replace(TRAINING, compression="delta")
    values = TRAINING.tokens_per_micro_batch * LLAMA.hidden_size
    labels = TRAINING.tokens_per_micro_batch * link_cost.LABEL_BYTES_PER_TOKEN
    steps = LinkCost.of(LLAMA, delta)
    assert steps.forward_bytes == pytest.approx(values * first + labels)
    assert LinkCost.of(LLAMA, replace(delta, epochs=1)) == steps
    four = LinkCost.of(LLAMA, replace(delta, epochs=4))
    assert four.forward_bytes == pytest.approx(values * first * (1 + 3 * share) / 4 + labels)
    assert four.backward_bytes == steps.backward_bytes
    int3 = LinkCost.of(LLAMA, replace(delta, epochs=4, activation_bits=3))
    assert int3.forward_bytes == pytest.approx(
        values * link_cost.delta_first_bytes(3, TRAINING.sequence_length) * saves
        * (1 + 3 * share) / 4 + labels
    )  # fmt: skip
    int4 = replace(TRAINING, compression="int4")
    assert LinkCost.of(LLAMA, replace(int4, epochs=4)) == LinkCost.of(LLAMA, int4)
    with pytest.raises(ValueError, match="training epochs must be a positive integer"):
        replace(TRAINING, epochs=0)


@pytest.mark.parametrize(("mbps", "epochs", "want"), [
    (50.0, None, "int4"),  # a job of steps: delta at its first epoch's rate, about int4's
    (50.0, 1, "int4"),
    # Later epochs code what changed: fewer bytes than int4 at the link. At 50 Mbit/s the
    # step's round trips (no forwards ahead: these cards hold none) leave that 4-5 % of it.
    (50.0, 6, "int4"),
    (20.0, 3, "delta"),
    (20.0, 6, "delta"),
    # At 1 Mbit/s the activations' direction alone sets the pace: a job of steps, priced at
    # the first epoch's rate (int4's and the sink), keeps int4; one of 3 epochs takes delta.
    (1.0, None, "int4"),
    (1.0, 3, "delta"),
    (1_000.0, 6, "int4"),  # the link waits less than delta's codec costs on the card
    (100_000.0, 3, "none"),  # no link waits: exact boundaries whatever the epochs
])  # fmt: skip
def test_auto_takes_delta_where_the_job_counts_more_than_one_epoch_over_slow_links(
    mbps: float, epochs: int | None, want: str
) -> None:
    pools = _fleet(mbps)
    training = replace(TRAINING, epochs=epochs)
    chosen, result = choose_compression(lambda t: plan(LLAMA, t, pools), training)
    assert chosen == want
    if want == "delta":  # and it buys more than the margin over int4
        int4 = plan(LLAMA, replace(training, compression="int4"), pools)
        assert int4.tokens_per_second < (1 - AUTO_MARGIN) * result.tokens_per_second


def test_a_job_with_auto_records_the_choice_in_its_plan_and_its_stage_documents() -> None:
    manifest = (
        Job("auto-links")
        .model("s3://models/llama-3.1-8b/", dtype="bfloat16")
        .dataset("s3://data/train.jsonl", sequence_length=2048)
        .method("qlora", rank=16)
        .training(steps=10, micro_batch_size=2, micro_batches=16)
        .pipeline(stages=4, compression="auto")
        .build()
    )
    job = parse_job(manifest, default_checkpoint_uri="s3://ckpt")
    nodes = [node(f"rtx-{i}", "rtx") for i in range(4)]
    status = make_plan(job, CONFIG, nodes, [], default_link=(100.0, 20.0))  # home links
    assert status["compression"] == "int4"
    # Over 20 Mbit/s links the job of steps takes delta (priced at its first epoch's rate,
    # its gradients at 2 bits: with 3, before 2026-12-07, it kept int4), and so does a job
    # of 3 epochs, priced at its run's mean.
    assert make_plan(job, CONFIG, nodes, [], default_link=(20.0, 20.0))["compression"] == "delta"
    by_epochs = manifest | {"spec": manifest["spec"] | {"training": {
        **{k: v for k, v in manifest["spec"]["training"].items() if k != "steps"}, "epochs": 3,
    }}}  # fmt: skip
    epochs_job = parse_job(by_epochs, default_checkpoint_uri="s3://ckpt")
    slow = make_plan(epochs_job, CONFIG, nodes, [], default_link=(20.0, 20.0))
    assert slow["compression"] == "delta"
    ranges = [(s["layerStart"], s["layerEnd"]) for s in status["stages"]]
    (docs,) = build_pipeline_configs(
        job,
        [ranges],
        [local_endpoints(len(ranges), 9000, 9100)],
        [16],
        compression=status["compression"],
    )
    assert {d["pipeline"]["compression"] for d in docs} == {"int4"}
    # Without the plan's choice there is no code to give the stages, and that is said.
    with pytest.raises(ValueError, match=r"compression is auto.*status\.plan\.compression"):
        build_pipeline_configs(job, [ranges], [local_endpoints(len(ranges), 9000, 9100)], [16])


def test_forwards_ahead_are_held_in_every_stage_but_the_last() -> None:
    pools = [Pool("h100", "NVIDIA-H100-80GB-HBM3", 4, 100.0, 20.0)]
    training = replace(TRAINING, sequence_length=1024)  # memory to spare with 2 more held
    before = plan(LLAMA, training, pools, stages=4)
    after = plan(LLAMA, replace(training, forwards_ahead=2), pools, stages=4)
    for was, now in zip(before.stages, after.stages, strict=True):
        assert (now.layer_start, now.layer_end) == (was.layer_start, was.layer_end)
        if now.index < 3:
            assert now.in_flight == was.in_flight + 2
            assert now.memory_bytes > was.memory_bytes
        else:  # the last stage's backward needs nothing from later: it runs none ahead
            assert (now.in_flight, now.memory_bytes) == (was.in_flight, was.memory_bytes)


SHORT = replace(TRAINING, micro_batch_size=1, sequence_length=1024, compression="int8")
"""Rows short enough that four RTX 4090s hold a few more micro-batches of activations."""


def _steps(result: Plan) -> list[float]:
    return [result.step_seconds_ahead(a) for a in range(result.most_ahead + 1)]


def test_a_plans_timeline_is_its_own_stages_and_links_played_out_through_1f1b() -> None:
    """The step `forwardsAhead: auto` chooses by: each stage's compute, each link's frames
    over its bandwidth and both ends' latencies, 1F1B in the worker's order (`steptime`)."""
    result = plan(LLAMA, SHORT, _fleet(100.0), stages=4)
    link = LinkCost.of(LLAMA, SHORT)
    rate = 100.0 * 1e6 / 8
    shape = StepShape(
        4,
        16,
        compute=tuple(s.compute_seconds for s in result.stages),
        down=(link.forward_bytes / rate,) * 3,
        up=(link.backward_bytes / rate,) * 3,
        latency=(0.04,) * 3,  # 20 ms at each end
    )
    assert result.timeline == shape
    for ahead in (0, 2):
        assert result.step_seconds_ahead(ahead) == step_seconds(replace(shape, ahead=ahead))
    # Over slow links the step pays the first activation's way down and the last gradient's
    # way up on top of the busiest link's frames: more than those frames alone.
    assert result.step_seconds_ahead(0) > 16 * max(link.forward_bytes, link.backward_bytes) / rate


@pytest.mark.parametrize(("mbps", "ms"), [(100_000.0, 0.1), (100.0, 20.0), (100.0, 50.0)])
def test_forwards_ahead_auto_takes_the_fewest_within_the_margin_of_the_fastest_step(
    mbps: float, ms: float
) -> None:
    result = plan(LLAMA, SHORT, [Pool("rtx", "NVIDIA-GeForce-RTX-4090", 4, mbps, ms)], stages=4)
    steps = _steps(result)
    ahead = choose_forwards_ahead([result])
    fastest = min(steps)
    assert steps[ahead] <= (1 + AHEAD_MARGIN) * fastest
    assert all(s > (1 + AHEAD_MARGIN) * fastest for s in steps[:ahead])
    if mbps >= 100_000:  # no round trip worth hiding: none ahead, none of their memory
        assert ahead == 0
    else:  # a home connection: the stage before a link would wait a round trip a gradient
        assert ahead >= 1 and steps[ahead] < 0.9 * steps[0]


def test_forwards_ahead_auto_takes_none_where_the_stages_hold_no_more_activations() -> None:
    """Four RTX 4090s full with 2 rows of 2,048 tokens: a slow link's round trips would be
    worth hiding, but no stage has the memory for one more micro-batch."""
    training = replace(TRAINING, compression="int8")
    full = plan(LLAMA, training, _fleet(100.0), stages=4)
    assert full.most_ahead == 0 and full.bottleneck.resource == "link"
    assert full.step_seconds > 1.1 * full.step_seconds_ahead(2)  # were they held
    assert choose_forwards_ahead([full]) == 0
    roomy = plan(LLAMA, SHORT, _fleet(100.0), stages=4)
    assert 0 < roomy.most_ahead < 16  # held to what fits
    more = plan(LLAMA, replace(SHORT, forwards_ahead=roomy.most_ahead + 1), _fleet(100.0), stages=4)
    assert [(s.layer_start, s.layer_end) for s in more.stages] != [
        (s.layer_start, s.layer_end) for s in roomy.stages
    ]  # one more does not fit the split as it is: the search must move layers for it


def test_a_job_with_forwards_ahead_auto_records_the_choice_its_memory_and_its_documents() -> None:
    manifest = (
        Job("ahead-auto")
        .model("s3://models/llama-3.1-8b/", dtype="bfloat16")
        .dataset("s3://data/train.jsonl", sequence_length=1024)
        .method("qlora", rank=16)
        .training(steps=10, micro_batch_size=1, micro_batches=16)
        .pipeline(stages=4, compression="int8", forwards_ahead="auto")
        .build()
    )
    job = parse_job(manifest, default_checkpoint_uri="s3://ckpt")
    nodes = [node(f"rtx-{i}", "rtx") for i in range(4)]
    slow = make_plan(job, CONFIG, nodes, [], default_link=(100.0, 50.0))
    searched = plan(LLAMA, SHORT, _fleet(100.0, 50.0), stages=4)
    assert slow["forwardsAhead"] == choose_forwards_ahead([searched]) > 0
    # Its stages' memory counts the activations it holds ahead: planned again with them.
    again = plan(
        LLAMA, replace(SHORT, forwards_ahead=slow["forwardsAhead"]), _fleet(100.0, 50.0), stages=4
    )
    assert [s["predictedMemoryBytes"] for s in slow["stages"]] == [
        s.memory_bytes for s in again.stages
    ]
    fast = make_plan(job, CONFIG, nodes, [], default_link=(100_000.0, 0.1))
    assert fast["forwardsAhead"] == 0
    ranges = [(s["layerStart"], s["layerEnd"]) for s in slow["stages"]]
    ends = [local_endpoints(len(ranges), 9000, 9100)]
    (docs,) = build_pipeline_configs(
        job, [ranges], ends, [16], forwards_ahead=slow["forwardsAhead"]
    )
    assert {d["pipeline"]["forwardsAhead"] for d in docs} == {slow["forwardsAhead"]}
    # Without the plan's choice there is no number to give the stages, and that is said.
    with pytest.raises(ValueError, match=r"forwardsAhead is auto.*status\.plan\.forwardsAhead"):
        build_pipeline_configs(job, [ranges], ends, [16])
    # A job that names its number keeps it, and the plan says so.
    named = parse_job(
        manifest | {"spec": manifest["spec"] | {"pipeline": {"stages": 4, "forwardsAhead": 1}}},
        default_checkpoint_uri="s3://ckpt",
    )
    assert make_plan(named, CONFIG, nodes, [], default_link=(100.0, 50.0))["forwardsAhead"] == 1


def test_a_fitted_basis_costs_delta_its_share_of_each_fit_at_every_link_speed() -> None:
    """With ``activationBasis: fitted`` every activation frame pays a 96th of a basis's fit and
    bytes (rows priced as in the identity): delta plans slower against int4 than without it
    at every speed, enough at 1 Mbit/s that auto takes int4 for a job of steps (within 5 %),
    where a job of 6 epochs, whose later epochs cost less, takes delta; at 20 Mbit/s both take
    delta, the gradients' bytes at 2 bits (3 until 2026-12-07) deciding, and at 100 neither
    (docs/planner.md, "Fitted bases")."""
    for epochs in (None, 6):
        for mbps in (1.0, 20.0, 100.0):
            pools = _fleet(mbps)
            ratio = {}
            for basis in ("identity", "fitted"):
                training = replace(TRAINING, epochs=epochs, activation_basis=basis)
                tokens = {
                    mode: plan(LLAMA, replace(training, compression=mode), pools).tokens_per_second
                    for mode in ("delta", "int4")
                }
                ratio[basis] = tokens["delta"] / tokens["int4"]
                chosen, _ = choose_compression(lambda t, p=pools: plan(LLAMA, t, p), training)
                if basis == "fitted":
                    delta = mbps == 20.0 or (mbps == 1.0 and epochs is not None)
                    assert chosen == ("delta" if delta else "int4"), (epochs, mbps)
            assert ratio["fitted"] < ratio["identity"], (epochs, mbps, ratio)


def test_a_rows_sink_is_priced_at_eight_bits_on_its_first_crossing() -> None:
    """A pretrained model's first token crosses at 8 bits a value (its massive activations,
    `allocation.MASSIVE`), the row's other tokens at the code's: a short row pays more a value
    than a long one, by the sink's share. The plan cannot know whether the model has a sink
    and always prices one."""
    for bits in (3, 4):
        row = {}
        for tokens in (32, 512):
            shape = replace(TRAINING, compression="delta", activation_bits=bits)
            shape = replace(shape, sequence_length=tokens)
            row[tokens] = link_cost.wire_bytes_per_value(shape) * tokens
        # Each row: its tokens at the code's rate, and one token (8 - bits) bits a value dearer.
        rate = (row[512] - row[32]) / (512 - 32)
        assert row[32] - 32 * rate == pytest.approx((8 - bits) / 8)
        assert rate == pytest.approx(link_cost.DELTA_FIRST_BYTES - (4 - bits) / 8)
