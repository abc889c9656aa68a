"""Where the base model's files are: a local directory, or fetched from S3 into a cache.

From S3 a stage downloads the config, the shard index, the tokenizer files and only
the shards that hold its own tensors (the index says which), never the whole model.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from relaytrain_contract import StageConfig

from relaytrain_worker.model.shards import INDEX_FILE, SINGLE_FILE, ModelLoadError
from relaytrain_worker.state.store import ObjectNotFound, Store

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def stage_shards(weight_map: dict[str, str], cfg: StageConfig, tied: bool) -> set[str]:
    """The shard files holding this stage's tensors (by the layout of HF causal LMs)."""
    st = cfg.stage
    prefixes = [f"model.layers.{i}." for i in range(st.layer_start, st.layer_end)]
    if st.is_first or (st.is_last and tied):
        prefixes.append("model.embed_tokens.")
    if st.is_last:
        prefixes += ["model.norm.", "lm_head."]
    return {shard for name, shard in weight_map.items() if name.startswith(tuple(prefixes))}


def resolve_model_dir(cfg: StageConfig, opener: Callable[[str], Store]) -> Path:
    """A local directory with what this stage needs from `model.uri`."""
    uri = cfg.model.uri
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.is_dir():
            raise ModelLoadError(f"model.uri {uri!r}: no such directory")
        return path
    cache = Path(os.environ.get("RELAYTRAIN_CACHE", Path.home() / ".cache" / "relaytrain"))
    local = cache / "s3-models" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    local.mkdir(parents=True, exist_ok=True)
    store = opener(uri.rstrip("/"))
    for name in SMALL_FILES:
        _fetch(store, name, local, required=name == "config.json")
    if _fetch(store, INDEX_FILE, local, required=False):
        weight_map = json.loads((local / INDEX_FILE).read_text())["weight_map"]
        config = json.loads((local / "config.json").read_text())
        tied = bool(config.get("tie_word_embeddings", False))
        for shard in sorted(stage_shards(weight_map, cfg, tied)):
            _fetch(store, shard, local, required=True)
    else:
        _fetch(store, SINGLE_FILE, local, required=True)
    return local


def _fetch(store: Store, name: str, local: Path, required: bool) -> bool:
    target = local / name
    if target.exists():
        return True
    try:
        data = store.get(name)
    except ObjectNotFound:
        if required:
            raise ModelLoadError(f"model file {name} is missing from {store!r}") from None
        return False
    # Stages on one machine share the cache and may fetch the same shard at once (the
    # first and last stage both need a tied embedding's): each writes its own temporary
    # file, and the atomic rename means a reader only ever sees a whole shard.
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    tmp.write_bytes(data)
    tmp.replace(target)  # atomic: a killed download never looks complete
    return True
