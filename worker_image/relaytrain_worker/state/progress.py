"""The progress record the operator reads: ``<job_prefix>/progress.json`` (docs/stage-contract.md).

The last stage rewrites it after every optimizer step (an atomic put, so the operator never
reads half of one). The record itself is the contract's `Progress`.
"""

from __future__ import annotations

from relaytrain_contract import PROGRESS_FILE, Progress

from relaytrain_worker.state.store import ObjectNotFound, Store

__all__ = ["Progress", "progress_key", "read_progress", "write_progress"]


def progress_key(job_prefix: str) -> str:
    return f"{job_prefix.strip('/')}/{PROGRESS_FILE}" if job_prefix.strip("/") else PROGRESS_FILE


def write_progress(
    store: Store, job_prefix: str, progress: Progress, *, unless_behind: bool = False
) -> bool:
    """Write ``progress.json`` atomically (stamped with the time of writing if unstamped);
    whether it was written. With `unless_behind` the record there is read first and kept
    when it says the job is done or further on: another pipeline may be writing it (two
    pipelines cut apart each take themselves for the writer), and progress never goes back."""
    if unless_behind:
        there = read_progress(store, job_prefix)
        if there is not None and (there.done or there.step > progress.step):
            return False
    store.put(progress_key(job_prefix), progress.stamped().to_json())
    return True


def read_progress(store: Store, job_prefix: str) -> Progress | None:
    """The current progress, or None if none was written yet."""
    try:
        raw = store.get(progress_key(job_prefix))
    except ObjectNotFound:
        return None
    return Progress.from_json(raw)
