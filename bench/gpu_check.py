"""The GPU check: LoRA on a random Llama-3.1-8B-shaped model on one GPU, in one run.

    python3 bench/gpu_check.py --device cuda --json OUT.json   # on a GPU host: make gpu-check
    .venv/bin/python bench/gpu_check.py --device cpu           # its CPU twin (make test runs it)

The model is built straight on the device from the shipped config
(operator/relaytrain_operator/known_models/llama-3.1-8b.json), its weights drawn by name
(relaytrain_testkit.random_models: no checkpoint, no download); on the CPU, a tiny model of
the same family (that config with small sizes). It trains with LoRA r=16 on the seven
linears of every layer, on rows packed by the worker's own packing (documents of 1/16 to 1/2
of a row, positions restarting at each, no padding), in four set-ups:

(a) relaytrain's stage runtime (StepRunner, 1F1B) with the whole model as one stage;
(b) two stages on the same device, over an authenticated loopback link (no compression);
(c) single-process peft: the unsplit transformers model with the same adapters, batches and
    optimizer (relaytrain_testkit.references);
(d) QLoRA, one stage, when bitsandbytes imports (otherwise a line says why not).

Each trains warm-up steps, then timed steps (the clock read after torch.cuda.synchronize).
Reported: tokens/s; peak memory (torch.cuda.max_memory_allocated over the set-up, building
included; on the CPU the growth of the process's RSS high-water mark, n/a where /proc does not
allow it) against the planner's estimate for that split (`assess`: for (b) the sum of its two
stages, both on this device); MFU on a GPU:

    MFU = model FLOPs / seconds / the card's dense peak for the dtype (planner catalog, by
          torch.cuda.get_device_name with spaces as dashes, as GPU feature discovery labels it)
    model FLOPs per micro-batch of T tokens (b rows of s) = L·(4·T·W + 3·A + 6·T·R) + 4·T·h·V

with W a layer's matmul weights, A = 4·b·(s²/2)·q causal attention's forward (QKᵀ and AV over
the lower triangle, q the query width), R a layer's LoRA parameters and h·V the head. A frozen
weight costs 2 FLOPs per token forward and 2 backward (the input's gradient; no weight
gradient is formed), not the 6 of full training, so 6·N·T would overstate LoRA's work by half;
the adapters cost the full 6; attention's backward is twice its forward. This is the
planner's own `step_flops`, so MFU and the planner's compute prediction count the same work.
Packed rows mask attention across documents; A still counts whole rows, as the planner does.

Also: (b)'s and (c)'s loss at every step and LoRA gradients and weights after the last step
against (a)'s (max |Δ|), the ratios (b)/(a) and (a)/(c), and on a GPU the design targets
(≥ 8,000 tokens/s for (a); (b)/(a) ≥ 0.90) and (b0): (b) with every frame encoded on the
default stream, the baseline of the encoders' own streams (pipeline/peers.py), as (b)/(b0);
on a card in the catalog, the catalog entry it measured: (a)'s MFU as its `efficiency`.
Exit status 1 when a set-up failed.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

# The repository's packages from its source tree, ahead of any installed copy (as the GPU
# host's PYTHONPATH=operator:worker_image:testkit:. has them).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker_image"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

import torch
from relaytrain_contract import DatasetSpec, TrainingSpec
from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    ModelShape,
    Pool,
    TrainingShape,
    UnknownGpuError,
    assess,
)
from relaytrain_operator.domain.planner.cost import step_flops
from relaytrain_testkit.inputs import even_splits
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_testkit.pipelines import PipelineRun, run_pipeline_threads
from relaytrain_testkit.random_models import config_dir, random_model, random_stage
from relaytrain_testkit.references import run_reference
from relaytrain_worker.model.model_slice import SliceSpec, StageModel
from relaytrain_worker.state.data import MicroBatch, build_rows
from relaytrain_worker.state.records import Example

REPO = Path(__file__).resolve().parents[1]
KNOWN = REPO / "operator" / "relaytrain_operator" / "known_models" / "llama-3.1-8b.json"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16
LORA = {"rank": RANK, "alpha": 2.0 * RANK, "dropout": 0.0, "targets": list(TARGETS)}
STAND_IN = "NVIDIA-H100-80GB-HBM3"
"""The catalog entry priced where the device is not in the catalog (a CPU): the planner's
memory estimate does not depend on the GPU."""
LOOPBACK_MBPS = 100_000.0
TOKENS_TARGET = 8000.0
TWO_STAGE_TARGET = 0.90
T = TypeVar("T")


@dataclass(frozen=True)
class Preset:
    """The model and training of one device's check."""

    name: str
    """What the model is, for the report."""
    config: dict[str, Any]
    """config.json of the model (the shipped Llama-3.1-8B one, or it shrunk)."""
    dtype: Literal["bfloat16", "float32"]
    """Weight and compute dtype."""
    sequence_length: int
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per optimizer step."""
    warmup: int
    """Steps trained before the clock starts."""
    steps: int
    """Timed steps."""

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def presets() -> dict[str, Preset]:
    full = json.loads(KNOWN.read_text())
    tiny = {
        **full,
        "hidden_size": 64,
        "intermediate_size": 224,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return {
        "cuda": Preset(KNOWN.name, full, "bfloat16", 2048, 1, 8, warmup=2, steps=12),
        "cpu": Preset(
            "tiny Llama (that config, small sizes)", tiny, "float32", 128, 2, 4, warmup=1, steps=2
        ),
    }


def packed_steps(p: Preset, *, seed: int = 0) -> list[list[MicroBatch]]:
    """The micro-batches of every step: rows packed by the worker's `build_rows` from random
    documents whose lengths are powers of two from 1/16 to 1/2 of a row, so every row is full
    (no padding) and holds 2 to 16 documents."""
    seq, vocab = p.sequence_length, int(p.config["vocab_size"])
    rows = (p.warmup + p.steps) * p.micro_batches * p.micro_batch_size
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    for _ in range(rows):
        pieces = [seq // 2, seq // 2]
        while pieces:
            n = pieces.pop()
            split = n > seq // 16 and bool(torch.rand((), generator=gen) < 0.5)
            if split:
                pieces += [n // 2, n // 2]
            else:
                lengths.append(n)
    docs = []
    for line, n in enumerate(lengths, start=1):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        docs.append(Example(ids, list(ids), line))
    spec = DatasetSpec(uri="random.jsonl", format="text", text_field="text", prompt_field="p",
                       completion_field="c", messages_field="m", sequence_length=seq,
                       packing=True)  # fmt: skip
    packed = build_rows(docs, spec, pad_id=vocab - 1)
    if packed.input_ids.shape[0] != rows or not bool(packed.attention_mask.all()):
        raise AssertionError("the packed rows are not all full")
    order = torch.randperm(rows, generator=gen)
    mbs, out = p.micro_batch_size, []
    for step in range(p.warmup + p.steps):
        micros = []
        for m in range(p.micro_batches):
            at = order[(step * p.micro_batches + m) * mbs :][:mbs]
            micros.append(MicroBatch(packed.input_ids[at], packed.attention_mask[at],
                                     packed.position_ids[at], packed.labels[at]))  # fmt: skip
        out.append(micros)
    return out


@dataclass
class Check:
    """Everything one check run shares."""

    preset: Preset
    device: torch.device
    model_dir: Path
    steps: list[list[MicroBatch]]
    training: TrainingSpec
    shape: ModelShape
    product: str | None
    """The device's catalog entry (None: a CPU, or a GPU the catalog lacks)."""

    def stage(self, spec: SliceSpec) -> StageModel:
        p = self.preset
        return random_stage(self.model_dir, spec, dtype=p.dtype, device=self.device)

    def unsplit(self) -> torch.nn.Module:
        return random_model(self.model_dir, dtype=self.preset.dtype, device=self.device)

    def training_shape(self, method: Literal["lora", "qlora"]) -> TrainingShape:
        p = self.preset
        return TrainingShape(
            micro_batch_size=p.micro_batch_size, micro_batches=p.micro_batches,
            sequence_length=p.sequence_length, method=method, lora_rank=RANK,
            lora_targets=TARGETS, compression="none", dtype=p.dtype,
        )  # fmt: skip

    @property
    def timed_tokens(self) -> int:
        return sum(int(mb.attention_mask.sum()) for s in self.steps[self.preset.warmup :]
                   for mb in s)  # fmt: skip

    def flops_per_step(self) -> float:
        layer, head = step_flops(self.shape, self.training_shape("lora"))
        return self.preset.micro_batches * (self.preset.layers * layer + head)

    def peak_flops(self) -> float | None:
        if self.product is None:
            return None
        return DEFAULT_CATALOG[self.product].peak_flops(self.preset.dtype)


def estimate(check: Check, layers: list[int], method: Literal["lora", "qlora"]) -> dict[str, Any]:
    """The planner's prediction for this split on this device: memory per stage, and for one
    stage its tokens/s (two stages priced as two GPUs would be faster than one shared GPU)."""
    pool = Pool("this-device", check.product or STAND_IN, gpus=len(layers),
                link_bandwidth_mbps=LOOPBACK_MBPS, link_latency_ms=0.05)  # fmt: skip
    plan = assess(check.shape, check.training_shape(method), [pool],
                  [(pool.name, n) for n in layers])  # fmt: skip
    return {
        "estimate_bytes": sum(s.memory_bytes for s in plan.stages),
        "estimate_per_stage": [s.memory_bytes for s in plan.stages],
        "planner_tokens_per_s": (
            round(plan.tokens_per_second, 1) if check.product and len(layers) == 1 else None
        ),
    }


class Memory:
    """Peak memory of one set-up: the allocator's peak on a GPU; on the CPU the growth of
    the process's RSS high-water mark (reset through /proc/self/clear_refs), or None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            self.base: int | None = torch.cuda.memory_allocated(device)
            self.how = "torch.cuda.max_memory_allocated"
            return
        self.how = "RSS high-water mark growth"
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _status("VmRSS")
        except OSError:
            self.base = None

    def peak(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _status("VmHWM") - self.base


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in /proc/self/status")


def _in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a fresh thread, as every stage runs (torch's intra-op settings are per
    thread: neither side may be favoured)."""
    box: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


def measure(
    check: Check, setup: str, layers: list[int], method: Literal["lora", "qlora"],
    train: Callable[[], PipelineRun],
) -> tuple[dict[str, Any], PipelineRun | None]:  # fmt: skip
    """Train one set-up and report it (an error is reported, not raised)."""
    row: dict[str, Any] = {"setup": setup, "stage_layers": layers, "method": method}
    memory = Memory(check.device)
    try:
        run = train()
    except Exception as exc:  # one failed set-up must not hide the others' figures
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row, None
    peak = memory.peak()
    tokens = check.timed_tokens
    rate = tokens / run.seconds
    flops = check.flops_per_step() * check.preset.steps / run.seconds
    peak_flops = check.peak_flops()
    try:
        planned = estimate(check, layers, method)
    except Exception as exc:
        planned = {"estimate_bytes": None, "estimate_error": f"{type(exc).__name__}: {exc}"}
    row |= {
        "seconds": round(run.seconds, 4),
        "tokens": tokens,
        "tokens_per_s": round(rate, 1),
        "peak_bytes": peak,
        "peak_measure": memory.how if peak is not None else "n/a",
        **planned,
        "model_flops_per_s": flops,
        "mfu": round(flops / peak_flops, 4) if peak_flops else None,
        "losses": run.losses,
    }
    est = row["estimate_bytes"]
    row["peak_over_estimate"] = round(peak / est, 3) if peak is not None and est else None
    return row, run


def compare(a: PipelineRun, b: PipelineRun) -> dict[str, float]:
    """How far `b` is from `a`: every step's loss, the last step's LoRA gradients and the
    LoRA weights after it (max |Δ|, and the gradients' relative to their largest value)."""
    if len(a.losses) != len(b.losses) or set(a.grads[-1]) != set(b.grads[-1]):
        raise AssertionError("the two runs trained different steps or parameters")

    def worst(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> tuple[float, float]:
        diff = max(float((x[n].float() - y[n].float()).abs().max()) for n in x)
        return diff, max(float(t.float().abs().max()) for t in x.values())

    grad, scale = worst(a.grads[-1], b.grads[-1])
    params, _ = worst(a.params, b.params)
    return {
        "loss_max_abs_diff": max(abs(x - y) for x, y in zip(a.losses, b.losses, strict=True)),
        "grad_max_abs_diff": grad,
        "grad_max_rel_diff": grad / scale if scale else grad,
        "grad_max_abs": scale,
        "params_max_abs_diff": params,
        "last_loss": a.losses[-1],
    }


def compared(a: PipelineRun, b: PipelineRun) -> dict[str, Any]:
    """`compare`, or what went wrong (reported: the figures of the run must still come out)."""
    try:
        return compare(a, b)
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def qlora_unavailable(device: torch.device) -> str | None:
    """Why QLoRA cannot run here (None: it can)."""
    try:
        bnb = importlib.import_module("bitsandbytes")
    except Exception as exc:
        return f"bitsandbytes does not import ({type(exc).__name__}: {exc})"
    version = getattr(bnb, "__version__", "?")
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"bitsandbytes {version} imports but CUDA is not available"
    return None


def run_check(
    preset: Preset, device: torch.device, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Every set-up in turn; the report so far goes to `save` after each (a run cut short by
    its time limit still leaves the figures it made)."""
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    product = None
    if card is not None:
        try:
            product = DEFAULT_CATALOG[card.replace(" ", "-")].product
        except UnknownGpuError:
            print(f"{card!r} is not in the planner's GPU catalog: no MFU, estimates priced on "
                  f"{STAND_IN}")  # fmt: skip
    steps = packed_steps(preset)
    training = TrainingSpec(
        steps=len(steps), micro_batch_size=preset.micro_batch_size,
        micro_batches=preset.micro_batches, learning_rate=1e-4, schedule="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    check = Check(
        preset, device, config_dir(Path(tempfile.mkdtemp()) / "model", preset.config),
        steps, training, ModelShape.from_hf_config(preset.config), product,
    )  # fmt: skip
    n, w = preset.layers, preset.warmup
    tokens_per_step = preset.micro_batches * preset.micro_batch_size * preset.sequence_length
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device.type,
        "card": card,
        "catalog_product": product,
        "versions": _versions(),
        "model": {
            "config": preset.name,
            "layers": n,
            "hidden_size": preset.config["hidden_size"],
            "params": check.shape.total_params,
            "dtype": preset.dtype,
        },
        "training": {
            "sequence_length": preset.sequence_length,
            "micro_batch_size": preset.micro_batch_size,
            "micro_batches": preset.micro_batches,
            "warmup_steps": w,
            "timed_steps": preset.steps,
            "timed_tokens": check.timed_tokens,
            "lora": LORA,
            "optimizer": "AdamW lr 1e-4, clip 1.0",
            "rows": "packed, no padding",
        },
        "flops": {
            "model_flops_per_token": check.flops_per_step() / tokens_per_step,
            "peak_flops": check.peak_flops(),
            "formula": "L*(4*T*W + 3*A + 6*T*R) + 4*T*h*V per micro-batch (planner step_flops)",
        },
        "runs": {},
        "ratios": {},
        "checks": {},
    }
    runs, checks = report["runs"], report["checks"]

    def pipeline(
        splits: list[tuple[int, int]], method: Literal["lora", "qlora"], side_stream: bool = True
    ) -> PipelineRun:
        creds = stage_credentials(len(splits), job="gpu-check")
        return run_pipeline_threads(check.stage, splits, steps, training, credentials=creds,
                                    method=method, lora=LORA, warmup=w, grads="last",
                                    side_stream=side_stream)  # fmt: skip

    def reference() -> PipelineRun:
        return run_reference(check.unsplit, steps, training, lora=LORA, warmup=w, grads="last")

    def done(key: str, row: dict[str, Any]) -> None:
        runs[key] = row
        shown = {k: v for k, v in row.items() if k not in ("losses", "estimate_per_stage")}
        print(json.dumps(shown), flush=True)
        save(report)

    halves = even_splits(n, 2)
    row, a = measure(check, "(a) relaytrain, one stage", [n], "lora",
                     lambda: pipeline([(0, n)], "lora"))  # fmt: skip
    done("a", row)
    row, other = measure(check, "(b) relaytrain, two stages over a loopback link",
                         [e - s for s, e in halves], "lora",
                         lambda: pipeline(halves, "lora"))  # fmt: skip
    if a and other:
        checks["b_vs_a"] = compared(a, other)
    done("b", row)
    del other
    if device.type == "cuda":
        # The baseline of the encoders' own streams (peers.py), side by side: the same two
        # stages with every frame encoded on the default stream, which all threads share.
        row, _ = measure(check, "(b0) (b), frames encoded on the default stream",
                         [e - s for s, e in halves], "lora",
                         lambda: pipeline(halves, "lora", side_stream=False))  # fmt: skip
        done("b0", row)
    row, other = measure(check, "(c) single-process peft", [n], "lora",
                         lambda: _in_thread(reference))  # fmt: skip
    if a and other:
        checks["c_vs_a"] = compared(a, other)
    done("c", row)
    del a, other
    why_not = qlora_unavailable(device)
    if why_not is None:
        row, _ = measure(check, "(d) relaytrain QLoRA, one stage", [n], "qlora",
                         lambda: pipeline([(0, n)], "qlora"))  # fmt: skip
    else:
        print(f"QLoRA skipped: {why_not}")
        row = {"setup": "(d) relaytrain QLoRA, one stage", "skipped": why_not}
    done("qlora", row)

    def rate(key: str) -> float | None:
        value = runs[key].get("tokens_per_s")
        return float(value) if value else None

    ra, rb, rc = rate("a"), rate("b"), rate("c")
    b_over_a = round(rb / ra, 3) if ra and rb else None
    report["ratios"] = {"b_over_a": b_over_a, "a_over_c": round(ra / rc, 3) if ra and rc else None}
    rb0 = rate("b0") if "b0" in runs else None
    if rb and rb0:
        report["ratios"]["b_over_b0"] = round(rb / rb0, 3)
    entry = measured_entry(product, runs["a"])
    if entry is not None:
        report["catalog_entry"] = entry
    if device.type == "cuda":
        report["targets"] = {
            "a_tokens_per_s_at_least_8000": bool(ra and ra >= TOKENS_TARGET),
            "b_over_a_at_least_0.90": bool(b_over_a and b_over_a >= TWO_STAGE_TARGET),
        }
    save(report)
    return report


def measured_entry(product: str | None, row: dict[str, Any]) -> dict[str, Any] | None:
    """The catalog entry this card measured, for chart values `gpuCatalog` or `relaytrain plan
    --catalog`: (a)'s MFU as its `efficiency` (MFU counts the planner's own FLOPs over the
    catalog's peak, which is what the planner's efficiency scales; docs/planner.md, "What a card
    measured"). None without a catalog product or an MFU (a CPU, a failed run)."""
    mfu = row.get("mfu")
    if product is None or not mfu:
        return None
    return {product: {"efficiency": round(float(mfu), 3)}}


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            out[name] = str(importlib.import_module(name).__version__)
        except Exception:
            out[name] = None
    return out


def _mib(value: Any) -> str:
    return f"{value / 2**20:.0f}" if isinstance(value, int | float) else "n/a"


def print_report(report: dict[str, Any]) -> None:
    where = report["card"] or "CPU"
    model = report["model"]
    t = report["training"]
    print(f"GPU check on {where}, {report['date']}: {model['config']}, {model['layers']} layers,"
          f" {model['params'] / 1e9:.3g}B parameters, {model['dtype']}, sequence "
          f"{t['sequence_length']} packed, {t['micro_batch_size']}x{t['micro_batches']} rows per "
          f"step, {t['warmup_steps']} warm-up + {t['timed_steps']} timed steps, LoRA r16 on "
          f"every linear; versions {report['versions']}")  # fmt: skip
    head = f"{'set-up':<50} {'tokens/s':>10} {'peak MiB':>9} {'est. MiB':>9} {'peak/est':>9}"
    print(head + f" {'MFU':>7}")
    for row in report["runs"].values():
        if "skipped" in row or "error" in row:
            why = f"skipped: {row['skipped']}" if "skipped" in row else f"FAILED: {row['error']}"
            print(f"{row['setup']:<50} {why}")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        print(f"{row['setup']:<50} {row['tokens_per_s']:>10.1f} {_mib(row['peak_bytes']):>9} "
              f"{_mib(row['estimate_bytes']):>9} {row['peak_over_estimate'] or 'n/a':>9} "
              f"{mfu:>7}")  # fmt: skip
    r = report["ratios"]
    b0 = f", (b)/(b0) = {r['b_over_b0']}" if "b_over_b0" in r else ""
    print(f"ratios: (b)/(a) = {r['b_over_a']}, (a)/(c) = {r['a_over_c']}{b0}")
    for name, c in report["checks"].items():
        if "error" in c:
            print(f"{name.replace('_vs_', ' vs ')}: FAILED: {c['error']}")
            continue
        print(f"{name.replace('_vs_', ' vs ')}: loss max |Δ| {c['loss_max_abs_diff']:.3g}, "
              f"LoRA gradients max |Δ| {c['grad_max_abs_diff']:.3g} "
              f"({c['grad_max_rel_diff']:.3g} of the largest), LoRA weights max |Δ| "
              f"{c['params_max_abs_diff']:.3g}")  # fmt: skip
    for name, met in report.get("targets", {}).items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    if "catalog_entry" in report:
        entry = json.dumps(report["catalog_entry"])
        print(f"this card's catalog entry (gpuCatalog values): {entry}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True,
                        help="cuda: the Llama-3.1-8B shape in bfloat16, sequence 2048; cpu: "
                             "a tiny model of the same family in float32 (the twin)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--steps", type=int, help="timed steps (default: the preset's)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: the preset's)")
    args = parser.parse_args(argv)
    preset = presets()[args.device]
    if args.layers:
        preset = replace(preset, config={**preset.config, "num_hidden_layers": args.layers})
    if args.steps:
        preset = replace(preset, steps=args.steps)
    if args.warmup is not None:
        preset = replace(preset, warmup=args.warmup)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else (
        torch.device("cpu"))  # fmt: skip
    started = time.perf_counter()

    def save(report: dict[str, Any]) -> None:
        report["wall_seconds"] = round(time.perf_counter() - started, 1)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    report = run_check(preset, device, save)
    print_report(report)
    if args.json:
        print(f"wrote {args.json}")
    failed = [key for key, row in [*report["runs"].items(), *report["checks"].items()]
              if "error" in row]  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
