"""The job's output, merged from every stage's part of the final committed checkpoint.

LoRA/QLoRA: `adapter_config.json` + `adapter_model.safetensors` exactly as
`PeftModel.save_pretrained` writes them, with global layer numbers (the slices kept
them), so `PeftModel.from_pretrained(unsplit_base, DIR)` loads it. When periodic sync
merged the pipelines exactly (`sync.loraMerge`), also `lora_fold.safetensors`: per adapted
weight (its name in the model file) what to add to it before the adapter goes on top
(`relaytrain_worker.model.lora_merge`); the adapter alone is then the factors' means.

Full: one safetensors shard per stage plus `model.safetensors.index.json` and the
base model's `config.json`, i.e. a Hugging Face checkpoint that
`AutoModelForCausalLM.from_pretrained(DIR)` loads (a tied weight is stored once).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from relaytrain_contract import StageConfig

from relaytrain_worker.model.lora_merge import FOLD_FILE
from relaytrain_worker.model.methods import TIED_NAME, for_family, lora_config, peft_key
from relaytrain_worker.state.checkpoint import committed_by, load_stage, tensors_from_bytes
from relaytrain_worker.state.store import Store

TRAINABLE_FILE = "trainable.safetensors"


def export_output(
    cfg: StageConfig,
    ckpt: Store,
    job_prefix: str,
    *,
    step: int,
    out: Store,
    model_dir: Path,
) -> list[str]:
    """Write the job's output from committed `step`; returns the object names written.
    Every stage of the split that committed it (whichever pipeline wrote it) is merged by
    parameter name."""
    _, stages = committed_by(ckpt, job_prefix, step)
    files = [load_stage(ckpt, job_prefix, step, k) for k in range(stages)]
    parts = [tensors_from_bytes(f[TRAINABLE_FILE]) for f in files]
    if cfg.method.type == "full":
        return _export_full(parts, out, model_dir)
    folds: dict[str, torch.Tensor] = {}
    for f in files:
        if FOLD_FILE in f:
            folds.update(tensors_from_bytes(f[FOLD_FILE]))
    written = []
    if folds:  # before the adapter: a reader that sees adapter_config.json sees it too
        out.put(FOLD_FILE, safetensors.torch.save(folds, {"format": "pt"}))
        written.append(FOLD_FILE)
    else:  # another run's, which would be added to this adapter (a missing key is fine)
        out.delete(FOLD_FILE)
    return written + _export_adapter(cfg, parts, out, model_dir)


def _export_adapter(
    cfg: StageConfig, parts: list[dict[str, torch.Tensor]], out: Store, model_dir: Path
) -> list[str]:
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.items():
            merged[peft_key(name)] = tensor.contiguous()
    config = lora_config(
        cfg.method.rank, cfg.method.alpha, cfg.method.dropout, cfg.method.target_modules
    )
    # What the stages adapted: the job's names mapped onto the family's modules.
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    config = for_family(config, model_type)
    config.base_model_name_or_path = str(cfg.model.uri)
    doc: dict[str, Any] = config.to_dict()  # type: ignore[no-untyped-call]
    doc = json.loads(json.dumps(doc, default=_jsonable))
    # Written last: a reader that sees adapter_config.json sees a complete adapter.
    out.put("adapter_model.safetensors", safetensors.torch.save(merged, {"format": "pt"}))
    out.put("adapter_config.json", json.dumps(doc, indent=2, sort_keys=True).encode())
    return ["adapter_model.safetensors", "adapter_config.json"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)


def _export_full(parts: list[dict[str, torch.Tensor]], out: Store, model_dir: Path) -> list[str]:
    names = []
    weight_map: dict[str, str] = {}
    total = 0
    seen: set[str] = set()
    for k, part in enumerate(parts):
        shard = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        tensors = {n: t.contiguous() for n, t in part.items() if n not in seen}
        seen.update(tensors)
        out.put(shard, safetensors.torch.save(tensors, {"format": "pt"}))
        names.append(shard)
        for name, tensor in tensors.items():
            weight_map[name] = shard
            total += tensor.numel() * tensor.element_size()
    config = json.loads((model_dir / "config.json").read_text())
    if TIED_NAME in weight_map and "lm_head.weight" not in weight_map:
        config["tie_word_embeddings"] = True
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out.put("config.json", json.dumps(config, indent=2).encode())
    out.put("model.safetensors.index.json", json.dumps(index, indent=2).encode())
    return [*names, "config.json", "model.safetensors.index.json"]


def load_adapter_output(base: Any, directory: str | Path) -> Any:
    """The trained model from a LoRA job's output in `directory` (a local copy): `base`, the
    unsplit model loaded from the job's model files, with what exact merges folded
    (`lora_fold.safetensors`, when there) added to its weights in place, each computed in
    float32 and rounded once as the stages did, and the adapter on top
    (`PeftModel.from_pretrained`)."""
    from peft import PeftModel

    folds = Path(directory) / FOLD_FILE
    if folds.exists():
        with torch.no_grad():
            for name, delta in safetensors.torch.load_file(str(folds)).items():
                weight = base.get_parameter(name)
                weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
    return PeftModel.from_pretrained(base, str(directory))
