"""In-process pipelines for tests and benchmarks: every stage a thread, each pipeline over
real authenticated loopback links, the pipelines of a data-parallel run exchanging through
memory or links; what they produced comes back as a `PipelineRun`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from relaytrain_contract import TrainingSpec
from relaytrain_worker.model.lora_merge import Fold
from relaytrain_worker.model.methods import TIED_NAME, lora_config, setup_method
from relaytrain_worker.model.model_slice import BUILD_LOCK, SliceSpec, StageModel, build_stage_model
from relaytrain_worker.model.training import make_optimizer, optimizer_step
from relaytrain_worker.pipeline.boundary import BoundaryCodec, codec_for
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.schedule import StepRunner
from relaytrain_worker.pipeline.stats import ReplicaGroup
from relaytrain_worker.pipeline.transport import Link, LinkCredentials, connect, listen
from relaytrain_worker.replicas.arithmetic import InProcessGroup, micro_ranges, segment_peers
from relaytrain_worker.replicas.group import LinkGroup
from relaytrain_worker.replicas.periodic import PeriodicSync
from relaytrain_worker.state.data import MicroBatch
from torch.nn.utils import parametrize

StageBuilder = Callable[[SliceSpec], StageModel]
"""Builds one stage's slice (instead of loading it from a model directory)."""


@dataclass
class PipelineRun:
    """What an in-process pipeline produced."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step: global name -> gradient after clipping, before the optimizer step."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Trainable parameters after the run (global names; a tied weight once per holder)."""
    stage_params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time of the training steps alone (no model loading or link set-up, no warm-up
    steps; on a GPU, up to the end of their last kernel)."""
    input_tokens: list[int] = field(default_factory=list)
    """Per step: non-padding input tokens the last stage counted (what tokens/s counts),
    warm-up steps included."""
    boundary_bytes: list[list[int]] = field(default_factory=list)
    """Per boundary k (stage k to k+1): [bytes sent down, bytes sent up], on the wire."""
    boundary_deflate: list[list[list[int]]] = field(default_factory=list)
    """Per boundary k, down and up: [the tensors' coded bytes, their bytes once deflated]
    (`transport.Link.coded_bytes_sent`, ``payload_bytes_sent``; equal but under ``delta``)."""
    step_params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step: trainable parameters after the optimizer step (data-parallel runs only)."""
    grad_norms: list[float] = field(default_factory=list)
    """Per step: the global gradient norm before clipping, as the last stage computed it."""
    step_boundary_bytes: list[list[list[int]]] = field(default_factory=list)
    """Per step, per boundary: [bytes sent down, bytes sent up] on the wire from the start up
    to the end of that step (`run_pipeline_threads(per_step=True)` only)."""
    step_seconds: list[float] = field(default_factory=list)
    """Per step: seconds from the clock's start to the end of that step, the latest stage's
    (`run_pipeline_threads(per_step=True)` only)."""


def run_pipeline_threads(
    model: Path | StageBuilder,
    splits: list[tuple[int, int]],
    steps: list[list[MicroBatch]],
    training: TrainingSpec,
    *,
    credentials: Sequence[LinkCredentials],
    method: Literal["lora", "qlora", "full"] = "lora",
    compression: str = "none",
    lora: dict[str, Any] | None = None,
    link_rate: float | None = None,
    link_latency: float = 0.0,
    overlap_encode: bool = True,
    side_stream: bool = True,
    warmup: int = 0,
    grads: Literal["every", "last"] = "every",
    per_step: bool = False,
    ahead: int = 0,
    gradient_tokens: float = 1.0,
    gradient_fill: bool = False,
    codec: Callable[[], BoundaryCodec] = codec_for,
) -> PipelineRun:
    """Run a P-stage pipeline as P threads over real loopback links (tests, benches).

    ``model``: the model directory each stage loads its slice from, or a function that
    builds a stage's slice (relaytrain_testkit.random_models: random weights on a GPU).
    ``credentials``: each stage's link credentials, in stage order (relaytrain_testkit.linkcreds
    mints them as the operator does). ``link_rate`` (bytes per second, each direction)
    paces every link to emulate a slow network, ``link_latency`` (seconds, each direction)
    delays what every link carries (`Link.set_latency`); ``overlap_encode`` and
    ``side_stream`` are passed to `Peers`.
    The first ``warmup`` steps train but are not timed: every stage finishes them, waits for
    the others, and only then starts the clock. ``grads="last"`` keeps only the last step's
    gradients (the other steps' dicts stay empty), so a long run on a GPU holds one copy.
    ``per_step`` also keeps each step's trainable parameters (``step_params``), the bytes
    every boundary carried up to each step's end (``step_boundary_bytes``: every stage
    flushes its sends after each step, so they count exactly that step's frames) and the
    seconds to each step's end (``step_seconds``). ``ahead``: the stages' forwards ahead of
    1F1B (``spec.pipeline.forwardsAhead``). ``gradient_tokens``: the share of tokens whose
    gradients go back (``spec.pipeline.gradientTokens``), ``gradient_fill``: more of them
    while they fit in their activations' bytes (``gradientFill: activations``). ``codec``:
    makes each link's ``delta`` state (`boundary.codec_for`, as a stage's links take it).
    """
    if len(credentials) != len(splits):
        raise ValueError(f"{len(credentials)} link credentials for {len(splits)} stages")
    return _run_pipelines(
        model, [splits], [steps], training,
        credentials=[credentials], groups=None, method=method, compression=compression,
        lora=lora, link_rate=link_rate, overlap_encode=overlap_encode, record_steps=per_step,
        side_stream=side_stream, warmup=warmup, grads=grads, link_latency=link_latency,
        step_bytes=per_step, ahead=ahead, gradient_tokens=gradient_tokens, codec=codec,
        gradient_fill=gradient_fill,
    )[0]  # fmt: skip


def run_data_parallel_threads(
    model_dir: Path,
    splits: list[list[tuple[int, int]]],
    shares: list[int],
    steps: list[list[MicroBatch]],
    training: TrainingSpec,
    *,
    credentials: Sequence[Sequence[LinkCredentials]],
    method: Literal["lora", "qlora", "full"] = "lora",
    lora: dict[str, Any] | None = None,
    replicas: Literal["memory", "links"] = "memory",
    link_rate: float | None = None,
    sync_every: int | None = None,
    sync_code: str = "float64",
    sync_exact: bool = False,
    step_shares: Sequence[Sequence[int]] | None = None,
    grads: Literal["every", "last"] = "every",
) -> list[PipelineRun]:
    """Train R pipelines (``splits[p]``: pipeline p's stages) on one global batch per step,
    every stage a thread, each pipeline over its own loopback links, the pipelines
    exchanging through one `InProcessGroup` (``replicas="memory"``) or, per stage, a
    `LinkGroup` over authenticated loopback links to the stages of the other pipelines that
    hold the same layers (``"links"``). ``link_rate`` (bytes per second, each direction)
    paces every pipeline link and every replica link, as in `run_pipeline_threads`.

    ``shares[p]`` micro-batches of every step go to pipeline p, contiguous and in pipeline
    order (`dataparallel.micro_ranges`). Returns one PipelineRun per pipeline, with
    ``step_params`` recorded (after the step's outer step, if any). ``sync_every``: periodic
    synchronisation (`periodic.PeriodicSync`) every that many steps instead of a gradient
    reduce every step, sending `sync_code` (`sync.outerCode`). ``step_shares[s]``, when
    given, are step s's shares instead (a pipeline given 0 trains nothing that step, as one
    that left the step's members).
    ``grads="last"`` keeps only the last step's gradients.
    """
    if len(credentials) != len(splits) or any(
        len(c) != len(s) for c, s in zip(credentials, splits, strict=True)
    ):
        raise ValueError("one link credential per stage of every pipeline, in order")
    every = [shares] * len(steps) if step_shares is None else list(step_shares)
    if len(every) != len(steps) or any(len(c) != len(splits) for c in every):
        raise ValueError("step_shares: one share per pipeline for every step")
    for micros, counts in zip(steps, every, strict=True):
        if len(micros) != sum(counts):
            raise ValueError(
                f"a step has {len(micros)} micro-batches; the shares add to {sum(counts)}"
            )
    per_pipeline: list[list[list[MicroBatch]]] = [[] for _ in splits]
    for micros, counts in zip(steps, every, strict=True):
        for p, r in enumerate(micro_ranges(counts)):
            per_pipeline[p].append([micros[i] for i in r])
    groups: dict[tuple[int, int], ReplicaGroup]
    if replicas == "memory":
        shared = InProcessGroup([len(s) for s in splits])
        groups = {(p, k): shared for p, split in enumerate(splits) for k in range(len(split))}
    else:
        groups = _link_groups(splits, credentials, link_rate)
    try:
        return _run_pipelines(
            model_dir, splits, per_pipeline, training,
            credentials=credentials, groups=groups, method=method, compression="none",
            lora=lora, link_rate=link_rate, overlap_encode=True, record_steps=True,
            sync_every=sync_every, sync_code=sync_code, sync_exact=sync_exact, grads=grads,
        )  # fmt: skip
    finally:
        for group in groups.values():
            if isinstance(group, LinkGroup):
                group.close()


def _link_groups(
    splits: list[list[tuple[int, int]]],
    credentials: Sequence[Sequence[LinkCredentials]],
    link_rate: float | None = None,
) -> dict[tuple[int, int], ReplicaGroup]:
    """A `LinkGroup` per stage: every pair of stages of two pipelines that hold the same
    layers gets one mutually authenticated loopback link (the later pipeline's stage
    listens for exactly the earlier one's identity), both ends paced to ``link_rate``."""
    links: dict[tuple[int, int], dict[tuple[int, int], Link]] = {
        (p, k): {} for p, split in enumerate(splits) for k in range(len(split))
    }
    for (p, k), mine in links.items():
        for q, j in segment_peers(splits, p, k):
            if q < p:
                continue  # made from the other end
            listener = listen(
                "127.0.0.1:0", credentials=credentials[q][j], expect=credentials[p][k].identity
            )
            addr = f"127.0.0.1:{listener.address[1]}"
            ours, theirs = credentials[p][k], credentials[q][j].identity
            with ThreadPoolExecutor(1) as dialer:
                dialed = dialer.submit(connect, addr, credentials=ours, expect=theirs)
                try:
                    links[(q, j)][(p, k)] = listener.accept(timeout=60)
                finally:
                    listener.close()
                mine[(q, j)] = dialed.result()
            for link in (mine[(q, j)], links[(q, j)][(p, k)]):
                link.limit_rate(link_rate)
    return {me: LinkGroup.from_splits(splits, me[0], me[1], peers) for me, peers in links.items()}


def _run_pipelines(
    model: Path | StageBuilder,
    splits: list[list[tuple[int, int]]],
    steps: list[list[list[MicroBatch]]],
    training: TrainingSpec,
    *,
    credentials: Sequence[Sequence[LinkCredentials]],
    groups: dict[tuple[int, int], ReplicaGroup] | None,
    method: Literal["lora", "qlora", "full"],
    compression: str,
    lora: dict[str, Any] | None,
    link_rate: float | None,
    overlap_encode: bool,
    side_stream: bool = True,
    record_steps: bool,
    sync_every: int | None = None,
    sync_code: str = "float64",
    sync_exact: bool = False,
    warmup: int = 0,
    grads: Literal["every", "last"] = "every",
    link_latency: float = 0.0,
    step_bytes: bool = False,
    ahead: int = 0,
    gradient_tokens: float = 1.0,
    gradient_fill: bool = False,
    codec: Callable[[], BoundaryCodec] = codec_for,
) -> list[PipelineRun]:
    """Every stage of every pipeline as a thread; ``steps[p]``: pipeline p's micro-batches.
    ``step_bytes``: record `PipelineRun.step_boundary_bytes` and ``step_seconds``."""
    listeners = [
        [
            listen("127.0.0.1:0", credentials=creds[k], expect=creds[k - 1].identity)
            if k > 0
            else None
            for k in range(len(creds))
        ]
        for creds in credentials
    ]
    runs = [
        PipelineRun(
            grads=[{} for _ in steps[p]],
            stage_params=[{} for _ in split],
            boundary_bytes=[[0, 0] for _ in split[1:]],
            boundary_deflate=[[[0, 0], [0, 0]] for _ in split[1:]],
            step_params=[{} for _ in steps[p]] if record_steps else [],
            step_boundary_bytes=[[[0, 0] for _ in split[1:]] for _ in steps[p]]
            if step_bytes
            else [],
            step_seconds=[0.0 for _ in steps[p]] if step_bytes else [],
        )
        for p, split in enumerate(splits)
    ]
    errors: list[BaseException] = []
    lock = threading.Lock()
    built = threading.Barrier(sum(len(split) for split in splits))
    warm = threading.Barrier(sum(len(split) for split in splits))
    lcfg = lora or {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}

    def stage_main(p: int, k: int) -> None:
        split, creds, run = splits[p], credentials[p], runs[p]
        group = groups[(p, k)] if groups is not None else None
        count = len(split)
        prev: Link | None = None
        nxt: Link | None = None
        try:
            spec = SliceSpec(split[k][0], split[k][1], k == 0, k == count - 1)
            stage = build_stage_model(model, spec) if isinstance(model, Path) else model(spec)
            cfg = (
                None
                if method == "full"
                else lora_config(lcfg["rank"], lcfg["alpha"], lcfg["dropout"], lcfg["targets"])
            )
            with BUILD_LOCK:
                trainable = setup_method(stage, method, cfg, training.seed)
                optimizer, scheduler = make_optimizer(trainable, training)
            # Building uses the meta device process-wide (see BUILD_LOCK): no stage
            # computes until every stage is built.
            built.wait(timeout=600)
            if k + 1 < count:
                addr = f"127.0.0.1:{listeners[p][k + 1].address[1]}"  # type: ignore[union-attr]
                nxt = connect(addr, credentials=creds[k], expect=creds[k + 1].identity)
            listener = listeners[p][k]
            if listener is not None:
                prev = listener.accept(timeout=60)
            for link in (prev, nxt):
                if link is not None:
                    link.limit_rate(link_rate)
                    link.set_latency(link_latency)
                    link.codec = codec()
            tied = getattr(stage.config, "tie_word_embeddings", False)
            runner = StepRunner(
                stage,
                index=k,
                count=count,
                peers=Peers(prev, nxt, overlap_encode=overlap_encode, side_stream=side_stream),
                trainable=trainable,
                compression=compression,
                max_grad_norm=training.max_grad_norm,
                tied_name=TIED_NAME if method == "full" and tied else None,
                group=group,
                pipeline=p,
                periodic=sync_every is not None,
                ordered_terms=method != "full",
                ahead=ahead,
                gradient_tokens=gradient_tokens,
                gradient_fill=gradient_fill,
                seed=training.seed,
            )
            outer = None
            if sync_every is not None:
                assert group is not None
                outer = PeriodicSync.of(
                    runner, group, every=sync_every, total=len(steps[p]), code=sync_code,
                    fold=Fold(stage.model), exact=sync_exact,
                )  # fmt: skip
            started = time.perf_counter()
            last = len(steps[p]) - 1
            for s, micros in enumerate(steps[p]):
                if warmup and s == warmup:
                    synchronize(runner.device)
                    warm.wait(timeout=600)
                    started = time.perf_counter()
                result = runner.run(s, micros if k == 0 else None, len(micros))
                with lock:
                    if result.loss is not None:
                        run.losses.append(result.loss)
                        run.input_tokens.append(result.input_tokens)
                        run.grad_norms.append(result.grad_norm)
                    for name, param in trainable:
                        if param.grad is not None and (grads == "every" or s == last):
                            run.grads[s][name] = param.grad.detach().clone()
                optimizer_step(optimizer, scheduler)
                if outer is not None:
                    outer.after_step(s + 1, result.share_tokens)
                if record_steps:
                    with lock:
                        for name, param in trainable:
                            run.step_params[s][name] = param.detach().clone()
                if step_bytes:
                    for queued in (runner.peers.prev, runner.peers.next):
                        if queued is not None:
                            queued.flush()
                    synchronize(runner.device)
                    with lock:
                        at = time.perf_counter() - started
                        run.step_seconds[s] = max(run.step_seconds[s], at)
                        if nxt is not None:
                            run.step_boundary_bytes[s][k][0] = nxt.bytes_sent
                        if prev is not None:
                            run.step_boundary_bytes[s][k - 1][1] = prev.bytes_sent
            for queued in (runner.peers.prev, runner.peers.next):
                if queued is not None:
                    queued.flush()
            synchronize(runner.device)
            with lock:
                run.seconds = max(run.seconds, time.perf_counter() - started)
                if nxt is not None:
                    run.boundary_bytes[k][0] = nxt.bytes_sent
                    run.boundary_deflate[k][0] = [nxt.coded_bytes_sent, nxt.payload_bytes_sent]
                if prev is not None:
                    run.boundary_bytes[k - 1][1] = prev.bytes_sent
                    run.boundary_deflate[k - 1][1] = [
                        prev.coded_bytes_sent, prev.payload_bytes_sent,
                    ]  # fmt: skip
                for name, param in trainable:
                    run.params[name] = param.detach().clone()
                    run.stage_params[k][name] = param.detach().clone()
        except BaseException as exc:
            with lock:
                errors.append(exc)
            built.abort()
            warm.abort()
            if isinstance(group, InProcessGroup):
                group.abort(f"pipeline {p} stage {k} failed: {exc!r}")
            elif isinstance(group, LinkGroup):
                group.close()  # the other pipelines' stages see their links break
            for link in (prev, nxt):
                if link is not None:
                    link.close()

    threads = [
        threading.Thread(target=stage_main, args=(p, k))
        for p, split in enumerate(splits)
        for k in range(len(split))
    ]
    with _one_parametrize_cache_at_a_time():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for row in listeners:
        for lst in row:
            if lst is not None:
                lst.close()
    if errors:
        raise errors[0]
    return runs


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU's kernels) before a clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_PARAMETRIZE = threading.RLock()


@contextmanager
def _one_parametrize_cache_at_a_time() -> Iterator[None]:
    """torch's parametrization cache (`parametrize.cached`, which peft enters around the
    forward of each LoRA on expert weights) is one global of the process, cleared when the
    last context leaves: with stages as threads, one stage inside it keeps another's cached
    weight past that one's context, and its next micro-batch reuses a weight whose graph was
    already backwarded ("backward through the graph a second time", MoE families, seen
    under load). Stage processes never share it; here the contexts take turns (nothing
    inside one waits on a link, so no stage holds the turn while waiting for another)."""
    original = parametrize.cached

    @contextmanager
    def in_turn() -> Iterator[None]:
        with _PARAMETRIZE, original():
            yield

    parametrize.cached = in_turn
    try:
        yield
    finally:
        parametrize.cached = original
