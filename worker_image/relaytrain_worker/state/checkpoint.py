"""Committed, checksummed, pruned checkpoints of a pipeline (layout of DESIGN.md).

Layout under ``<job_prefix>`` in a Store::

    step-<N>/stage-<k>/<files>          each stage's own state (adapter, optimizer, RNG, data)
    step-<N>/stage-<k>/files.json       that stage's listing (name, size, sha256), written last
    step-<N>/p<w>/stage-<k>/...         the same, saved by pipeline w > 0 (the writer while
                                        the pipelines below it are out; its split may differ)
    step-<N>/manifest.json              the commit: the writing pipeline and every stage's
                                        files with checksums, written last of all by one
                                        coordinator; it carries the sha256 of its own body

Rules this module enforces:
- A step counts only when its manifest exists, parses and its body checksum verifies;
  ``latest_committed`` skips anything else, so a partial or corrupt checkpoint is never
  restored and the last good one is.
- ``load_stage`` re-checks every file's size and sha256 and raises CorruptCheckpoint naming
  the file that is wrong.
- Nothing committed is overwritten: saving into a committed step is an error (a pipeline that
  finds its step committed by another has lost a split-brain race and leaves). Pruning
  deletes a step's manifest before its files, so a half-deleted step is never "committed".
- ``prune`` deletes only steps older than the newest commit, keeps the newest ``keep``
  commits, and never touches steps newer than the newest commit (they may be in flight).

Helpers at the end turn what goes into the files into bytes: tensors and optimizer state
via safetensors, RNG states, small things via JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import numpy as np
import safetensors.torch
import torch

from relaytrain_worker.state.store import ObjectNotFound, Store

log = logging.getLogger("relaytrain.checkpoint")

FORMAT = "relaytrain-checkpoint/v1"
MANIFEST = "manifest.json"
FILES = "files.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read as asked."""


class CorruptCheckpoint(CheckpointError):  # noqa: N818 - name of the worker interface
    """A checkpoint exists but does not verify; the message names the object at fault."""


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def step_key(job_prefix: str, step: int) -> str:
    """``<job_prefix>/step-<N>``."""
    return _join(job_prefix, f"step-{step}")


def stage_key(job_prefix: str, step: int, stage: int, pipeline: int = 0) -> str:
    """``<job_prefix>/step-<N>/stage-<k>``, or ``.../step-<N>/p<w>/stage-<k>`` for the files
    pipeline w > 0 saved."""
    where = f"p{pipeline}/stage-{stage}" if pipeline else f"stage-{stage}"
    return _join(step_key(job_prefix, step), where)


def manifest_key(job_prefix: str, step: int) -> str:
    """``<job_prefix>/step-<N>/manifest.json``."""
    return _join(step_key(job_prefix, step), MANIFEST)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def save_stage(
    store: Store,
    job_prefix: str,
    step: int,
    stage: int,
    files: Mapping[str, bytes],
    *,
    pipeline: int = 0,
) -> dict[str, dict[str, Any]]:
    """Write one stage's files for ``step`` (of ``pipeline``, the writer), then its
    ``files.json``. Returns the listing.

    Raises CheckpointError if ``step`` is already committed (nothing is overwritten), or if
    a later step is: a writer the job went on without (a pipeline cut off from the others)
    must not commit behind the job's newest checkpoint, where the step it writes may have
    been committed and pruned already (a rollback removes the later steps first).
    """
    if store.exists(manifest_key(job_prefix, step)):
        raise CheckpointError(
            f"step {step} of {job_prefix!r} is already committed; committed checkpoints are "
            "never overwritten (discard_after() the restore point first)"
        )
    for later in reversed(list_steps(store, job_prefix)):
        if later <= step:
            break
        if store.exists(manifest_key(job_prefix, later)):
            raise CheckpointError(
                f"step {later} of {job_prefix!r} is already committed, after step {step}: "
                "nothing is committed behind the newest checkpoint"
            )
    base = stage_key(job_prefix, step, stage, pipeline)
    # A listing left by an earlier attempt at this step must not be committed with the new
    # files, so it goes before any file is rewritten.
    store.delete(_join(base, FILES))
    listing: dict[str, dict[str, Any]] = {}
    for name, data in files.items():
        if name == FILES or not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"invalid checkpoint file name {name!r}")
        store.put(_join(base, name), data)
        listing[name] = {"size": len(data), "sha256": _sha256(data)}
    doc = {
        "format": FORMAT, "step": step, "stage": stage, "pipeline": pipeline,
        "files": listing, "createdAt": _now(),
    }  # fmt: skip
    store.put(_join(base, FILES), _canonical(doc))
    return listing


def try_commit(
    store: Store, job_prefix: str, step: int, num_stages: int, *, pipeline: int = 0
) -> bool:
    """Commit ``step`` if every stage of ``pipeline`` (the writer) has its ``files.json``
    there; True once it is committed (by this pipeline or, after a split brain, another).

    Run by one coordinator (e.g. the last stage). Idempotent.
    """
    key = manifest_key(job_prefix, step)
    if store.exists(key):
        read_manifest(store, job_prefix, step)
        return True
    stages: dict[str, Any] = {}
    for k in range(num_stages):
        files_key = _join(stage_key(job_prefix, step, k, pipeline), FILES)
        try:
            raw = store.get(files_key)
        except ObjectNotFound:
            return False
        try:
            doc = json.loads(raw)
            files = doc["files"]
            if (doc["step"], doc["stage"], doc.get("pipeline", 0)) != (step, k, pipeline):
                raise ValueError(
                    f"listing is for step {doc['step']} stage {doc['stage']} pipeline "
                    f"{doc.get('pipeline', 0)}"
                )
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpoint(f"{files_key} is not a valid stage listing: {e}") from e
        stages[str(k)] = {"files": files}
    body = {
        "format": FORMAT, "step": step, "pipeline": pipeline, "numStages": num_stages,
        "stages": stages, "committedAt": _now(),
    }  # fmt: skip
    store.put(key, _canonical({"body": body, "sha256": _sha256(_canonical(body))}))
    log.info(
        "Committed checkpoint step %d of %s (pipeline %d, %d stages)",
        step, job_prefix, pipeline, num_stages,
    )  # fmt: skip
    return True


def read_manifest(store: Store, job_prefix: str, step: int) -> dict[str, Any]:
    """The verified manifest body of ``step``.

    CheckpointError if the step is not committed; CorruptCheckpoint if its manifest does not
    parse or its checksum does not match.
    """
    key = manifest_key(job_prefix, step)
    try:
        raw = store.get(key)
    except ObjectNotFound:
        raise CheckpointError(f"step {step} is not committed ({key} does not exist)") from None
    try:
        doc = json.loads(raw)
        body = doc["body"]
        ok = doc["sha256"] == _sha256(_canonical(body))
        if ok and (body["format"] != FORMAT or body["step"] != step):
            raise ValueError(f"manifest is for step {body['step']} format {body['format']}")
        if ok and len(body["stages"]) != body["numStages"]:
            raise ValueError("manifest does not list every stage")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"manifest {key} is corrupt: {e}") from e
    if not ok:
        raise CorruptCheckpoint(f"manifest {key} is corrupt: its checksum does not match")
    return dict(body)


def committed_by(store: Store, job_prefix: str, step: int) -> tuple[int, int]:
    """(pipeline, number of stages) that committed ``step``: whose split its files are in
    (a manifest without a pipeline is pipeline 0's)."""
    body = read_manifest(store, job_prefix, step)
    return int(body.get("pipeline", 0)), int(body["numStages"])


def list_steps(store: Store, job_prefix: str) -> list[int]:
    """Every step that has anything stored (committed or not), ascending."""
    base = _join(job_prefix)
    start = len(base) + 1 if base else 0
    steps = set()
    for key in store.list(_join(job_prefix, "step-")):
        match = _STEP_DIR.match(key[start:].split("/", 1)[0])
        if match:
            steps.add(int(match.group(1)))
    return sorted(steps)


def committed_steps(store: Store, job_prefix: str) -> list[int]:
    """Steps whose manifest exists and verifies (files not re-read), ascending."""
    good = []
    for step in list_steps(store, job_prefix):
        try:
            read_manifest(store, job_prefix, step)
        except CorruptCheckpoint as e:
            log.warning("Skipped checkpoint step %d: %s", step, e)
            continue
        except CheckpointError:
            continue
        good.append(step)
    return good


def verify_step(store: Store, job_prefix: str, step: int) -> None:
    """Re-read every file of every stage of ``step``; CorruptCheckpoint names the first bad one."""
    for stage in range(read_manifest(store, job_prefix, step)["numStages"]):
        load_stage(store, job_prefix, step, stage)


def latest_committed(
    store: Store, job_prefix: str, verify_files: bool = False, at_most: int | None = None
) -> int | None:
    """The newest committed step (no newer than ``at_most``) that verifies, or None.

    With ``verify_files`` every file of every stage is re-read and checked, so all stages
    that call this on the same store agree on a step whose data is intact.
    """
    for step in reversed(committed_steps(store, job_prefix)):
        if at_most is not None and step > at_most:
            continue
        if not verify_files:
            return step
        try:
            verify_step(store, job_prefix, step)
        except CheckpointError as e:
            log.warning("Skipped checkpoint step %d: %s", step, e)
            continue
        return step
    return None


def load_stage(store: Store, job_prefix: str, step: int, stage: int) -> dict[str, bytes]:
    """The files of ``stage`` at committed ``step``, each verified against the manifest."""
    body = read_manifest(store, job_prefix, step)
    entry = body["stages"].get(str(stage))
    if entry is None:
        raise CorruptCheckpoint(f"manifest of step {step} has no stage {stage}")
    base = stage_key(job_prefix, step, stage, int(body.get("pipeline", 0)))
    out = {}
    for name, meta in entry["files"].items():
        key = _join(base, name)
        try:
            data = store.get(key)
        except ObjectNotFound:
            raise CorruptCheckpoint(f"checkpoint file {key} is missing") from None
        if len(data) != meta["size"] or _sha256(data) != meta["sha256"]:
            raise CorruptCheckpoint(
                f"checkpoint file {key} is corrupt: {len(data)} bytes with sha256 "
                f"{_sha256(data)[:12]}…, manifest says {meta['size']} bytes {meta['sha256'][:12]}…"
            )
        out[name] = data
    return out


def matches_commit(
    store: Store,
    job_prefix: str,
    step: int,
    stage: int,
    files: Mapping[str, bytes],
    *,
    pipeline: int = 0,
) -> bool:
    """Whether an in-memory copy of a stage's files (of ``pipeline``) is exactly what
    ``step`` committed.

    Lets a surviving stage roll back from the copy it kept when it saved, without
    downloading its own files again (only the small manifest is read).
    """
    body = read_manifest(store, job_prefix, step)
    entry = body["stages"].get(str(stage))
    if (
        int(body.get("pipeline", 0)) != pipeline
        or entry is None
        or set(entry["files"]) != set(files)
    ):
        return False
    return all(
        len(files[name]) == meta["size"] and _sha256(files[name]) == meta["sha256"]
        for name, meta in entry["files"].items()
    )


def _delete_step(store: Store, job_prefix: str, step: int) -> None:
    store.delete(manifest_key(job_prefix, step))  # uncommit first
    for key in store.list(step_key(job_prefix, step) + "/"):
        store.delete(key)


def prune(store: Store, job_prefix: str, keep: int) -> list[int]:
    """Delete steps older than the newest commit, except the newest ``keep`` commits.

    Steps newer than the newest commit (in flight) are never touched. Returns what was deleted.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    committed = committed_steps(store, job_prefix)
    if not committed:
        return []
    kept = set(committed[-keep:])
    doomed = [s for s in list_steps(store, job_prefix) if s < committed[-1] and s not in kept]
    for step in doomed:
        _delete_step(store, job_prefix, step)
    if doomed:
        log.info("Pruned checkpoint steps %s of %s", doomed, job_prefix)
    return doomed


def discard_after(store: Store, job_prefix: str, step: int | None) -> list[int]:
    """Delete every step newer than ``step`` (None: all), committed or not.

    For recovery: once every stage rolls back to ``step``, later steps (partial, or committed
    but found corrupt) must go so that the rerun can write them afresh.
    """
    doomed = [s for s in list_steps(store, job_prefix) if step is None or s > step]
    for s in doomed:
        _delete_step(store, job_prefix, s)
    return doomed


# -- what goes into the files ---------------------------------------------------------


def tensors_to_bytes(
    tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> bytes:
    """A dict of tensors as safetensors bytes (moved to CPU; shared storage is copied apart)."""
    seen: set[int] = set()
    flat = {}
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()  # safetensors refuses tensors sharing memory (e.g. tied weights)
        seen.add(ptr)
        flat[name] = t
    return safetensors.torch.save(flat, metadata=metadata)


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """The inverse of ``tensors_to_bytes`` (CPU tensors)."""
    return safetensors.torch.load(data)


def json_to_bytes(obj: Any) -> bytes:
    """Small JSON state (data position, step, config echo) as bytes."""
    return json.dumps(obj, sort_keys=True, indent=1).encode()


def json_from_bytes(data: bytes) -> Any:
    return json.loads(data)


def optimizer_to_bytes(state_dict: Mapping[str, Any]) -> bytes:
    """A torch optimizer ``state_dict()`` as safetensors: tensors as ``state/<id>/<name>``,
    everything else (param_groups, scalar state) as JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, per_param in state_dict["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{pid}/{name}"] = value
            else:
                scalars.setdefault(str(pid), {})[name] = value
    meta = {
        "param_groups": json.dumps(state_dict["param_groups"]),
        "scalars": json.dumps(scalars),
    }
    return tensors_to_bytes(tensors, metadata=meta)


def optimizer_from_bytes(data: bytes) -> dict[str, Any]:
    """The inverse of ``optimizer_to_bytes``: a dict for ``optimizer.load_state_dict``."""
    with safe_open_bytes(data) as (tensors, meta):
        state: dict[int, dict[str, Any]] = {}
        for key, t in tensors.items():
            _, pid, name = key.split("/", 2)
            state.setdefault(int(pid), {})[name] = t
        for pid, values in json.loads(meta["scalars"]).items():
            state.setdefault(int(pid), {}).update(values)
        return {"state": state, "param_groups": json.loads(meta["param_groups"])}


class safe_open_bytes:  # noqa: N801 - used like a function
    """Read tensors and metadata from safetensors bytes."""

    def __init__(self, data: bytes) -> None:
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        self.meta: dict[str, str] = header.get("__metadata__") or {}
        self.tensors = safetensors.torch.load(data)

    def __enter__(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return self.tensors, self.meta

    def __exit__(self, *_: object) -> None:
        return None


def rng_to_bytes() -> bytes:
    """This process's RNG states (torch CPU and CUDA, Python ``random``, NumPy) as bytes."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda/{i}"] = s
    py_version, py_state, py_gauss = random.getstate()
    tensors["python"] = torch.tensor(py_state, dtype=torch.int64)
    np_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    tensors["numpy"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    meta = {
        "python": json.dumps([py_version, py_gauss]),
        "numpy": json.dumps([np_name, int(np_pos), int(np_has_gauss), float(np_gauss)]),
    }
    return tensors_to_bytes(tensors, metadata=meta)


def restore_rng(data: bytes) -> None:
    """Set this process's RNG states from ``rng_to_bytes`` output."""
    with safe_open_bytes(data) as (tensors, meta):
        torch.set_rng_state(tensors["torch_cpu"])
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda/")]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        py_version, py_gauss = json.loads(meta["python"])
        random.setstate((py_version, tuple(int(v) for v in tensors["python"].tolist()), py_gauss))
        np_name, np_pos, np_has_gauss, np_gauss = json.loads(meta["numpy"])
        keys = tensors["numpy"].numpy().astype(np.uint32)
        np.random.set_state((np_name, keys, np_pos, np_has_gauss, np_gauss))
