"""How a stage process ends, as both sides read it: its exit code and its termination message.

A stage that finds something wrong that no restart can fix (its document, the model, the
data set, the store's answer to its credentials) says so in one line and exits with a code
of its own. The line goes to stderr and to the container's termination message (the file
at the container's `terminationMessagePath`, which the kubelet copies into the pod's
`status.containerStatuses[].state.terminated.message`); the operator reads the code and the
message from there and, for a code in `NON_RETRYABLE`, fails the job at once with that
reason and the stage's own words — as a Job's `podFailurePolicy` rule `FailJob` on exit codes
would — instead of restarting the stage until `failurePolicy.maxStageRestarts` runs out.
`relaytrain run --local` applies the same table to its stage processes.
"""

from __future__ import annotations

from enum import IntEnum


class StageExit(IntEnum):
    """A stage process's exit codes (docs/stage-contract.md, "How a stage ends")."""

    OK = 0
    """Trained to the end (or nothing left to do)."""
    FAILED = 1
    """Anything else: a crash, the store out of reach past its retries. Retried."""
    INVALID_CONFIG = 2
    """The stage document is not valid (a version skew between operator and worker)."""
    INVALID_INPUT = 3
    """The model or the data set cannot be used: missing, empty, malformed, unsupported."""
    LINK_REFUSED = 4
    """A neighbour refused the link credentials, or they cannot be read. Retried: a CA that
    rotated or a neighbour from an older incarnation is set right by a replacement."""
    STORE_REFUSED = 5
    """The object store refused the credentials (bad keys, access denied) or has no such
    bucket: an answer, not an outage, that a retry would repeat."""
    STOPPED = 130
    """Stopped by SIGTERM or Ctrl-C (a pod deleted, `run --local` interrupted)."""


NON_RETRYABLE: dict[int, str] = {
    StageExit.INVALID_CONFIG: "InvalidStageConfig",
    StageExit.INVALID_INPUT: "InvalidInput",
    StageExit.STORE_REFUSED: "StoreAccessDenied",
}
"""Exit codes that end the job at once, with the job condition's reason for each."""

TERMINATION_LOG = "/dev/termination-log"
"""The container's termination message file (Kubernetes' default `terminationMessagePath`)."""
TERMINATION_LOG_ENV = "RELAYTRAIN_TERMINATION_LOG"
"""Overrides where the worker writes its termination message (a kubelet stand-in, a test)."""
MESSAGE_LIMIT = 4096
"""The most bytes of a termination message the kubelet keeps."""


def non_retryable(code: int | None) -> str | None:
    """The job condition's reason when a stage exits with `code` and must not be restarted;
    None when a restart may help (or the code is unknown)."""
    return NON_RETRYABLE.get(code) if code is not None else None
