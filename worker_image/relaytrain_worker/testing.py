"""Helpers for tests and benchmarks: tiny models from configs, and in-process pipelines.

Nothing here is used by a running stage. Tiny models are built from a config with
random weights (no hub downloads) and saved as real sharded safetensors checkpoints
with a small byte-level BPE tokenizer trained on the spot, so every code path a real
model takes (index, shards, tokenizer, chat template) is exercised.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from relaytrain_contract import TrainingSpec
from torch import nn

from relaytrain_worker.methods import TIED_NAME, lora_config, setup_method
from relaytrain_worker.model_slice import BUILD_LOCK, SliceSpec, build_stage_model
from relaytrain_worker.peers import Peers
from relaytrain_worker.schedule import MicroBatch, StepRunner
from relaytrain_worker.training import make_optimizer, optimizer_step
from relaytrain_worker.transport import Link, LinkCredentials, connect, listen

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stage is a contiguous slice of the model",
    "pipelines send activations forward and gradients back",
    "low rank adapters train few parameters",
    "checkpoints are committed by a manifest written last",
]


def save_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on CORPUS and save it; returns the tokenizer's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    return len(fast)


def tiny_model_dir(
    out: Path,
    *,
    arch: Literal["llama", "mistral", "qwen2"] = "llama",
    layers: int = 4,
    hidden: int = 32,
    tied: bool = True,
    max_shard_size: str = "40KB",
    max_positions: int = 128,
    seed: int = 0,
    intermediate: int | None = None,
    vocab: int | None = None,
) -> Path:
    """A random tiny causal LM saved like a hub checkpoint (sharded) with a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    out.mkdir(parents=True, exist_ok=True)
    n_tok = save_tokenizer(out)
    kinds: dict[str, Any] = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    config = kinds[arch](
        vocab_size=vocab or n_tok,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        pad_token_id=n_tok - 1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out


def random_batches(
    steps: int, m: int, mbs: int, seq: int, vocab: int, *, seed: int = 0
) -> list[list[MicroBatch]]:
    """`steps` lists of `m` micro-batches of random full-length rows (no padding, so every
    token is a processed token; labels are the inputs), for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micros = []
        for _ in range(m):
            ids = torch.randint(0, vocab, (mbs, seq), generator=gen)
            pos = torch.arange(seq).expand(mbs, -1).contiguous()
            micros.append(MicroBatch(ids, torch.ones_like(ids), pos, ids.clone()))
        out.append(micros)
    return out


def even_splits(layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) per stage, as even as possible."""
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


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
    """Wall time of the training steps alone (no model loading or link set-up)."""
    input_tokens: list[int] = field(default_factory=list)
    """Per step: non-padding input tokens the last stage counted (what tokens/s counts)."""
    boundary_bytes: list[list[int]] = field(default_factory=list)
    """Per boundary k (stage k to k+1): [bytes sent down, bytes sent up], on the wire."""


def run_pipeline_threads(
    model_dir: Path,
    splits: list[tuple[int, int]],
    steps: list[list[MicroBatch]],
    training: TrainingSpec,
    *,
    credentials: Sequence[LinkCredentials],
    method: Literal["lora", "qlora", "full"] = "lora",
    compression: str = "none",
    lora: dict[str, Any] | None = None,
    link_rate: float | None = None,
    overlap_encode: bool = True,
) -> PipelineRun:
    """Run a P-stage pipeline as P threads over real loopback links (tests, benches).

    ``credentials``: each stage's link credentials, in stage order (tests/linkcreds.py
    mints them as the operator does). ``link_rate`` (bytes per second, each direction)
    paces every link to emulate a slow network; ``overlap_encode`` is passed to `Peers`.
    """
    count = len(splits)
    if len(credentials) != count:
        raise ValueError(f"{len(credentials)} link credentials for {count} stages")
    ids = [c.identity for c in credentials]
    listeners = [
        listen("127.0.0.1:0", credentials=credentials[k], expect=ids[k - 1]) if k > 0 else None
        for k in range(count)
    ]
    addrs = [f"127.0.0.1:{lst.address[1]}" if lst else None for lst in listeners]
    run = PipelineRun(
        grads=[{} for _ in steps],
        stage_params=[{} for _ in splits],
        boundary_bytes=[[0, 0] for _ in splits[1:]],
    )
    errors: list[BaseException] = []
    lock = threading.Lock()
    built = threading.Barrier(count)
    lcfg = lora or {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}

    def stage_main(k: int) -> None:
        prev: Link | None = None
        nxt: Link | None = None
        try:
            spec = SliceSpec(splits[k][0], splits[k][1], k == 0, k == count - 1)
            stage = build_stage_model(model_dir, spec)
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
                nxt = connect(str(addrs[k + 1]), credentials=credentials[k], expect=ids[k + 1])
            listener = listeners[k]
            if listener is not None:
                prev = listener.accept(timeout=60)
            for link in (prev, nxt):
                if link is not None:
                    link.limit_rate(link_rate)
            tied = getattr(stage.config, "tie_word_embeddings", False)
            runner = StepRunner(
                stage,
                index=k,
                count=count,
                peers=Peers(prev, nxt, overlap_encode=overlap_encode),
                trainable=trainable,
                compression=compression,
                max_grad_norm=training.maxGradNorm,
                tied_name=TIED_NAME if method == "full" and tied else None,
            )
            started = time.perf_counter()
            for s, micros in enumerate(steps):
                result = runner.run(s, micros if k == 0 else None, len(micros))
                with lock:
                    if result.loss is not None:
                        run.losses.append(result.loss)
                        run.input_tokens.append(result.input_tokens)
                    for name, p in trainable:
                        if p.grad is not None:
                            run.grads[s][name] = p.grad.detach().clone()
                optimizer_step(optimizer, scheduler)
            for queued in (runner.peers.prev, runner.peers.next):
                if queued is not None:
                    queued.flush()
            with lock:
                run.seconds = max(run.seconds, time.perf_counter() - started)
                if nxt is not None:
                    run.boundary_bytes[k][0] = nxt.bytes_sent
                if prev is not None:
                    run.boundary_bytes[k - 1][1] = prev.bytes_sent
                for name, p in trainable:
                    run.params[name] = p.detach().clone()
                    run.stage_params[k][name] = p.detach().clone()
        except BaseException as exc:
            with lock:
                errors.append(exc)
            built.abort()
            for link in (prev, nxt):
                if link is not None:
                    link.close()

    threads = [threading.Thread(target=stage_main, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lst in listeners:
        if lst is not None:
            lst.close()
    if errors:
        raise errors[0]
    return run


def run_reference(
    model_dir: Path,
    steps: list[list[MicroBatch]],
    training: TrainingSpec,
    *,
    method: Literal["lora", "full"] = "lora",
    lora: dict[str, Any] | None = None,
) -> PipelineRun:
    """Single-process training of the unsplit model with the same arithmetic."""
    from transformers import AutoModelForCausalLM

    from relaytrain_worker.methods import apply_lora
    from relaytrain_worker.schedule import count_items, token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.train()
    lcfg = lora or {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    trainable: list[tuple[str, nn.Parameter]]
    if method == "full":
        trainable = list(model.named_parameters())
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        cfg = lora_config(lcfg["rank"], lcfg["alpha"], lcfg["dropout"], lcfg["targets"])
        trainable = apply_lora(model, cfg, training.seed)
    optimizer, scheduler = make_optimizer(trainable, training)
    run = PipelineRun()
    started = time.perf_counter()
    for micros in steps:
        items = count_items(micros)
        total = torch.zeros((), dtype=torch.float64)
        for mb in micros:
            logits = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                use_cache=False,
            ).logits
            part = token_loss_sum(logits, mb.labels)
            total += float(part.detach())
            (part / items).backward()  # type: ignore[no-untyped-call]
        if training.maxGradNorm > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in trainable], training.maxGradNorm)
        run.losses.append(float(total / items))
        run.grads.append({n: p.grad.detach().clone() for n, p in trainable if p.grad is not None})
        optimizer_step(optimizer, scheduler)
    run.seconds = time.perf_counter() - started
    run.params = {n: p.detach().clone() for n, p in trainable}
    return run
