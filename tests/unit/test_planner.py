"""The planner finds the best plan, keeps every stage within memory, and explains itself.

Optimality is checked against a brute force that tries every stage count, every sequence of
GPUs and every contiguous layer split, priced by the same cost model: the search's beats
exactly, and the plan's step, played out over its links, against the fastest played out.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    Catalog,
    CostSettings,
    GpuSpec,
    ModelShape,
    Plan,
    PlanError,
    Pool,
    TrainingShape,
    plan,
)
from relaytrain_operator.domain.planner.cost import pool_cost
from relaytrain_operator.domain.planner.problem import build_problem
from relaytrain_operator.domain.planner.search import exhaustive
from relaytrain_operator.domain.planner.steptime import step_seconds
from relaytrain_testkit.shapes import LLAMA31_8B_CONFIG, SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.unit

# Small GPUs so that memory binds on small models; no margin or reserve to keep sizes tiny.
TINY = CostSettings(memory_margin=0.0, reserved_mib=0)


@st.composite
def instances(
    draw, max_layers=7, max_gpus_per_pool=2, huge_memory=False, same_links=False, min_m=2
):
    hidden = draw(st.sampled_from([128, 256]))
    model = ModelShape(
        num_layers=draw(st.integers(2, max_layers)),
        hidden_size=hidden,
        intermediate_size=draw(st.sampled_from([512, 1024, 2048])),
        num_heads=4,
        num_kv_heads=draw(st.sampled_from([1, 2, 4])),
        head_dim=hidden // 4,
        # Small vocabularies: a large head would make the last stage the bottleneck always.
        vocab_size=draw(st.sampled_from([64, 256, 1024, 4096])),
        tie_word_embeddings=draw(st.booleans()),
    )
    training = TrainingShape(
        micro_batch_size=draw(st.integers(1, 4)),
        micro_batches=draw(st.integers(min_m, 24)),
        sequence_length=draw(st.sampled_from([32, 64, 128, 256])),
        method=draw(st.sampled_from(["lora", "qlora", "full"])),
        lora_rank=draw(st.sampled_from([4, 16])),
        compression=draw(st.sampled_from(["none", "bf16", "int8", "int4"])),
        dtype=draw(st.sampled_from(["bfloat16", "float32"])),
    )
    n_pools = draw(st.integers(2, 3))
    gpus = {}
    pools = []
    # Slow GPUs and quick links, so that splitting often pays and all three resources bind.
    link = (draw(st.floats(20, 100_000)), draw(st.floats(0, 0.3)))
    for i in range(n_pools):
        name = f"g{i}"
        memory = 1 << 20 if huge_memory else draw(st.integers(4, 300))
        gpus[name] = GpuSpec(
            product=name,
            tflops=draw(st.floats(0.2, 2)),
            fp32_tflops=draw(st.floats(0.1, 1)),
            memory_mib=memory,
            memory_bandwidth_gbs=draw(st.floats(100, 5000)),
            bf16=True,
        )
        bw, lat = link if same_links else (draw(st.floats(20, 100_000)), draw(st.floats(0, 0.3)))
        pools.append(Pool(name, name, draw(st.integers(1, max_gpus_per_pool)), bw, lat))
    return model, training, pools, Catalog(gpus)


def splits(model, training, pools, catalog):
    """Every stage count, GPU sequence and contiguous split that fits its GPUs: (sequence,
    layer counts, slowest beat), on the planner's own problem."""
    problem = build_problem(model, training, pools, catalog, TINY)
    costs, link = problem.costs, problem.link
    layers, m = model.num_layers, training.micro_batches
    for p in range(1, min(sum(x.gpus for x in pools), layers) + 1):
        for seq in itertools.product(range(len(pools)), repeat=p):
            if any(seq.count(i) > pool.gpus for i, pool in enumerate(pools)):
                continue
            for cuts in itertools.combinations(range(1, layers), p - 1):
                bounds = (0, *cuts, layers)
                counts = [bounds[k + 1] - bounds[k] for k in range(p)]
                worst = 0.0
                for k in range(p):
                    c, n = costs[seq[k]], counts[k]
                    first, last = k == 0, k == p - 1
                    if c.stage_bytes(n, first, last, min(p - k, m)) > c.available_bytes:
                        break
                    prev = costs[seq[k - 1]] if k else None
                    nxt = costs[seq[k + 1]] if k < p - 1 else None
                    compute = n * c.layer_seconds + c.fixed_seconds(first, last)
                    worst = max(worst, compute, link.side_seconds(prev, c, nxt))
                else:
                    yield problem, seq, counts, worst


def brute_force(model, training, pools, catalog) -> float | None:
    """The shortest step played out over every stage count, sequence and split."""
    steps = [
        step_seconds(problem.timeline(seq, counts))
        for problem, seq, counts, _ in splits(model, training, pools, catalog)
    ]
    return min(steps, default=None)


def assert_valid(result: Plan, model: ModelShape) -> None:
    """Stages cover every layer once, in order, and each fits its GPU."""
    assert result.stages[0].layer_start == 0
    assert result.stages[-1].layer_end == model.num_layers
    for a, b in itertools.pairwise(result.stages):
        assert a.layer_end == b.layer_start
    for s in result.stages:
        assert s.layers >= 1
        assert s.memory_bytes <= s.memory_available_bytes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_search_finds_the_smallest_slowest_beat_of_every_stage_count(instance):
    """Exact: for each stage count the search's best sequence and split has the smallest
    slowest beat of any that fits (its memory counted, links' directions and codes beside
    the compute)."""
    model, training, pools, catalog = instance
    best: dict[int, float] = {}
    for _, seq, _, worst in splits(model, training, pools, catalog):
        best[len(seq)] = min(best.get(len(seq), worst), worst)
    problem = build_problem(model, training, pools, catalog, TINY)
    for p in range(1, min(sum(problem.gpus), model.num_layers) + 1):
        found = exhaustive(problem.evaluator(), problem.gpus, [p])
        if p not in best:
            assert found.deficit
            continue
        event(f"{p} stage(s)")
        assert not found.deficit
        assert found.bottleneck == pytest.approx(best[p], rel=1e-9)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_plan_step_is_played_out_and_no_longer_than_the_beats_choice(instance):
    """The plan's step is its 1F1B played out over its links; it is never longer than the
    step of the search's best by beats played out (what the plan was before the step was
    played: `problem.solve`), and never shorter than the shortest over every stage count,
    sequence and split that fits (it is one of them). How far from that shortest the plan
    and the beats' best land, the events say (`--hypothesis-show-statistics`; docs/planner.md,
    "Search")."""
    model, training, pools, catalog = instance
    optimum = brute_force(model, training, pools, catalog)
    if optimum is None:
        event("infeasible")
        with pytest.raises(PlanError, match=r"do not fit|No GPU can hold"):
            plan(model, training, pools, catalog, settings=TINY)
        return
    result = plan(model, training, pools, catalog, settings=TINY)
    assert result.search == "exhaustive"
    assert result.step_seconds == pytest.approx(step_seconds(result.timeline))
    problem = build_problem(model, training, pools, catalog, TINY)
    counts = list(range(1, min(sum(problem.gpus), model.num_layers) + 1))
    by_beats = exhaustive(problem.evaluator(), problem.gpus, counts)
    assert result.step_seconds <= problem.played_out(by_beats) * (1 + 1e-9)
    assert result.step_seconds >= optimum * (1 - 1e-9)
    for who, step in (("plan", result.step_seconds), ("beats alone", problem.played_out(by_beats))):
        gap = step / optimum - 1
        event(
            f"{who}: " + ("shortest" if gap < 1e-9 else "within 5 %" if gap < 0.05 else "over 5 %")
        )
    assert_valid(result, model)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_layers=12, max_gpus_per_pool=4))
def test_heuristic_plans_always_fit_memory(instance):
    model, training, pools, catalog = instance
    try:
        result = plan(model, training, pools, catalog, settings=TINY, exhaustive_limit=0)
    except PlanError:
        return
    assert result.search == "heuristic"
    assert_valid(result, model)


CLEARLY = 0.10
"""How much more time for a layer the slower GPU must take (10 %) for the other to be clearly
faster: GPUs nearer than that are placed by the step played out (fill, drain, the first and
last stages' extra work), which the planner comes within a few per cent of
(test_plan_step_is_played_out_and_no_longer_than_the_beats_choice). An 8-layer case of GPUs
0.8 % apart gave the faster one fewer layers, on a plan 2.3 % longer than the best split."""


@settings(max_examples=150, deadline=None)
@given(instances(max_layers=16, max_gpus_per_pool=3, huge_memory=True, same_links=True, min_m=16))
def test_faster_gpu_never_gets_fewer_layers(instance):
    """Among stages with the same fixed costs (the interior ones when every link is alike),
    a stage on a clearly faster GPU (the other taking `CLEARLY` more time for a layer in the
    cost model: FLOP/s, and memory bandwidth where it binds, as QLoRA's dequantisation does —
    not the FLOP/s alone: a 13-layer QLoRA case had a GPU of more FLOP/s and less bandwidth take
    longer for a layer and hold fewer) holds at least as many layers as one on a slower GPU
    — where compute decides: two stages whose compute both stay under their link's time take the
    link's time whatever their layers, so any split of those layers is as fast (a 13-layer
    QLoRA case on a 172 Mbit/s link gave the faster GPU one layer and the slower two); and
    where the slower GPU's stage is not the bottleneck, a layer moved off it would not make
    the step shorter, so either split is as fast (an 11-layer case gave the faster GPU two
    layers and the slower three, both under the last stage's time)."""
    model, training, pools, catalog = instance
    result = plan(model, training, pools, catalog, settings=TINY)
    assert not any(s.memory_bytes * 2 > s.memory_available_bytes for s in result.stages)
    costs = build_problem(model, training, pools, catalog, TINY).costs
    per_layer = {p.name: c.layer_seconds for p, c in zip(pools, costs, strict=True)}
    slowest = max(max(s.compute_seconds, s.side_seconds) for s in result.stages)
    interior = result.stages[1:-1]
    event(f"{len({s.pool for s in interior})} GPU kind(s) among interior stages")
    for a, b in itertools.permutations(interior, 2):
        link_bound = a.compute_seconds < a.side_seconds and b.compute_seconds < b.side_seconds
        bottleneck = max(b.compute_seconds, b.side_seconds) >= slowest * (1 - 1e-9)
        clearly_faster = per_layer[a.pool] * (1 + CLEARLY) < per_layer[b.pool]
        if clearly_faster and not link_bound and bottleneck:
            assert a.layers >= b.layers, (a, b)


LLAMA_8B = ModelShape.from_hf_config(LLAMA31_8B_CONFIG)


def test_h100_gets_more_layers_than_v100():
    pools = [
        Pool("h100", "NVIDIA-H100-80GB-HBM3", 2, 1000, 10),
        Pool("v100", "Tesla-V100-SXM2-32GB", 2, 1000, 10),
    ]
    training = TrainingShape(1, 16, 1024, method="qlora", dtype="float16")
    result = plan(LLAMA_8B, training, pools, stages=4)
    h100 = [s.layers for s in result.stages if s.pool == "h100"]
    v100 = [s.layers for s in result.stages if s.pool == "v100"]
    assert len(h100) == len(v100) == 2
    assert min(h100) > max(v100)


def test_24gb_card_is_never_given_more_than_it_holds():
    """An 8B model in bf16 (16 GB of weights plus activations) needs several 24 GB cards."""
    pools = [Pool("rtx4090", "NVIDIA-GeForce-RTX-4090", 6, 1000, 10)]
    result = plan(LLAMA_8B, TrainingShape(2, 8, 2048, method="lora"), pools)
    assert_valid(result, LLAMA_8B)
    assert len(result.stages) >= 2
    assert all(s.memory_available_bytes < 24 * 2**30 for s in result.stages)
    # The plan is tight somewhere: otherwise fewer stages would have been cheaper.
    assert max(s.memory_bytes / s.memory_available_bytes for s in result.stages) > 0.5


def test_a_slow_link_counts():
    """Two equal GPU pools; behind 10 Mbps the boundary tensors dominate, so the plan
    keeps the model on one GPU of the fast pool instead of splitting across the slow link."""
    pools = [
        Pool("fast", "NVIDIA-A100-SXM4-80GB", 2, 10_000, 1),
        Pool("slow", "NVIDIA-A100-SXM4-80GB", 2, 10, 1),
    ]
    training = TrainingShape(4, 8, 2048, method="lora", compression="none")
    result = plan(LLAMA_8B, training, pools, stages=2)
    assert [s.pool for s in result.stages] == ["fast", "fast"]
    forced = plan(
        LLAMA_8B,
        training,
        [pools[1], Pool("one", "NVIDIA-A100-SXM4-80GB", 1, 10_000, 1)],
        stages=2,
    )
    assert forced.bottleneck.resource == "link"
    assert forced.step_seconds > 10 * result.step_seconds
    # A link-bound plan says what keeps the link busy, until the job asks for it.
    assert "8 micro-batches a step the link streams at most 89%" in forced.bottleneck.detail
    assert "pipeline.forwardsAhead 2-4, or auto" in forced.bottleneck.detail
    assert "(now 0:" in forced.bottleneck.detail
    streaming = TrainingShape(1, 32, 2048, method="lora", compression="none", forwards_ahead=2)
    slow_only = [pools[1], Pool("one", "NVIDIA-A100-SXM4-80GB", 1, 10_000, 1)]
    busy = plan(LLAMA_8B, streaming, slow_only, stages=2)
    assert busy.bottleneck.resource == "link" and "forwardsAhead" not in busy.bottleneck.detail
    # With forwardsAhead: auto the planner chose the forwards ahead: the advice names what it
    # chose and asks for micro-batches alone, not for what the job already lets it choose.
    chosen = TrainingShape(
        4, 8, 2048, method="lora", compression="none", forwards_ahead=1, forwards_ahead_chosen=True
    )
    auto = plan(LLAMA_8B, chosen, slow_only, stages=2).bottleneck.detail
    assert "more micro-batches (training.microBatches, 32 or so) keep it busy" in auto
    assert "pipeline.forwardsAhead auto chose 1" in auto and "or auto" not in auto


def test_step_time_tokens_and_bubble_follow_1f1b():
    pools = [Pool("a100", "NVIDIA-A100-SXM4-80GB", 4, 1000, 10)]
    training = TrainingShape(2, 8, 1024, method="qlora", forwards_ahead=4)
    result = plan(LLAMA_8B, training, pools, stages=4)
    p, m = 4, 8
    # With forwards enough ahead: M + P - 1 beats, and the first activation's way down and
    # the last gradient's way up (P - 1 frames and two ends' latencies each way), which no
    # beat overlaps; never less than M beats.
    beats = (m + p - 1) * result.micro_batch_seconds
    crossing = 2 * (p - 1) * (max(s.side_seconds for s in result.stages) + 2 * 0.010)
    assert m * result.micro_batch_seconds < result.step_seconds <= beats + crossing
    assert result.step_seconds == pytest.approx(step_seconds(result.timeline))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.tokens_per_second == pytest.approx(m * 2 * 1024 / result.step_seconds)
    # Without, the first stage holds P micro-batches in flight, and a round trip through
    # three links is longer than P beats: it paces the step, which the plan counts.
    plain = plan(LLAMA_8B, replace(training, forwards_ahead=0), pools, stages=4)
    assert plain.micro_batch_seconds == pytest.approx(result.micro_batch_seconds)
    assert plain.step_seconds > beats + crossing
    assert plain.step_seconds == pytest.approx(step_seconds(plain.timeline))
    slowest = max(result.stages, key=lambda s: s.beat_seconds)
    assert result.bottleneck.stage == slowest.index


def test_memory_is_reported_as_the_bottleneck_when_it_forces_layers_elsewhere():
    """A fast small GPU and a slow big one: compute alone would give the fast GPU most layers,
    but its memory caps it, so the slow GPU carries the rest and memory is to blame."""
    catalog = DEFAULT_CATALOG.with_overrides(
        {
            "tiny-fast": {
                "tflops": 2000,
                "fp32Tflops": 100,
                "memoryMiB": 12_000,
                "memoryBandwidthGBs": 3000,
                "bf16": True,
            }
        }
    )
    pools = [
        Pool("fast", "tiny-fast", 1, 10_000, 1),
        Pool("big", "NVIDIA-A100-SXM4-80GB", 1, 10_000, 1),
    ]
    result = plan(LLAMA_8B, TrainingShape(1, 4, 512, method="lora"), pools, catalog, stages=2)
    assert result.bottleneck.resource == "memory"
    fast = next(s for s in result.stages if s.pool == "fast")
    assert fast.memory_bytes + fast.memory_bytes // fast.layers > fast.memory_available_bytes


def test_fixed_stage_count_is_honoured_and_checked():
    pools = [Pool("a100", "NVIDIA-A100-SXM4-80GB", 3, 1000, 10)]
    training = TrainingShape(1, 8, 512, method="qlora")
    assert len(plan(LLAMA_8B, training, pools, stages=3).stages) == 3
    with pytest.raises(PlanError, match=r"pipeline\.stages is 4, but there are only 3 usable GPUs"):
        plan(LLAMA_8B, training, pools, stages=4)


def test_status_plan_is_what_the_crd_declares():
    from relaytrain_operator.spec import PlanStatus

    pools = [
        Pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 1000, 10),
        Pool("rtx4090", "NVIDIA-GeForce-RTX-4090", 2, 500, 30),
    ]
    result = plan(LLAMA_8B, TrainingShape(1, 8, 1024, method="qlora"), pools, stages=3)
    status = result.to_status()
    parsed = PlanStatus.model_validate(status)
    assert parsed.model_dump(by_alias=True, exclude_none=True) == status
    assert [s["layerStart"] for s in status["stages"]] == [s.layer_start for s in result.stages]
    assert status["bottleneck"]["resource"] in ("compute", "memory", "link")


def test_layer_overhead_adds_a_fixed_time_per_layer_and_micro_batch() -> None:
    model = ModelShape.from_hf_config(SMOLLM2_135M_CONFIG)
    training = TrainingShape(1, 8, 256)
    pool = Pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 1000, 10)
    gpu = DEFAULT_CATALOG[pool.product]
    base = pool_cost(model, training, pool, gpu, CostSettings())
    slow = pool_cost(model, training, pool, gpu, CostSettings(layer_overhead_seconds=0.003))
    assert slow.layer_seconds == pytest.approx(base.layer_seconds + 0.003)
    with pytest.raises(ValueError, match="layer_overhead_seconds must be >= 0"):
        CostSettings(layer_overhead_seconds=-0.001)


def test_a_card_is_priced_at_the_efficiency_and_overhead_its_catalog_entry_measured() -> None:
    """A catalog entry's measured `efficiency` replaces the cost model's for that card alone
    (its compute time scales by their ratio), and its `layerOverheadMs` the settings'."""
    model = ModelShape.from_hf_config(SMOLLM2_135M_CONFIG)
    training = TrainingShape(1, 8, 256)
    pool = Pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 1000, 10)
    gpu = DEFAULT_CATALOG[pool.product]
    settings = CostSettings(layer_overhead_seconds=0.001)
    base = pool_cost(model, training, pool, gpu, settings)
    measured = replace(gpu, efficiency=0.3, layer_overhead_ms=0.25)
    cost = pool_cost(model, training, pool, measured, settings)
    flops_seconds = base.layer_seconds - 0.001
    assert cost.layer_seconds == pytest.approx(flops_seconds * 0.45 / 0.3 + 0.00025)
    # Set to what the settings say, the entry prices the card as before.
    same = replace(gpu, efficiency=settings.efficiency, layer_overhead_ms=1.0)
    assert pool_cost(model, training, pool, same, settings).layer_seconds == base.layer_seconds


def test_a_card_that_measured_half_the_efficiency_gets_about_half_the_layers() -> None:
    """Two cards of one datasheet peak (an H100 and an H200, both 989 TFLOPS): split evenly by
    default; once the H200's entry says its stages reach half the H100's share of that peak,
    it carries about half as many layers, and the plan's step is priced slower."""
    pools = [
        Pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 100_000, 1),
        Pool("h200", "NVIDIA-H200", 1, 100_000, 1),
    ]
    training = TrainingShape(1, 8, 1024, method="lora")
    even = plan(LLAMA_8B, training, pools, stages=2)
    halved = DEFAULT_CATALOG.with_overrides({"NVIDIA-H200": {"efficiency": 0.225}})
    result = plan(LLAMA_8B, training, pools, halved, stages=2)

    def layers(p: Plan) -> dict[str, int]:
        return {s.pool: s.layers for s in p.stages}

    assert abs(layers(even)["h100"] - layers(even)["h200"]) <= 2
    assert layers(result)["h100"] + layers(result)["h200"] == LLAMA_8B.num_layers
    assert 1.7 <= layers(result)["h100"] / layers(result)["h200"] <= 2.3
    assert result.tokens_per_second < even.tokens_per_second
