"""relaytrain's pipeline against torch.distributed.pipelining, side by side.

    .venv/bin/python bench/bench_worker_pipelining.py [--stages 2] [--steps 4]

Same model (random Llama, 6 layers, hidden 256), same split, same 1F1B schedule, same
micro-batches, LoRA r=4 on q/v, one process per stage on this machine, each capped at
cores/stages intra-op threads. relaytrain: mutual-TLS TCP links
(compression none); torch: gloo point-to-point. Prints tokens/s of each and the ratio.
Only the training steps after a warm-up step are timed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from relaytrain_contract import TrainingSpec
from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_worker.model.methods import lora_config, setup_method
from relaytrain_worker.model.model_slice import SliceSpec, StageModel, build_stage_model
from relaytrain_worker.model.training import make_optimizer, optimizer_step
from relaytrain_worker.pipeline.peers import Peers
from relaytrain_worker.pipeline.schedule import StepRunner, token_loss_sum
from relaytrain_worker.pipeline.transport import LinkCredentials, connect, listen
from relaytrain_worker.state.data import MicroBatch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))
from relaytrain_testkit.inputs import even_splits
from relaytrain_testkit.tiny_models import tiny_model_dir

LAYERS, MBS, SEQ, M = 6, 4, 128, 8


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _training(steps: int) -> TrainingSpec:
    return TrainingSpec(
        steps=steps + 1, microBatchSize=MBS, microBatches=M, learningRate=1e-3,
        schedule="constant", warmupSteps=0, weightDecay=0.0, maxGradNorm=0.0, seed=0,
    )  # fmt: skip


def _micros(step: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(M):
        ids = torch.randint(0, 300, (MBS, SEQ), generator=gen)
        pos = torch.arange(SEQ).expand(MBS, -1).contiguous()
        out.append(MicroBatch(ids, torch.ones_like(ids), pos, ids.clone()))
    return out


def _stage(model_dir: str, rank: int, stages: int) -> tuple[StageModel, list[Any]]:
    start, end = even_splits(LAYERS, stages)[rank]
    stage = build_stage_model(Path(model_dir), SliceSpec(start, end, rank == 0, rank == stages - 1))
    trainable = setup_method(stage, "lora", lora_config(4, 8.0, 0.0, ["q_proj", "v_proj"]), 0)
    return stage, trainable


def relaytrain_rank(rank: int, stages: int, model_dir: str, ports: list[int], steps: int,
                    pems: list[tuple[str, str, str]], results: Any) -> None:  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // stages))
    stage, trainable = _stage(model_dir, rank, stages)
    optimizer, scheduler = make_optimizer(trainable, _training(steps))
    creds = LinkCredentials(*pems[rank])
    ids = [LinkCredentials(*p).identity for p in pems]
    listener = (
        listen(f"127.0.0.1:{ports[rank]}", credentials=creds, expect=ids[rank - 1])
        if rank
        else None
    )
    nxt = None
    if rank + 1 < stages:
        nxt = connect(f"127.0.0.1:{ports[rank + 1]}", credentials=creds, expect=ids[rank + 1])
    prev = listener.accept(timeout=120) if listener else None
    runner = StepRunner(stage, index=rank, count=stages, peers=Peers(prev, nxt),
                        trainable=trainable, compression="none", max_grad_norm=0.0)  # fmt: skip
    started = 0.0
    for step in range(steps + 1):
        if step == 1:
            started = time.perf_counter()
        runner.run(step, _micros(step) if rank == 0 else None, M)
        optimizer_step(optimizer, scheduler)
    results.put((rank, time.perf_counter() - started))
    time.sleep(1.0)  # let the last frames drain before the links close


class _Wrapped(nn.Module):
    """A slice with the fixed (all-ones) mask and positions built in: pipelining passes
    only what one stage returns to the next."""

    def __init__(self, stage: StageModel) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[:2], dtype=torch.long)
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return self.stage(x, mask, pos)  # type: ignore[no-any-return]


def torch_rank(rank: int, stages: int, model_dir: str, port: int, steps: int,
               results: Any) -> None:  # fmt: skip
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // stages))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=stages)  # fmt: skip
    stage, trainable = _stage(model_dir, rank, stages)
    optimizer, scheduler = make_optimizer(trainable, _training(steps))
    hidden = stage.config.hidden_size
    example = (
        torch.zeros(MBS, SEQ, dtype=torch.long) if rank == 0 else torch.zeros(MBS, SEQ, hidden)
    )
    pipe = PipelineStage(_Wrapped(stage), rank, stages, torch.device("cpu"), input_args=example)
    items = M * MBS * (SEQ - 1)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Same token-mean as relaytrain: the schedule divides by M (scale_grads), so x M.
        return token_loss_sum(logits, labels) / items * M

    schedule = Schedule1F1B(pipe, n_microbatches=M, loss_fn=loss_fn)
    started = 0.0
    for step in range(steps + 1):
        if step == 1:
            started = time.perf_counter()
        micros = _micros(step)
        ids = torch.cat([mb.input_ids for mb in micros])
        labels = torch.cat([mb.labels for mb in micros])
        if rank == 0:
            schedule.step(ids)
        elif rank == stages - 1:
            schedule.step(target=labels)
        else:
            schedule.step()
        optimizer_step(optimizer, scheduler)
    results.put((rank, time.perf_counter() - started))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target: Any, stages: int, *args: Any) -> float:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, stages, *args, results)) for r in range(stages)]
    for p in procs:
        p.start()
    times = [results.get(timeout=1800)[1] for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    model_dir = str(tiny_model_dir(Path(tempfile.mkdtemp()) / "m", layers=LAYERS, hidden=256,
                                   max_shard_size="2MB"))  # fmt: skip
    tokens = args.steps * M * MBS * SEQ
    files = mint_link_credentials("bench", "pipe", [args.stages], now=datetime.now(UTC))
    pems = [tuple(stage_pem(files, 0, k)) for k in range(args.stages)]
    ours = _spawn(relaytrain_rank, args.stages, model_dir,
                  [_port() for _ in range(args.stages)], args.steps, pems)  # fmt: skip
    theirs = _spawn(torch_rank, args.stages, model_dir, _port(), args.steps)
    print(json.dumps({"stages": args.stages, "relaytrain_tokens_per_s": round(tokens / ours, 1),
                      "torch_pipelining_tokens_per_s": round(tokens / theirs, 1),
                      "ratio": round(theirs / ours, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
