"""Several pipelines on one fleet: the micro-batch split, the set of pipelines, the sync price,
and `relaytrain plan --replicas/--sync`.

The split is checked against every way of sharing M micro-batches among R pipelines; the set
search against every multiset of the candidate pipelines it starts from.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from relaytrain_operator import cli
from relaytrain_operator.domain.planner import (
    Catalog,
    CostSettings,
    GpuSpec,
    ModelShape,
    PlanError,
    Pool,
    Sync,
    TrainingShape,
    plan,
    plan_fleet,
    pools_from_file,
    split_micro_batches,
)
from relaytrain_operator.domain.planner.fleet import Pipe, candidates
from relaytrain_operator.domain.planner.fleet_candidates import pipe_of_plan
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN
from relaytrain_operator.domain.planner.problem import build_problem, floor_lines
from relaytrain_operator.domain.planner.shares import Lane, slowest_seconds, split_fast
from relaytrain_operator.domain.planner.steptime import (
    PLAYED_MICROS,
    PlannedSteps,
    StepShape,
    step_seconds,
)
from relaytrain_operator.domain.planner.sync import Gradients, fold_rounds, sync_seconds, top_two
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HACK_POOLS = ROOT / "hack" / "pools.yaml"
LAB = Job.example("finetunejob-lora").training(micro_batches=64)
"""The LoRA example with 64 micro-batches a step: room for many pipelines."""
LLAMA_CONFIG = ROOT / "operator" / "relaytrain_operator" / "known_models" / "llama-3.1-8b.json"


def relaytrain(*argv: str) -> int:
    return cli.main(list(argv))


# --- the micro-batch split ------------------------------------------------------------------


def brute_force_split(pipelines: list[Lane], m: int) -> float:
    """Smallest slowest-pipeline time over every composition of m into len(pipelines) parts."""
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(m + 1), len(pipelines) - 1):
        shares = [b - a for a, b in itertools.pairwise((0, *cuts, m))]
        best = min(best, slowest_seconds(pipelines, shares))
    return best


def proportional(pipelines: list[Lane], m: int) -> list[int]:
    """Shares in proportion to speed, largest remainders rounded up: the usual recipe."""
    rates = [1 / lane.period for lane in pipelines]
    raw = [m * r / sum(rates) for r in rates]
    shares = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - shares[i], reverse=True)
    for i in order[: m - sum(shares)]:
        shares[i] += 1
    return shares


beats = st.one_of(
    st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),  # ties and exact multiples
    st.floats(0.05, 4.0, allow_nan=False),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), beats), min_size=1, max_size=4),
    st.integers(0, 12),
)
def test_greedy_split_equals_brute_force(pipelines, m):
    pipelines = [Lane.of_beats(*p) for p in pipelines]
    shares = split_micro_batches(pipelines, m)
    assert sum(shares) == m and min(shares) >= 0
    optimum = brute_force_split(pipelines, m)
    assert slowest_seconds(pipelines, shares) == pytest.approx(optimum, rel=1e-12, abs=1e-12)
    # The search's faster variant reaches the same optimum.
    fast = split_fast(pipelines, m)
    assert sum(fast) == m
    assert slowest_seconds(pipelines, fast) == pytest.approx(optimum, rel=1e-12, abs=1e-12)


def test_greedy_beats_shares_in_proportion_to_speed():
    """Equally fast pipelines, one of 1 stage and one of 8: the long one's fill costs 7 beats,
    so it should get (almost) nothing; shares by speed give it half."""
    pipelines = [Lane.of_beats(1, 1.0), Lane.of_beats(8, 1.0)]
    greedy = split_micro_batches(pipelines, 8)
    assert slowest_seconds(pipelines, greedy) == brute_force_split(pipelines, 8) == 8.0
    assert slowest_seconds(pipelines, proportional(pipelines, 8)) == 11.0
    assert greedy in ([8, 0], [7, 1])


def test_pipeline_time_is_fill_and_drain_plus_one_beat_per_micro_batch():
    lane = Lane.of_beats(4, 0.5)
    assert (lane.seconds(0), lane.seconds(1), lane.seconds(10)) == (0.0, 2.0, 6.5)


def _drawn_lane(draw, most_stages, latencies, steps=None):
    """One pipeline over slow links with the line of its slowest resource under its step:
    ``steps`` (None: each count played alone) of a shape of up to ``most_stages`` stages."""
    p = draw(st.integers(1, most_stages))
    each = st.floats(0.0, 0.4)
    shape = StepShape(
        p,
        1,
        tuple(draw(st.floats(0.05, 0.5)) for _ in range(p)),
        tuple(draw(each) for _ in range(p - 1)),
        tuple(draw(each) for _ in range(p - 1)),
        tuple(draw(latencies) for _ in range(p - 1)),
        ahead=draw(st.sampled_from([0, 2])),
    )
    lines = floor_lines(shape)
    period = max(b for _, b in lines)
    fill = max(a for a, b in lines if b == period)
    if steps is None:
        return Lane(lambda m, s=shape: step_seconds(replace(s, micros=m)), fill, period)
    return Lane(steps(shape), fill, period, linear_after=PLAYED_MICROS)


@st.composite
def played_lanes(draw):
    """Lanes of pipelines over slow links, played out (`steptime`), with the line of their
    slowest resource under them: what the fleet planner splits by."""
    latencies = st.floats(0.0, 0.1)
    return [_drawn_lane(draw, 4, latencies) for _ in range(draw(st.integers(1, 4)))]


@settings(max_examples=150, deadline=None)
@given(played_lanes(), st.integers(0, 10))
def test_split_of_played_out_steps_equals_brute_force(pipelines, m):
    """Steps over slow links grow unevenly with their micro-batches (fill, round trips):
    the greedy split is still the best, the fast one reaches it, and each lane's line is
    under its step (what the fast split and the set search's bound rely on)."""
    for lane in pipelines:
        for k in range(1, m + 1):
            assert lane.seconds(k) >= (lane.fill + k * lane.period) * (1 - 1e-9)
    optimum = brute_force_split(pipelines, m)
    for split in (split_micro_batches, split_fast):
        shares = split(pipelines, m)
        assert sum(shares) == m and min(shares) >= 0
        assert slowest_seconds(pipelines, shares) == pytest.approx(optimum, rel=1e-12, abs=1e-12)


@st.composite
def planned_lanes(draw):
    """Up to 24 lanes as the fleet planner builds them (`Problem.lane`): steps played out to
    64 micro-batches and a line beyond (`PlannedSteps`), some with fills long enough that
    they deserve none of a small step."""
    latencies = st.sampled_from([0.0, 0.01, 0.5, 3.0])
    count = draw(st.integers(1, 24))
    return [_drawn_lane(draw, 12, latencies, PlannedSteps) for _ in range(count)]


@settings(max_examples=120, deadline=None)
@given(planned_lanes(), st.sampled_from([1, 7, 64, 65, 300, 1024, 2500]))
def test_the_fast_split_is_the_greedy_split_at_any_step_size(pipelines, m):
    """`split_fast` starts near the M-th finish time (the lines' bound, then secant steps),
    adds or gives back micro-batches one at a time, and must end on the greedy's own split:
    the same shares, ties included."""
    assert split_fast(pipelines, m) == split_micro_batches(pipelines, m)


# --- the set of pipelines -------------------------------------------------------------------


collectives = st.sampled_from(["all-gather", "ring"])


@st.composite
def fleets(draw):
    hidden = draw(st.sampled_from([128, 256]))
    model = ModelShape(
        num_layers=draw(st.integers(2, 6)),
        hidden_size=hidden,
        intermediate_size=draw(st.sampled_from([512, 1024])),
        num_heads=4,
        num_kv_heads=draw(st.sampled_from([1, 4])),
        head_dim=hidden // 4,
        vocab_size=draw(st.sampled_from([64, 1024])),
        tie_word_embeddings=draw(st.booleans()),
    )
    training = TrainingShape(
        micro_batch_size=draw(st.integers(1, 2)),
        micro_batches=draw(st.integers(1, 12)),
        sequence_length=draw(st.sampled_from([64, 256])),
        method=draw(st.sampled_from(["lora", "qlora", "full"])),
        lora_rank=draw(st.sampled_from([4, 16])),
        compression=draw(st.sampled_from(["none", "int8"])),
        dtype=draw(st.sampled_from(["bfloat16", "float32"])),
    )
    gpus, pools = {}, []
    for i in range(draw(st.integers(1, 3))):
        name = f"g{i}"
        gpus[name] = GpuSpec(
            product=name,
            tflops=draw(st.floats(0.2, 2)),
            fp32_tflops=draw(st.floats(0.1, 1)),
            memory_mib=draw(st.integers(8, 300)),
            memory_bandwidth_gbs=draw(st.floats(100, 5000)),
            bf16=True,
        )
        bandwidth, latency = draw(st.floats(20, 100_000)), draw(st.floats(0, 0.05))
        pools.append(Pool(name, name, draw(st.integers(1, 3)), bandwidth, latency))
    sync = draw(st.sampled_from([Sync(), Sync("periodic", 4), Sync("periodic", 10**6)]))
    cost = CostSettings(memory_margin=0.0, reserved_mib=0, sync_collective=draw(collectives))
    return model, training, pools, Catalog(gpus), sync, cost


def brute_force_sets(
    pipes: list[Pipe], gpus: list[int], m: int, sync: Sync, collective: str, adapters: bool
) -> float:
    """Smallest step over every multiset of ``pipes`` that fits the GPUs (R >= 2)."""
    best = float("inf")

    def extend(start: int, chosen: list[Pipe], left: list[int]) -> None:
        nonlocal best
        if len(chosen) >= 2:
            lanes = [p.lane for p in chosen]
            shares = split_micro_batches(lanes, m)
            hop = top_two([p.latency for p in chosen])
            load = max(p.load for p in chosen)
            rounds = fold_rounds(sync, collective, adapters, shares)
            moved, latency = sync_seconds(sync, collective, len(chosen), load, hop, rounds=rounds)
            best = min(best, slowest_seconds(lanes, shares) + (moved + latency) / sync.every)
        if len(chosen) == m:
            return
        for j in range(start, len(pipes)):
            rest = [x - c for x, c in zip(left, pipes[j].counts, strict=True)]
            if min(rest) >= 0:
                extend(j, [*chosen, pipes[j]], rest)

    extend(0, [], list(gpus))
    return best


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_set_search_equals_brute_force_over_its_candidates(fleet):
    """Every multiset of the candidate pipelines (before pruning the dominated ones) and the
    single-pipeline plan's pipeline: the planner's step is the smallest. The single plan's
    pipeline combines with others where it leaves GPUs free (a fleet of 3+1+3 GPUs whose
    single plan skips the 20 Mbit/s pool: it beats every candidate set; a brute force over
    the candidates alone failed one run in a few)."""
    model, training, pools, catalog, sync, cost = fleet
    try:
        single = plan(model, training, pools, catalog, settings=cost)
    except PlanError:
        event("infeasible")
        with pytest.raises(PlanError):
            plan_fleet(model, training, pools, catalog, settings=cost, sync=sync)
        return
    problem = build_problem(model, training, pools, catalog, cost)
    grads = Gradients.of(model, training, sync)
    pipes = [*candidates(problem, grads), pipe_of_plan(problem, grads, single)]
    best_set = brute_force_sets(
        pipes,
        problem.gpus,
        training.micro_batches,
        sync,
        cost.sync_collective,
        training.method != "full",
    )
    # `auto`: several pipelines only where they beat the single one by the margin.
    bar = single.step_seconds / (1 + GROWTH_MARGIN)
    optimum = best_set if best_set < bar * (1 - 1e-9) else single.step_seconds
    # Unbounded, the search is exact; within its default budget it is at least no worse.
    result = plan_fleet(model, training, pools, catalog, settings=cost, sync=sync, set_budget=10**9)
    event(f"{len(result.pipelines)} pipeline(s)")
    assert result.search == "exhaustive"
    assert result.step_seconds == pytest.approx(optimum, rel=1e-9)
    bounded = plan_fleet(model, training, pools, catalog, settings=cost, sync=sync)
    event(f"default budget: {bounded.search}")
    assert bounded.step_seconds >= optimum * (1 - 1e-9)
    if bounded.search == "exhaustive":
        assert bounded.step_seconds == pytest.approx(optimum, rel=1e-9)
    assert sum(p.micro_batches for p in result.pipelines) == training.micro_batches
    assert all(p.micro_batches >= 1 and p.fits for p in result.pipelines)
    used = {pool.name: 0 for pool in pools}
    for p in result.pipelines:
        assert p.stages[0].layer_start == 0 and p.stages[-1].layer_end == model.num_layers
        for s in p.stages:
            used[s.pool] += 1
    assert all(used[pool.name] <= pool.gpus for pool in pools)
    if len(result.pipelines) == 1:
        assert result.pipelines[0] == single


# --- the lab fleet: the must-show -----------------------------------------------------

LLAMA = ModelShape.from_hf_config(json.loads(LLAMA_CONFIG.read_text()))
# examples/finetunejob-lora.yaml's settings (4 x 256 tokens, LoRA r8 on q,k,v,o, bf16, int8
# links) with 64 micro-batches per step.
LAB_TRAINING = TrainingShape(4, 64, 256, compression="int8")


def lab_pools() -> list[Pool]:
    return pools_from_file(yaml.safe_load(HACK_POOLS.read_text()))


def test_lab_fleet_uses_most_gpus_for_at_least_1_8x_the_best_single_pipeline():
    pools = lab_pools()
    assert sum(p.gpus for p in pools) == 10
    single = plan(LLAMA, LAB_TRAINING, pools)
    assert len(single.stages) == 1  # today: one H100, nine GPUs idle
    # Outer steps every 8 (float64 weights): both H100s, both A100s and a pair of RTX 4090s.
    periodic = plan_fleet(LLAMA, LAB_TRAINING, pools, sync=Sync("periodic", 8))
    assert periodic.gpus >= 6 and periodic.speedup >= 1.8
    # Every 4, the outer steps' bytes eat what the 4090s add: they gain under 1 % over the
    # H100s and A100s alone.
    every4 = plan_fleet(LLAMA, LAB_TRAINING, pools, sync=Sync("periodic", 4))
    fast = plan_fleet(LLAMA, LAB_TRAINING, pools, sync=Sync("periodic", 4), replicas=4)
    assert {s.pool for p in fast.pipelines for s in p.stages} == {"h100", "a100"}
    assert fast.step_seconds * 0.99 <= every4.step_seconds <= fast.step_seconds
    assert 1.8 <= every4.speedup < periodic.speedup
    assert periodic.single == single
    # Synchronous, every usable GPU: the per-step exchange of the fp32 LoRA gradients costs
    # more than the 4090 pairs add; left to choose, the planner leaves them out. Adding the
    # micro-batches' gradients in the global order (bit for bit single-process training for
    # any shares) costs a round per pipeline with several micro-batches: the two H100s
    # (1.78x) now beat the three pipelines that were 1.82x with each pipeline's own sum.
    auto = plan_fleet(LLAMA, LAB_TRAINING, pools)
    everyone = plan_fleet(LLAMA, LAB_TRAINING, pools, replicas=6)
    assert everyone.gpus == 8
    assert auto.speedup >= 1.75 and auto.speedup > everyone.speedup > 1.0
    assert auto.step_seconds == pytest.approx(auto.pipeline_seconds + auto.sync.per_step_seconds)


def test_sync_price_by_hand():
    """One-GPU pipelines on 8 Mbps (1 MB/s), 10 ms links; LoRA r8 on q, k, v, o in fp32."""
    pools = [Pool("h100", "NVIDIA-H100-80GB-HBM3", 3, 8, 10)]
    lora = 32 * 8 * (4096 + 4096 + 4096 + 1024 + 4096 + 1024 + 4096 + 4096) * 4
    hop = 0.010 + 0.010
    # All-gather (the worker's): each GPU sends its copy to the R - 1 others, one hop, and a
    # hop for the label-token counts at the start of a synchronous step. Every pipeline but
    # the first trains several micro-batches, so each takes a round (two hops) to add them
    # in order; the last round's sum is its result, the others cost the leader one copy more.
    two = plan_fleet(LLAMA, LAB_TRAINING, pools, replicas=2)
    assert two.sync.gradient_bytes == lora
    assert [p.micro_batches for p in two.pipelines] == [32, 32] and two.sync.rounds == 1
    assert two.sync.seconds == pytest.approx(lora / 1e6 + 2 * hop + hop)
    three = plan_fleet(LLAMA, LAB_TRAINING, pools, replicas=3)
    assert three.sync.rounds == 2
    assert three.sync.seconds == pytest.approx(3 * lora / 1e6 + 4 * hop + hop)
    # A round per pipeline after the largest share's with several micro-batches; none for
    # full training (each pipeline's own sum), periodic outer steps or a ring.
    rounds = partial(fold_rounds, Sync(), "all-gather", True)
    cases = ([4, 1, 1], [3, 2, 1], [3, 3, 1], [1, 1], [2, 2, 2])
    assert [rounds(c) for c in cases] == [0, 1, 1, 0, 2]
    assert fold_rounds(Sync(), "all-gather", False, [3, 3, 1]) == 0
    assert fold_rounds(Sync("periodic", 4), "all-gather", True, [3, 3, 1]) == 0
    assert fold_rounds(Sync(), "ring", True, [3, 3, 1]) == 0
    # A ring: 2(R - 1)/R copies, 2(R - 1) hops.
    ring = CostSettings(sync_collective="ring")
    three_ring = plan_fleet(LLAMA, LAB_TRAINING, pools, settings=ring, replicas=3)
    assert three_ring.sync.seconds == pytest.approx(4 / 3 * lora / 1e6 + 4 * hop + hop)
    # Periodic: one exchange every H steps, no token counts, of the float64 weights (the
    # worker's outer step): twice the fp32 gradients' bytes.
    every8 = plan_fleet(LLAMA, LAB_TRAINING, pools, replicas=2, sync=Sync("periodic", 8))
    assert every8.sync.gradient_bytes == 2 * lora
    assert every8.sync.per_step_seconds == pytest.approx((2 * lora / 1e6 + hop) / 8)


@pytest.mark.parametrize(
    "pools",
    [
        # One GPU: nothing to combine.
        [Pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 1000, 10)],
        # Two H100s behind 10 Mbps links: the gradients would take seconds to reduce.
        [Pool("h100", "NVIDIA-H100-80GB-HBM3", 2, 10, 100)],
    ],
    ids=["one-gpu", "slow-links"],
)
def test_one_pipeline_wins_when_sync_is_prohibitive_and_is_todays_plan(pools):
    result = plan_fleet(LLAMA, LAB_TRAINING, pools)
    today = plan(LLAMA, LAB_TRAINING, pools)
    assert result.pipelines == (today,)
    assert result.to_dict() == today.to_dict()
    assert result.step_seconds == today.step_seconds


def test_too_many_replicas_say_how_many_fit():
    pools = [Pool("h100", "NVIDIA-H100-80GB-HBM3", 2, 1000, 10)]
    with pytest.raises(PlanError, match=r"3 pipelines do not fit .* at most 2"):
        plan_fleet(LLAMA, LAB_TRAINING, pools, replicas=3)
    with pytest.raises(PlanError, match="at least one micro-batch each"):
        plan_fleet(LLAMA, TrainingShape(4, 2, 256), pools, replicas=3)


# --- relaytrain plan --------------------------------------------------------------------------


@pytest.fixture
def lab_job(tmp_path: Path) -> Path:
    return LAB.write(tmp_path / "job.yaml")


def plan_args(job: Path, *extra: str) -> list[str]:
    return [
        "plan",
        str(job),
        "--nodes",
        str(HACK_POOLS),
        "--model-config",
        str(LLAMA_CONFIG),
        "--replicas",
        "auto",
        *extra,
    ]


def test_json_lists_the_pipelines_with_their_shares(lab_job, capsys):
    assert relaytrain(*plan_args(lab_job, "--json", "--sync", "periodic", "--sync-every", "8")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"] == "smollm-lora" and doc["model"]["layers"] == 32
    assert doc["pipelineCount"] == len(doc["pipelines"]) >= 2
    assert doc["gpuCount"] >= 6 and doc["speedupOverSinglePipeline"] >= 1.8
    assert sum(p["microBatches"] for p in doc["pipelines"]) == doc["microBatches"] == 64
    assert doc["sync"]["mode"] == "periodic" and doc["sync"]["everySteps"] == 8
    assert doc["sync"]["exchanged"] == "weights" and doc["sync"]["gradientDtype"] == "float64"
    for p in doc["pipelines"]:
        assert p["stages"][0]["layerStart"] == 0 and p["stages"][-1]["layerEnd"] == 32
        assert p["predictedTokensPerSecond"] > 0 and p["predictedStepSeconds"] > 0
        assert p["predictedStepSeconds"] <= doc["predictedPipelineSeconds"]
    total = sum(p["predictedTokensPerSecond"] for p in doc["pipelines"])
    assert doc["predictedTokensPerSecond"] <= total


def test_table_shows_every_pipeline_the_sync_and_the_gain(lab_job, capsys):
    assert relaytrain(*plan_args(lab_job, "--sync", "periodic", "--sync-every", "8")) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for smollm-lora: 5 pipelines on 6 of 8 usable GPU(s)")
    assert out.count("STAGE  POOL") == 5 and out.count("Bottleneck: stage") == 5
    assert "Pipeline 4: 2 stage(s)" in out
    assert "Sync: periodic, every 8 steps: all-gather of 52.0 MiB of float64 LoRA weights" in out
    assert "x the best single pipeline (14,707 tokens/s on 1 GPU(s))" in out


def test_replicas_1_is_todays_output(lab_job, capsys):
    from relaytrain_operator.cli.plan_format import format_table
    from relaytrain_operator.domain.planner import DEFAULT_CATALOG

    today = plan(LLAMA, LAB_TRAINING, lab_pools(), DEFAULT_CATALOG)
    assert relaytrain(*plan_args(lab_job, "--replicas", "1", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    chosen = ("job", "model", "compression", "forwardsAhead", "measured")
    assert {k: v for k, v in doc.items() if k not in chosen} == today.to_dict()
    assert doc["compression"] == "int8"  # the job's code, which the plan priced
    assert doc["forwardsAhead"] == 0  # and its forwards ahead
    assert doc["measured"] == {}  # the built-in catalog's cards measured nothing
    assert relaytrain(*plan_args(lab_job, "--replicas", "1")) == 0
    out = capsys.readouterr().out
    body = format_table("smollm-lora", LAB_TRAINING, today).split("\n")
    assert out.split("\n")[0] == body[0]
    assert out.rstrip("\n").split("\n")[-len(body) + 1 :] == body[1:]


def test_without_replicas_the_plan_is_the_single_pipeline_the_operator_deploys(lab_job, capsys):
    args = ["plan", str(lab_job), "--nodes", str(HACK_POOLS), "--model-config", str(LLAMA_CONFIG)]
    assert relaytrain(*args, "--json") == 0
    default = json.loads(capsys.readouterr().out)
    assert relaytrain(*args, "--json", "--replicas", "1") == 0
    assert default == json.loads(capsys.readouterr().out)
    assert "pipelines" not in default


def test_the_jobs_replicas_are_the_default_and_the_flag_overrides_them(lab_job, capsys):
    LAB.pipeline(replicas="auto").write(lab_job)
    args = ["plan", str(lab_job), "--nodes", str(HACK_POOLS), "--model-config", str(LLAMA_CONFIG)]
    assert relaytrain(*args, "--json") == 0
    default = json.loads(capsys.readouterr().out)
    assert relaytrain(*args, "--json", "--replicas", "auto") == 0
    assert default == json.loads(capsys.readouterr().out)
    assert default["pipelineCount"] >= 2
    assert relaytrain(*args, "--json", "--replicas", "1") == 0
    assert "pipelines" not in json.loads(capsys.readouterr().out)
    LAB.pipeline(replicas=2).write(lab_job)
    assert relaytrain(*args, "--json") == 0
    assert json.loads(capsys.readouterr().out)["pipelineCount"] == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--replicas", "two"], "argument --replicas: must be 'auto' or a positive integer"),
        (["--replicas", "0"], "argument --replicas: must be 'auto' or a positive integer"),
        (["--sync", "sometimes"], "argument --sync: invalid choice: 'sometimes'"),
        (["--sync", "periodic", "--sync-every", "-1"], "argument --sync-every: must be a positive"),
    ],
)
def test_bad_flag_values_name_the_flag_and_what_is_valid(lab_job, extra, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        relaytrain(*plan_args(lab_job, *extra))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "--sync" in extra and "sometimes" in extra:
        assert "synchronous" in err and "periodic" in err


@pytest.mark.parametrize(
    ("extra", "message", "code"),
    [
        (["--sync", "periodic"], "--sync periodic needs --sync-every H", 2),
        (["--sync-every", "4"], "--sync-every 4 needs --sync periodic", 2),
        (["--replicas", "9"], "9 pipelines do not fit on the usable GPUs (8)", 1),
    ],
)
def test_inconsistent_sync_or_replicas_exit_with_a_reason(lab_job, extra, message, code, capsys):
    assert relaytrain(*plan_args(lab_job, *extra)) == code
    assert message in capsys.readouterr().err
