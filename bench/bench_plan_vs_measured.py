"""Predicted against measured step time: the planner's cost model against real local runs.

    .venv/bin/python bench/bench_plan_vs_measured.py [--quick] [--json OUT] [--keep]

For each configuration (a tiny random Llama built from a config; P stages; M micro-batches;
lora or full; compression none or int8):

1. Calibrate a catalog entry for this machine's CPU, one core per stage: dense fp32 matmuls
   shaped like the model's linears (forward x·Wᵀ and input gradient g·W, T = batch x sequence
   rows), one thread per stream, P streams at once, timed in each thread's CPU seconds — what
   one core does when it is the stage's alone, as a GPU is. The wall-clock rate of the same
   streams says how much of a core the machine's other work left ("share", reported only).
   Memory is the machine's; memory bandwidth a single-thread copy. The link is the stages'
   own transport (authenticated, encrypted frames) over loopback: throughput of
   activation-sized frames, and half the round trip of an empty one.
2. Ask the planner (``assess``) to price the split the run used, with its default settings
   (efficiency 0.45) on that entry.
3. Run the job with ``relaytrain run --local``: one ``python -m relaytrain_worker`` process per
   stage, real links, data loading, progress and checkpoints — what a user runs. Processes,
   not the in-process helper (testing.run_pipeline_threads), because threads share one
   interpreter lock and no real stage does. Each stage gets one thread (OMP_NUM_THREADS=1):
   P <= 2 stages have a core each; P = 3 shares two cores, which the table says.
   Measured: the step time of the last stage (loss-history.json: label tokens of a step / its
   tokens per second; packed text rows, so each row learns all positions but the first), the
   median of every step after the first (first-call costs) with its range; and each stage's
   CPU seconds per step (/proc/<pid>/stat between the end of step 1 and the end of the run),
   which the machine's other load does not inflate — the planner's per-stage busy time
   (M x (compute + sends)) is compared with it. "1F1B@busy" applies the planner's schedule,
   (M + P - 1) beats of the busiest stage, to those measured busy times: against the measured
   step it isolates the schedule and the machine's contention from the compute model.
4. Fit what the default misses on the per-stage CPU times: an efficiency, and an overhead per
   layer and micro-batch (the framework's per-operator cost, which a FLOP count cannot see),
   scored leave-one-case-out, on busy times and on the step times they predict.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "worker_image"), str(REPO / "testkit")]

from relaytrain_operator.domain.planner import (  # noqa: E402
    DEFAULT_CATALOG,
    CostSettings,
    ModelShape,
    Plan,
    Pool,
    TrainingShape,
    assess,
)
from relaytrain_operator.domain.planner.model_shape import LINEAR_NAMES  # noqa: E402
from relaytrain_testkit.jobs import Job  # noqa: E402

PRODUCT = "CPU-local-stage"
"""The catalog entry calibrated here: one core of this machine, as one stage uses it."""
POOL = "cpu"
THREADS_PER_STAGE = 1
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_RANK = 8
VOCAB = 2048
JOB = "pvm"
POLL_SECONDS = 0.01
"""How often the run is sampled: CPU time is read within this of the end of a step."""


@dataclass(frozen=True)
class Case:
    """One configuration: a model, a batch shape and a pipeline."""

    hidden: int
    layers: int
    seq: int
    """Tokens per sequence."""
    mbs: int
    """Sequences per micro-batch."""
    micro_batches: int
    """Micro-batches per optimizer step (M)."""
    stages: int
    """Pipeline stages (P), one process each."""
    method: Literal["lora", "full"] = "lora"
    compression: Literal["none", "int8"] = "none"
    steps: int = 6
    """Optimizer steps run; the first is not measured."""

    @property
    def name(self) -> str:
        return (
            f"h{self.hidden} L{self.layers} s{self.seq}x{self.mbs} M{self.micro_batches} "
            f"P{self.stages} {self.method} {self.compression}"
        )

    @property
    def label_tokens(self) -> int:
        """Label tokens of one step: packed rows learn every position but the first."""
        return self.micro_batches * self.mbs * (self.seq - 1)


SMALL = Case(hidden=256, layers=4, seq=64, mbs=2, micro_batches=4, stages=1)
MEDIUM = Case(hidden=512, layers=6, seq=128, mbs=1, micro_batches=8, stages=1)
CASES = [
    SMALL,
    replace(SMALL, stages=2),
    replace(SMALL, stages=2, compression="int8"),
    MEDIUM,
    replace(MEDIUM, stages=2),
    replace(MEDIUM, stages=2, compression="int8"),
    replace(MEDIUM, stages=2, method="full"),
    replace(MEDIUM, stages=3),
]
QUICK_CASES = [replace(SMALL, steps=5), replace(SMALL, stages=2, steps=5)]


# -- calibration ---------------------------------------------------------------------------


CALIBRATE_SCRIPT = """
import json, sys, time
import torch
from torch.nn import functional
torch.set_num_threads(1)
while line := sys.stdin.readline():
    job = json.loads(line)
    t, shapes = job["tokens"], job["shapes"]
    gen = torch.Generator().manual_seed(0)
    mats = [(torch.randn(t, i, generator=gen), torch.randn(o, i, generator=gen),
             torch.randn(t, o, generator=gen)) for i, o in shapes]
    flops = sum(4.0 * t * i * o for i, o in shapes)
    for x, w, g in mats:
        functional.linear(x, w), torch.mm(g, w)
    print("ready", flush=True)
    sys.stdin.readline()
    rounds, cpu0, wall0, secs = 0, time.thread_time(), time.perf_counter(), job["seconds"]
    while time.thread_time() - cpu0 < secs and time.perf_counter() - wall0 < 5 * secs:
        for x, w, g in mats:
            functional.linear(x, w), torch.mm(g, w)
        rounds += 1
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    print(json.dumps([rounds * flops / cpu, rounds * flops / wall]), flush=True)
"""


class Calibrator:
    """Processes that time fp32 matmuls shaped like a decoder layer's linears (forward x·Wᵀ
    and input gradient g·W), one thread each, started together.

    Processes, each in its own session like a stage process, because the kernel shares the
    CPU between sessions (autogroups) first: threads of this process would get one session's
    share between them. Kept alive (idle on stdin) between measurements: importing torch
    takes seconds here.
    """

    def __init__(self, count: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", CALIBRATE_SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            for _ in range(count)
        ]

    def rates(
        self, shape: ModelShape, tokens: int, streams: int, seconds: float
    ) -> tuple[float, float]:
        """(FLOPs per CPU second, FLOPs per wall second) of one stream while ``streams``
        run at once (medians over the streams)."""
        procs = self.procs[:streams]
        job = {
            "tokens": tokens,
            "shapes": [shape.linear_shape(n) for n in LINEAR_NAMES],
            "seconds": seconds,
        }
        for p in procs:
            self._say(p, json.dumps(job))
        for p in procs:
            self._hear(p)  # "ready": every stream built and warmed up
        for p in procs:
            self._say(p, "go")
        rates = [json.loads(self._hear(p)) for p in procs]
        return statistics.median(r[0] for r in rates), statistics.median(r[1] for r in rates)

    @staticmethod
    def _say(proc: subprocess.Popen[str], line: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    @staticmethod
    def _hear(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"calibration process exited with {proc.wait()}")
        return line.strip()

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=30)


def memory_gbs() -> float:
    """Single-thread copy bandwidth (read + write), GB/s: the entry's memoryBandwidthGBs
    (only qlora's dequantisation uses it; no case here does)."""
    import torch

    src = torch.ones(16 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    began = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * 2 * src.numel() * 4 / (time.perf_counter() - began) / 1e9


def machine_memory_mib() -> int:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib // 1024


def loopback_link(values: int, frames: int = 8) -> tuple[float, float]:
    """(Mbit/s, one-way ms) of the stages' transport over loopback: throughput of frames of
    ``values`` fp32 activations (uncompressed), and half the round trip of an empty frame."""
    import torch
    from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
    from relaytrain_worker.pipeline.transport import Frame, LinkCredentials, connect, listen

    files = mint_link_credentials("bench", "links", [2], now=datetime.now(UTC))
    creds = [LinkCredentials(*stage_pem(files, 0, k)) for k in range(2)]
    listener = listen("127.0.0.1:0", credentials=creds[1], expect=creds[0].identity)
    accepted: list[Any] = []
    acceptor = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=30)))
    acceptor.start()
    a = connect(f"127.0.0.1:{listener.address[1]}", credentials=creds[0], expect=creds[1].identity)
    acceptor.join()
    b = accepted[0]
    try:
        pings = []
        for _ in range(20):
            began = time.perf_counter()
            a.send(Frame("ping", 0, 0))
            b.recv(timeout=30)
            b.send(Frame("pong", 0, 0))
            a.recv(timeout=30)
            pings.append((time.perf_counter() - began) / 2)
        hidden = torch.randn(values)

        def send_all() -> None:
            for i in range(frames):
                a.send(Frame("act", 0, i, {"h": hidden}))

        sender = threading.Thread(target=send_all)
        began = time.perf_counter()
        sender.start()
        for _ in range(frames):
            b.recv(timeout=60)
        seconds = time.perf_counter() - began
        sender.join()
    finally:
        a.close()
        b.close()
        listener.close()
    return frames * values * 4 * 8 / seconds / 1e6, statistics.median(pings) * 1000


@dataclass(frozen=True)
class Calibration:
    """This machine as the planner sees it for one case: one core per stage."""

    flops_per_s: float
    """The entry's matmul rate: FLOPs per CPU second of one stage's thread (a core of its
    own, as a stage has its own GPU)."""
    share: float
    """Wall rate / CPU rate while P streams ran (mean of before and after the run)."""
    memory_mib: int
    memory_gbs: float
    link_mbps: float
    link_one_way_ms: float

    def catalog(self) -> Any:
        tflops = self.flops_per_s / 1e12
        entry = {
            "tflops": tflops,
            "fp32Tflops": tflops,
            "memoryMiB": self.memory_mib,
            "memoryBandwidthGBs": self.memory_gbs,
            "bf16": False,
        }
        return DEFAULT_CATALOG.with_overrides({"gpus": {PRODUCT: entry}})

    def pool(self, gpus: int) -> Pool:
        # A send costs the latency of both ends: each end gets half the one-way time.
        return Pool(POOL, PRODUCT, gpus, self.link_mbps, self.link_one_way_ms / 2)


# -- predicted and measured ----------------------------------------------------------------


def predict(
    case: Case,
    shape: ModelShape,
    split: Sequence[tuple[int, int]],
    cal: Calibration,
    settings: CostSettings | None = None,
) -> Plan:
    """The planner's price of the split the run used, on the calibrated entry."""
    training = TrainingShape(
        case.mbs, case.micro_batches, case.seq, method=case.method, lora_rank=LORA_RANK,
        lora_targets=LORA_TARGETS, compression=case.compression, dtype="float32",
    )  # fmt: skip
    stages = [(POOL, end - start) for start, end in split]
    return assess(
        shape, training, [cal.pool(case.stages)], stages, cal.catalog(), settings=settings
    )


def write_job(case: Case, model: Path, data: Path, root: Path) -> Path:
    job = (
        Job(JOB)
        .model(str(model), dtype="float32")
        .dataset(str(data), format="text", sequence_length=case.seq, packing=True)
        .training(steps=case.steps, micro_batch_size=case.mbs, micro_batches=case.micro_batches,
                  learning_rate=1e-4, warmup_steps=0)
        .pipeline(stages=case.stages, compression=case.compression)
        .checkpoint(str(root / "ckpt"), every_steps=case.steps, keep=1)
    )  # fmt: skip
    if case.method == "full":
        job = job.method("full")
    else:
        job = job.method(case.method, rank=LORA_RANK, alpha=2 * LORA_RANK,
                         target_modules=list(LORA_TARGETS))  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    return job.write(root / "job.yaml")


def step_seconds(history: list[dict[str, Any]], label_tokens: int) -> list[float]:
    """Seconds of each step after the first, from the last stage's loss history."""
    return [label_tokens / e["tokensPerSecond"] for e in history if e["step"] > 1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, every thread included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Measured:
    """What a local run did."""

    split: list[tuple[int, int]]
    """[start, end) layers per stage, as the run used them."""
    steps: list[float]
    """Seconds of every step after the first (last stage)."""
    busy: list[float]
    """CPU seconds per step of each stage process, after step 1."""


def run_local(case: Case, model: Path, data: Path, root: Path) -> Measured:
    """Run the case with `relaytrain run --local`, sampling each stage's CPU time whenever
    the last stage finishes a step."""
    job = write_job(case, model, data, root)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "worker_image")])
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(THREADS_PER_STAGE)
    cmd = [sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
           "--workdir", str(root / "run"), "--no-progress"]  # fmt: skip
    history_path = root / "ckpt" / "default" / JOB / "loss-history.json"
    progress_path = root / "ckpt" / "default" / JOB / "progress.json"
    marks: dict[int, list[float]] = {}
    pids: list[int] = []
    with (root / "run.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(POLL_SECONDS)
                state = _read_json(root / "run" / "state.json") if not pids else None
                if state and all(s["pid"] for s in state["stages"]):
                    pids = [s["pid"] for s in state["stages"]]
                # loss-history.json is written once at the end; progress.json every step.
                done = int((_read_json(progress_path) or {}).get("step", 0))
                if pids and done and done not in marks:
                    # A stage that already exited is past the last step: nothing to sample.
                    with contextlib.suppress(OSError):
                        marks[done] = [cpu_seconds(p) for p in pids]
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name}: relaytrain run --local failed; see {root / 'run.log'}")
    first, last = min(marks), max(marks)
    if last <= first:
        raise RuntimeError(f"{case.name}: the run was too short to sample CPU time")
    busy = [(b - a) / (last - first) for a, b in zip(marks[first], marks[last], strict=True)]
    state = _read_json(root / "run" / "state.json")
    split = [(int(s["layers"][0]), int(s["layers"][1])) for s in state["stages"]]
    history = _read_json(history_path)
    return Measured(split, step_seconds(history, case.label_tokens), busy)


# -- fitting what the default misses -------------------------------------------------------


@dataclass(frozen=True)
class Terms:
    """A case's planner terms at efficiency 1 per stage, and what was measured."""

    micro_batches: int
    compute: tuple[float, ...]
    """Seconds per micro-batch of pure FLOPs at the calibrated rate."""
    layers: tuple[int, ...]
    link: tuple[float, ...]
    """Seconds of sends per micro-batch."""
    step: float
    """Measured step seconds."""
    busy: tuple[float, ...]
    """Measured CPU seconds per step of each stage."""

    @property
    def beats(self) -> int:
        """M + P - 1."""
        return self.micro_batches + len(self.compute) - 1

    def stage_busy(self, efficiency: float, layer_overhead: float) -> list[float]:
        """Per-stage busy time per step with an overhead per layer and micro-batch."""
        return [
            self.micro_batches * (c / efficiency + n * layer_overhead + lk)
            for c, n, lk in zip(self.compute, self.layers, self.link, strict=True)
        ]

    def step_time(self, efficiency: float, layer_overhead: float) -> float:
        """Step seconds under 1F1B: (M + P - 1) beats of the busiest stage."""
        return self.beats * max(self.stage_busy(efficiency, layer_overhead)) / self.micro_batches


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def busy_errors(t: Terms, params: tuple[float, float]) -> list[float]:
    return [error_pct(p, m) for p, m in zip(t.stage_busy(*params), t.busy, strict=True)]


def fit(cases: Sequence[Terms], with_overhead: bool) -> tuple[float, float]:
    """(efficiency, seconds per layer and micro-batch) minimising the mean absolute % error
    of every stage's busy time, by grid search (two parameters: simple and exact enough)."""
    effs = [0.05 * 1.02**i for i in range(200)]  # 0.05 .. 2.6
    overheads = [i * 2.5e-5 for i in range(201)] if with_overhead else [0.0]  # 0 .. 5 ms
    return min(
        itertools.product(effs, overheads),
        key=lambda p: sum(abs(e) for t in cases for e in busy_errors(t, p)),
    )


def leave_one_out(cases: Sequence[Terms], with_overhead: bool) -> tuple[float, float]:
    """Mean absolute % error of (stage busy, step) for each case from a fit on the others."""
    busy, step = [], []
    for i, t in enumerate(cases):
        params = fit([c for j, c in enumerate(cases) if j != i], with_overhead)
        busy += [abs(e) for e in busy_errors(t, params)]
        step.append(abs(error_pct(t.step_time(*params), t.step)))
    return statistics.fmean(busy), statistics.fmean(step)


# -- main ----------------------------------------------------------------------------------


def make_data(path: Path) -> None:
    from relaytrain_testkit.tiny_models import CORPUS

    words = " ".join(CORPUS).split()
    with path.open("w") as f:
        for i in range(300):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(80))
            f.write(json.dumps({"text": text}) + "\n")


def measure_case(
    case: Case, model: Path, data: Path, root: Path, calibrator: Calibrator
) -> dict[str, Any]:
    shape = ModelShape.from_hf_config(json.loads((model / "config.json").read_text()))
    tokens = case.mbs * case.seq
    before = calibrator.rates(shape, tokens, case.stages, 1.0)
    mbps, one_way = loopback_link(tokens * case.hidden) if case.stages > 1 else (1e5, 0.0)
    load = os.getloadavg()[0]
    measured = run_local(case, model, data, root)
    after = calibrator.rates(shape, tokens, case.stages, 1.0)
    core = Calibration(
        (before[0] + after[0]) / 2,
        (before[1] / before[0] + after[1] / after[0]) / 2,
        machine_memory_mib(), memory_gbs(), mbps, one_way,
    )  # fmt: skip
    predicted = predict(case, shape, measured.split, core)
    at_1 = predict(case, shape, measured.split, core, CostSettings(efficiency=1.0))
    step = statistics.median(measured.steps)
    terms = Terms(
        case.micro_batches,
        tuple(x.compute_seconds for x in at_1.stages),
        tuple(x.layers for x in at_1.stages),
        tuple(x.link_seconds for x in at_1.stages),
        step,
        tuple(measured.busy),
    )
    pred_busy = [case.micro_batches * x.seconds for x in predicted.stages]
    return {
        "case": case.name,
        "split": [f"{a}-{b - 1}" for a, b in measured.split],
        "gflops_per_core": round(core.flops_per_s / 1e9, 1),
        "gflops_before_after": [round(before[0] / 1e9, 1), round(after[0] / 1e9, 1)],
        "share": round(core.share, 2),
        "share_before_after": [round(before[1] / before[0], 2), round(after[1] / after[0], 2)],
        "oversubscribed": case.stages > (os.cpu_count() or 1),
        "link": f"{core.link_mbps:.0f} Mbit/s, {core.link_one_way_ms:.2f} ms one way",
        "load_before": round(load, 1),
        "predicted_s": predicted.step_seconds,
        "measured_s": step,
        "measured_range": (min(measured.steps), max(measured.steps)),
        "error_pct": error_pct(predicted.step_seconds, step),
        # The planner's schedule applied to the measured busy times: what the step would be
        # if every stage had its core to itself and waited only as 1F1B says.
        "schedule_on_busy_s": terms.beats * max(measured.busy) / case.micro_batches,
        "predicted_busy_s": pred_busy,
        "measured_busy_s": measured.busy,
        "busy_error_pct": [error_pct(p, m) for p, m in zip(pred_busy, measured.busy, strict=True)],
        "terms": asdict(terms),
    }


def terms_from_row(row: dict[str, Any]) -> Terms:
    t = row["terms"]
    return Terms(
        t["micro_batches"], tuple(t["compute"]), tuple(t["layers"]), tuple(t["link"]),
        t["step"], tuple(t["busy"]),
    )  # fmt: skip


def print_tables(rows: list[dict[str, Any]]) -> None:
    print(
        "Step time (s): planner (efficiency 0.45) on a calibrated core vs relaytrain run --local;\n"
        "share: the part of a core a stage got (calibration, mean of before and after the run);\n"
        "1F1B@busy: the planner's schedule on the measured CPU seconds of each stage"
    )
    print(
        f"{'configuration':38} {'split':13} {'GF/s':>5} {'share':>5} {'pred':>6} {'meas':>6} "
        f"{'range':>11} {'error':>7} {'1F1B@busy':>9} {'error':>7}"
    )
    for r in rows:
        lo, hi = r["measured_range"]
        mark = " *" if r["oversubscribed"] else ""
        sched = r["schedule_on_busy_s"]
        print(
            f"{r['case']:38} {','.join(r['split']):13} {r['gflops_per_core']:5.1f} "
            f"{r['share']:5.2f} {r['predicted_s']:6.3f} {r['measured_s']:6.3f} "
            f"{f'{lo:.2f}-{hi:.2f}':>11} {r['error_pct']:+6.1f}% {sched:9.3f} "
            f"{error_pct(sched, r['measured_s']):+6.1f}%{mark}"
        )
    core = statistics.fmean(abs(r["error_pct"]) for r in rows)
    sched = statistics.fmean(abs(error_pct(r["schedule_on_busy_s"], r["measured_s"])) for r in rows)
    print(f"mean absolute error: {core:.1f}% (planner), {sched:.1f}% (1F1B on measured busy)")
    if any(r["oversubscribed"] for r in rows):
        print("* more stages than cores: the stages share cores the planner counts as separate")
    print()
    print("Busy time per stage and step (s): planner M x (compute + sends) vs CPU seconds")
    for r in rows:
        cells = [
            f"{k}: {p:.3f}/{m:.3f} ({e:+.0f}%)"
            for k, (p, m, e) in enumerate(
                zip(r["predicted_busy_s"], r["measured_busy_s"], r["busy_error_pct"], strict=True)
            )
        ]
        print(f"{r['case']:38} {'  '.join(cells)}")
    busy = [abs(e) for r in rows for e in r["busy_error_pct"]]
    print(f"mean absolute error: {statistics.fmean(busy):.1f}% over {len(busy)} stages")


def print_fits(rows: list[dict[str, Any]]) -> None:
    terms = [terms_from_row(r) for r in rows]
    print()
    for with_overhead in (False, True):
        params = fit(terms, with_overhead)
        busy = statistics.fmean(abs(e) for t in terms for e in busy_errors(t, params))
        step = statistics.fmean(abs(error_pct(t.step_time(*params), t.step)) for t in terms)
        what = f"efficiency {params[0]:.2f}" + (
            f" + {params[1] * 1e3:.2f} ms per layer and micro-batch" if with_overhead else ""
        )
        line = f"fit {what}: busy {busy:.1f}%, step {step:.1f}% mean abs. error in-sample"
        if len(terms) > 2:
            loo_busy, loo_step = leave_one_out(terms, with_overhead)
            line += f"; leave-one-case-out busy {loo_busy:.1f}%, step {loo_step:.1f}%"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="two small cases (< 2 minutes)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (runs, logs)")
    args = parser.parse_args()
    from relaytrain_testkit.tiny_models import tiny_model_dir

    began = time.monotonic()
    cases = QUICK_CASES if args.quick else CASES
    root = Path(tempfile.mkdtemp(prefix="pvm-"))
    make_data(root / "data.jsonl")
    models: dict[tuple[int, int], Path] = {}
    rows = []
    calibrator = Calibrator(max(c.stages for c in cases))
    print(f"{os.cpu_count()} CPU(s), {THREADS_PER_STAGE} thread per stage; workdir {root}")
    for i, case in enumerate(cases):
        key = (case.hidden, case.layers)
        if key not in models:
            models[key] = tiny_model_dir(
                root / f"model-{case.hidden}-{case.layers}", layers=case.layers,
                hidden=case.hidden, vocab=VOCAB, max_positions=max(128, case.seq),
                max_shard_size="50MB",
            )  # fmt: skip
        row = measure_case(case, models[key], root / "data.jsonl", root / f"case-{i}", calibrator)
        rows.append(row)
        print(
            f"  {row['case']}: predicted {row['predicted_s']:.3f}s, measured "
            f"{row['measured_s']:.3f}s ({row['error_pct']:+.1f}%); {row['link']}; "
            f"load {row['load_before']}, GFLOP/s per CPU-s {row['gflops_before_after']}, "
            f"share {row['share_before_after']} (before, after)",
            flush=True,
        )
    calibrator.close()
    print()
    print_tables(rows)
    print_fits(rows)
    print(f"total {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.keep:  # models and full-training checkpoints: hundreds of MB
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
