"""Before a stage writes a checkpoint: does the job's store (names.PLAN_FILE) name a later
plan of its job, whose stages replaced it? (relaytrain_contract/fence.py has the why.)"""

from __future__ import annotations

import json
import logging

from relaytrain_contract import PLAN_FILE, StageConfig
from relaytrain_contract.fence import superseded_by

from relaytrain_worker.state.store import ObjectNotFound, Store

log = logging.getLogger("relaytrain.checkpoint")


class SupersededError(Exception):
    """This stage's plan was replaced by another's: it stops, writing nothing more."""


def plan_key(job_prefix: str) -> str:
    return f"{job_prefix.strip('/')}/{PLAN_FILE}" if job_prefix.strip("/") else PLAN_FILE


def check_writer(store: Store, job_prefix: str, cfg: StageConfig, step: int) -> None:
    """Raise SupersededError, before this stage writes checkpoint `step`, when the job's
    store names a later plan of its job. No document (a job whose plan was never replaced),
    another incarnation's, or one naming this plan or an older takes nothing away; nor does
    a bad one, which is logged."""
    try:
        raw = store.get(plan_key(job_prefix))
    except ObjectNotFound:
        return
    try:
        document = json.loads(raw)
        if not isinstance(document, dict):
            raise ValueError(f"not a JSON object: {document!r}")
        reason = superseded_by(document, cfg.job.uid, cfg.job.plan_epoch)
    except ValueError as exc:  # json.JSONDecodeError is one
        log.warning("Could not read %s of %s: %s; writing on", PLAN_FILE, job_prefix, exc)
        return
    if reason is not None:
        raise SupersededError(f"it stops without writing step {step}: {reason}")
