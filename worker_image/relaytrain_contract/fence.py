"""names.PLAN_FILE: which of a job's plans may write its checkpoints. Both sides use this
module: the operator writes the document before it creates the stages of a plan that
replaced every stage; a stage reads it before each checkpoint it would write and stops,
writing nothing, when it names a later plan of the same job.

Why a document in the store rather than the cluster alone: a stage's pod deleted is not its
process ended. A node cut off from its control plane runs its pods on until it is back, and
a process can outlive its pod's SIGTERM (relaytrain_worker/stopping.py bounds that). Such a
stage of a replaced plan would go on committing steps ahead of its replacement, whose
pipelines would then lose every write and restore its commits, again and again. The store
is what every writer already reads; a stage checks it with one small read per checkpoint.

Only the same incarnation of the job (its UID) decides: a document left by a job of the
same name deleted and created again over the same store, or by a cluster's run when
`relaytrain run --local` uses the store, takes nothing away — a stage never stops on a
document that its own operator may have had no chance to write over."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def plan_document(uid: str, epoch: int) -> dict[str, Any]:
    """names.PLAN_FILE for the stages of job incarnation `uid` (its UID) and plan `epoch`
    (`JobRef.plan_epoch`)."""
    return {"uid": uid, "epoch": epoch}


def superseded_by(document: Mapping[str, Any], uid: str, epoch: int) -> str | None:
    """Why a stage of job incarnation `uid` and plan `epoch` must not write, `document`
    (names.PLAN_FILE as read) naming the job's writers; None when it may write: the
    document names its plan or an older one (the operator has not written the newest yet),
    or another incarnation's. ValueError when `document` is not one."""
    theirs, newest = document.get("uid"), document.get("epoch")
    if not isinstance(theirs, str) or not isinstance(newest, int) or isinstance(newest, bool):
        raise ValueError(f'not {{"uid": "<job uid>", "epoch": N}}: {dict(document)!r}')
    if theirs != uid or newest <= epoch:
        return None
    return f"every stage of the job was replaced by plan {newest}'s (this stage is of plan {epoch})"
