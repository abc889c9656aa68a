"""Safetensors shard bookkeeping: which file holds which tensor, and is the file whole.

safetensors files start with an 8-byte little-endian header length and a JSON header
whose `data_offsets` say where each tensor lies. Checking the file size against the
largest offset catches a truncated download before any tensor is read, with a message
that names the shard (safetensors' own error does not say which file of a sharded
model is at fault).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class ModelLoadError(RuntimeError):
    """The model files cannot give this stage its tensors; the message says why."""


def read_index(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single-file header."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index_path}: not a safetensors index ({exc})") from exc
        return {str(k): str(v) for k, v in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(read_header(single), SINGLE_FILE)
    raise ModelLoadError(f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")


def read_header(path: Path) -> dict[str, dict[str, object]]:
    """The tensor entries of a safetensors file's JSON header (metadata dropped)."""
    if not path.is_file():
        raise ModelLoadError(f"model shard {path.name} is missing (expected at {path})")
    with path.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"model shard {path.name} is truncated: {len(raw)} bytes")
        (length,) = struct.unpack("<Q", raw)
        header = handle.read(length)
    if len(header) < length:
        raise ModelLoadError(
            f"model shard {path.name} is truncated inside its header "
            f"({len(header)} of {length} header bytes)"
        )
    try:
        entries = json.loads(header)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"model shard {path.name} has a corrupt header: {exc}") from exc
    entries.pop("__metadata__", None)
    return {str(k): v for k, v in entries.items()}


def check_shard(path: Path) -> None:
    """Raise ModelLoadError unless `path` exists and holds every byte its header promises."""
    entries = read_header(path)
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
    ends = [int(entry["data_offsets"][1]) for entry in entries.values()]  # type: ignore[index]
    needed = 8 + length + max(ends, default=0)
    actual = path.stat().st_size
    if actual < needed:
        raise ModelLoadError(
            f"model shard {path.name} is truncated: {actual} bytes on disk, its header "
            f"needs {needed} (re-download or re-convert the model)"
        )
