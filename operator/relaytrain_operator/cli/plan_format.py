"""`relaytrain plan`'s readable output: the plan as tables (one pipeline or several), and
what --leave's departure would do."""

from __future__ import annotations

from typing import Any

from relaytrain_operator.domain.membership import IfLeft
from relaytrain_operator.domain.planner import (
    Catalog,
    CostSettings,
    FleetPlan,
    ModelShape,
    Plan,
    TrainingShape,
)
from relaytrain_operator.domain.planner.choose import AHEAD_MARGIN
from relaytrain_operator.domain.planner.cost import GIB
from relaytrain_operator.domain.planner.growth import GROWTH_MARGIN
from relaytrain_operator.domain.planner.link_cost import (
    BASIS_REFIT,
    DEFLATE_FORWARD_SAVES,
    DELTA_LATER_SHARE,
    basis_bytes,
    basis_fit_seconds,
    basis_share,
    delta_first_bytes,
    wire_bytes_per_value,
)
from relaytrain_operator.store.model_config import Resolved


def _about(model: ModelShape | None, source: Resolved | None) -> list[str]:
    if model is None or source is None:
        return []
    about = [
        f"Model: {source.describe()}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_heads} heads ({model.num_kv_heads} KV), vocab {model.vocab_size}."
    ]
    return about + [f"Not read: {why}." for why in source.skipped]


def measured(result: Plan | FleetPlan, catalog: Catalog) -> dict[str, dict[str, float]]:
    """The GPUs of the plan's stages whose catalog entries carry what the card measured, and
    those figures (`efficiency`, `layerOverheadMs`), which priced them (docs/planner.md)."""
    pipelines = result.pipelines if isinstance(result, FleetPlan) else (result,)
    out: dict[str, dict[str, float]] = {}
    for product in sorted({s.gpu_product for p in pipelines for s in p.stages}):
        gpu = catalog[product]
        figures = {"efficiency": gpu.efficiency, "layerOverheadMs": gpu.layer_overhead_ms}
        kept = {k: v for k, v in figures.items() if v is not None}
        if kept:
            out[product] = kept
    return out


def _measured_lines(result: Plan | FleetPlan, catalog: Catalog | None) -> list[str]:
    found = measured(result, catalog) if catalog is not None else {}
    if not found:
        return []
    default = CostSettings()
    cards = "; ".join(
        f"{product} " + ", ".join(
            f"efficiency {v:.3g}" if k == "efficiency" else f"{v:.3g} ms a layer and micro-batch"
            for k, v in figures.items()
        )
        for product, figures in found.items()
    )  # fmt: skip
    return [
        f"Priced as measured (their catalog entries): {cards}; any other GPU at the cost "
        f"model's efficiency {default.efficiency:.2f}."
    ]


def _stage_table(result: Plan) -> list[str]:
    rows = [("STAGE", "POOL", "GPU", "LAYERS", "N", "COMPUTE", "LINK", "BEAT", "MEMORY")]
    for s in result.stages:
        used, avail = s.memory_bytes / GIB, s.memory_available_bytes / GIB
        rows.append(
            (
                str(s.index),
                s.pool,
                s.gpu_product,
                f"{s.layer_start}-{s.layer_end - 1}",
                str(s.layers),
                f"{s.compute_seconds:.3g}s",
                f"{s.side_seconds:.3g}s",
                f"{s.beat_seconds:.3g}s",
                f"{used:.1f}/{avail:.1f} GiB ({100 * used / avail:.0f}%)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _code_price(training: TrainingShape, model: ModelShape | None) -> list[str]:
    """How `delta`'s bytes are priced (docs/planner.md): its activations at their run's mean
    over the job's epochs, or at their first epoch's rate in a job of steps; with fitted bases
    (and the model's width known), what a frame pays for its share of a basis."""
    if training.compression != "delta":
        return []
    forward, back = (8 * wire_bytes_per_value(training, b) for b in (False, True))
    first = 8 * delta_first_bytes(training.activation_bits, training.sequence_length)
    if training.epochs is not None and training.epochs > 1:
        how = (
            f"the mean of its {training.epochs} epochs: the first at {first:.2f}, each later "
            f"one at {DELTA_LATER_SHARE:.2f} of that (what the rows' drift leaves; at most all "
            "of it)"
        )
    else:
        why = "one epoch" if training.epochs == 1 else "a job of steps, its passes not known"
        how = f"its first epoch's rate, the dearest ({why})"
    return [
        f"Boundary code delta: activations priced at {forward:.2f} bits a value, {how}; "
        f"gradients at {back:.2f}; deflate counted as {100 * DEFLATE_FORWARD_SAVES:.1f} % off "
        "the activations.",
        *_basis_price(training, model),
    ]


def _basis_price(training: TrainingShape, model: ModelShape | None) -> list[str]:
    if training.activation_basis != "fitted" or model is None:
        return []
    h = model.hidden_size
    share, seconds = basis_share(h)
    bits = 8 * share / (training.tokens_per_micro_batch * h)
    return [
        f"Fitted bases: one of {h} x {h} fitted and sent every {BASIS_REFIT} frames, at most "
        f"{basis_bytes(h) / 2**20:.1f} MiB and {basis_fit_seconds(h):.1f} s of both ends' work "
        f"(one CPU thread); a frame pays {bits:.3f} bits a value and {1000 * seconds:.0f} ms "
        "of it, its rows priced as in the identity."
    ]


def format_table(
    name: str,
    training: TrainingShape,
    result: Plan | FleetPlan,
    model: ModelShape | None = None,
    source: Resolved | None = None,
    *,
    catalog: Catalog | None = None,
) -> str:
    """The plan as a readable table; with `model` and `source`, the model and its origin;
    with `catalog`, the cards it priced at what they measured."""
    if isinstance(result, FleetPlan):
        text = format_fleet(name, training, result, model, source)
    else:
        text = _format_one(name, training, result, model, source)
    return "\n".join([text, *_measured_lines(result, catalog)])


def _format_one(
    name: str,
    training: TrainingShape,
    result: Plan,
    model: ModelShape | None,
    source: Resolved | None,
) -> str:
    header = (
        f"Plan for {name}: {len(result.stages)} stage(s), {_schedule(training)}, "
        f"{result.micro_batches} micro-batches of {training.micro_batch_size}x"
        f"{training.sequence_length} tokens ({training.method}, {training.dtype}, "
        f"compression {training.compression})"
    )
    price = _code_price(training, model) if len(result.stages) > 1 else []  # one stage: no boundary
    lines = [header, *_about(model, source), *price, "", *_stage_table(result)]
    b = result.bottleneck
    lines += [
        "",
        f"Step {result.step_seconds:.3g}s (1F1B played out over its links), "
        f"{result.tokens_per_second:,.0f} tokens/s, bubble {100 * result.bubble_fraction:.0f}%.",
        *_ahead_gain(training, result),
        f"Bottleneck: stage {b.stage} ({b.resource}). {b.detail}",
        f"Search: {result.search} ({result.sequences_evaluated} sequences evaluated).",
    ]
    lines += [f"Note: {n}" for n in result.notes]
    return "\n".join(lines)


def _schedule(training: TrainingShape) -> str:
    ahead = training.forwards_ahead
    return f"1F1B with {_forwards(ahead)} ahead" if ahead else "1F1B"


def _ahead_gain(training: TrainingShape, result: Plan) -> list[str]:
    """Where a link sets the pace and the job fixed its forwards ahead: the step with the
    ones that would shorten it most (of those its memory holds), when they would."""
    if result.bottleneck.resource != "link" or training.forwards_ahead_chosen:
        return []
    if result.timeline is None or not result.most_ahead:
        return []
    steps = {a: result.step_seconds_ahead(a) for a in range(result.most_ahead + 1)}
    best = min(steps, key=lambda a: (steps[a], a))
    if steps[best] >= (1 - AHEAD_MARGIN) * result.step_seconds:
        return []
    return [
        f"With {_forwards(best)} ahead: {steps[best]:.3g}s a step (pipeline.forwardsAhead; "
        f"auto takes the fewest within {100 * AHEAD_MARGIN:.0f} % of the fastest, up to the "
        f"{_forwards(result.most_ahead)} its memory holds)."
    ]


def _forwards(count: int) -> str:
    return f"{count} forward{'' if count == 1 else 's'}"


def format_fleet(
    name: str,
    training: TrainingShape,
    fleet: FleetPlan,
    model: ModelShape | None = None,
    source: Resolved | None = None,
) -> str:
    """Several pipelines: each one's stages, then the sync and the whole step."""
    header = (
        f"Plan for {name}: {len(fleet.pipelines)} pipelines on {fleet.gpus} of "
        f"{fleet.usable_gpus} usable GPU(s), {_schedule(training)}, {fleet.micro_batches} "
        f"micro-batches of "
        f"{training.micro_batch_size}x{training.sequence_length} tokens per step "
        f"({training.method}, {training.dtype}, compression {training.compression})"
    )
    split = any(len(p.stages) > 1 for p in fleet.pipelines)
    lines = [header, *_about(model, source), *(_code_price(training, model) if split else [])]
    for i, p in enumerate(fleet.pipelines):
        b = p.bottleneck
        lines += [
            "",
            f"Pipeline {i}: {len(p.stages)} stage(s), {p.micro_batches} "
            f"micro-batch{'' if p.micro_batches == 1 else 'es'}, "
            f"{p.step_seconds:.3g}s, {p.tokens_per_second:,.0f} tokens/s, "
            f"bubble {100 * p.bubble_fraction:.0f}%.",
            *_stage_table(p),
            f"Bottleneck: stage {b.stage} ({b.resource}). {b.detail}",
        ]
    s = fleet.sync
    when = "every step" if s.sync.mode == "synchronous" else f"every {s.sync.every} steps"
    share = "" if s.sync.every == 1 else f", {s.per_step_seconds:.3g}s per step"
    single = fleet.single
    lines += [
        "",
        f"Sync: {s.sync.mode}, {when}: {s.collective} of {s.gradient_bytes / 2**20:,.1f} MiB "
        f"of {s.gradients.dtype} {s.gradients.what} {s.gradients.kind} among {s.pipelines} "
        f"pipelines, "
        f"{s.seconds:.3g}s ({s.bandwidth_seconds:.3g}s busiest link, "
        f"{s.latency_seconds:.3g}s latency){share}.",
        f"Step {fleet.step_seconds:.3g}s (slowest pipeline {fleet.pipeline_seconds:.3g}s + "
        f"sync {s.per_step_seconds:.3g}s), {fleet.tokens_per_second:,.0f} tokens/s: "
        f"{fleet.speedup:.2f}x the best single pipeline ({single.tokens_per_second:,.0f} "
        f"tokens/s on {len(single.stages)} GPU(s)).",
        f"Search: {fleet.search} over {fleet.candidates} candidate pipelines "
        f"({fleet.sets_evaluated} sets evaluated).",
    ]
    lines += [f"Note: {n}" for n in fleet.notes]
    return "\n".join(lines)


def format_if_left(nodes: str, left: IfLeft, pipelines: tuple[Plan, ...]) -> str:
    """What --leave shows: the stages on the leaving GPUs and what the job would do
    (docs/operator.md, "The job follows the fleet")."""
    lost = ", ".join(f"pool {pool}: {n} GPU(s)" for pool, n in left.lost.items())
    lines = [f"If {nodes} left ({lost or 'none of the GPUs the job may use'}):"]
    speed = f"{left.tokens_per_second_before:,.0f} -> {{:,.0f}} tokens/s"
    if not left.hit:
        return "\n".join([*lines, "- no stage of the job is on them: nothing changes."])
    if not left.leaving:  # one pipeline: its stages there are replaced elsewhere
        hit = [pipelines[0].stages[k] for _, k in left.hit]
        if left.waiting:
            needs = ", ".join(f"stage {s.index} {s.memory_bytes / GIB:.1f} GiB" for s in hit)
            lines.append(
                f"- no free GPUs fit what must move ({needs}): once the node ends, the job "
                "waits for them (phase Recovering, reason Unschedulable)"
                + (
                    ", then, after waiting as long as a re-split costs (--join-seconds), is "
                    f"re-split for the GPUs left: {len(left.resplit.stages)} stages "
                    + " → ".join(
                        f"{s.pool}[{s.layer_start}:{s.layer_end})" for s in left.resplit.stages
                    )
                    + ", from the last commit."
                    if left.resplit is not None
                    else "; no plan fits the GPUs left either."
                )
            )
        for s in [] if left.waiting else hit:
            lines.append(
                f"- stage {s.index} ({s.pool}, {s.memory_bytes / GIB:.1f} GiB) trains on until "
                f"its node ends, then starts on a free GPU of pool {left.moves[(0, s.index)]} "
                "from the last commit, no restart counted."
            )
        return "\n".join([*lines, "- " + speed.format(left.tokens_per_second_after) + "."])
    for i in left.leaving:
        pools = "+".join(s.pool for s in pipelines[i].stages)
        lines.append(f"- pipeline {i} ({pools}) leaves at a step boundary: no step lost.")
    if left.shares_out:
        shares = "+".join(map(str, left.shares_out))
        lines.append(
            f"- {len(left.shares_out)} pipeline(s) train on, micro-batches {shares}: "
            + speed.format(left.tokens_per_second_out)
            + "."
        )
    elif len(left.waiting) + len(left.held_out) == len(left.leaving):
        lines.append(
            "- every pipeline has left: the job is Suspended (reason FleetGone) with its last "
            "commit until one fits again."
        )
    else:
        lines.append(
            "- no pipeline trains until one comes back; with none training to take state "
            "from, those that come back restore the last commit."
        )
    for i in left.leaving:
        if i in left.waiting:
            need = max(s.memory_bytes for s in pipelines[i].stages) / GIB
            lines.append(
                f"- pipeline {i} comes back, its split kept, once free GPUs fit its stages "
                f"(up to {need:.1f} GiB): none do now."
            )
        elif i in left.held_out:
            fits, price = left.held_out[i]
            lines.append(
                f"- pipeline {i} would fit on {'+'.join(fits)} but stays out: its return "
                f"would not raise tokens/s by {GROWTH_MARGIN:.0%} ({price.words()})."
            )
        else:
            pools = "+".join(left.moves[(i, s.index)] for s in pipelines[i].stages)
            lines.append(f"- pipeline {i} comes back at once on {pools}.")
    if len(left.waiting) + len(left.held_out) < len(left.leaving):
        lines.append("- then " + speed.format(left.tokens_per_second_after) + ".")
    return "\n".join(lines)


def if_left_dict(left: IfLeft) -> dict[str, Any]:
    """--leave in --json."""
    return {
        "lost": dict(left.lost),
        "hit": [{"pipeline": i, "stage": k} for i, k in left.hit],
        "leaving": list(left.leaving),
        "moves": [
            {"pipeline": i, "stage": k, "pool": pool} for (i, k), pool in sorted(left.moves.items())
        ],
        "waiting": list(left.waiting),
        "heldOut": [
            {
                "pipeline": i,
                "pools": list(pools),
                "tokensPerSecondWithout": round(price.before, 1),
                "tokensPerSecondWith": round(price.after, 1),
            }
            for i, (pools, price) in sorted(left.held_out.items())
        ],
        "tokensPerSecondBefore": round(left.tokens_per_second_before, 1),
        "tokensPerSecondOut": round(left.tokens_per_second_out, 1),
        "sharesOut": list(left.shares_out),
        "tokensPerSecondAfter": round(left.tokens_per_second_after, 1),
        "resplit": left.resplit.to_dict() if left.resplit is not None else None,
    }
