"""What one reconciliation asks of the cluster (pure values).

`decide.decide` returns them in the order they must happen; `apply.Executor` carries them
out, each idempotently (a create of an existing object, a delete of a gone one, a status
patch that changes nothing: all fine), so a pass cut short by a crash is simply redone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from relaytrain_operator.domain.linkcerts import LinkState, Step
from relaytrain_operator.spec import FineTuneJobStatus

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class PatchStatus:
    """Write the job's status: only the top-level fields that differ from the stored ones."""

    status: FineTuneJobStatus
    """The whole status wanted."""


@dataclass(frozen=True)
class CreateLinkSecret:
    """Create the job's link Secret (kept if it exists: every stage, replacements included,
    shares it; `RenewLinkSecret` keeps it valid)."""

    stage_counts: tuple[int, ...]
    """Stages of each pipeline (one certificate per stage)."""
    lifetime: timedelta
    """How long its certificates are valid."""


@dataclass(frozen=True)
class RenewLinkSecret:
    """Replace the job's link Secret by its next state in a renewal (`linkcerts`)."""

    step: Step
    """The change: one phase of a renewal, or a fresh set."""
    files: Mapping[str, str]
    """The Secret's files as read (decoded)."""
    resource_version: str
    """The version they were read at: a Secret changed since is not overwritten."""
    after: LinkState
    """The state the Secret records after the step."""
    mint: int | None
    """The generation to mint certificates of (trust, reissue); None: nothing to mint."""
    stage_counts: tuple[int, ...]
    """Stages of each pipeline, for what is minted."""
    lifetime: timedelta
    """How long minted certificates are valid."""


@dataclass(frozen=True)
class ExtendLinkSecret:
    """Add certificates for planned stages the job's link Secret lacks (a pipeline added to
    the running job: `linkcerts.mint_link_extension`, `extended_files`)."""

    files: Mapping[str, str]
    """The Secret's files as read (decoded)."""
    resource_version: str
    """The version they were read at: a Secret changed since is not overwritten."""
    annotations: Mapping[str, str]
    """Its annotations as read (the renewal's state: kept)."""
    stages: tuple[tuple[int, int], ...]
    """(pipeline, stage) of each certificate to mint."""
    generation: int
    """The generation of the certificates in use (names the added CA)."""
    not_after: datetime
    """When they expire: the added ones expire with them."""


@dataclass(frozen=True)
class Create:
    """Create a child object (the Service, a stage Pod) built by `builders`."""

    obj: JsonDict
    """The object; an existing one of that name is left as it is."""


@dataclass(frozen=True)
class DeletePod:
    """Delete one stage pod."""

    name: str
    """The pod's name."""
    uid: str | None
    """Only this incarnation: a successor holding the name is never deleted."""
    force: bool = False
    """No grace period: its node is gone or NotReady, no kubelet will confirm."""


@dataclass(frozen=True)
class PostEvent:
    """Post an Event on the job."""

    type: str
    """Normal or Warning."""
    reason: str
    """CamelCase reason, e.g. StageRestarting."""
    message: str
    """What happened, for people."""
    change: str | None = None
    """The `change` it counts under in relaytrain_pipeline_changes_total when its reason
    alone does not say (a pipeline added, not come back); None: `metrics.CHANGES`'."""


@dataclass(frozen=True)
class PatchWorkload:
    """Merge-patch the job's Kueue Workload (its spec.active)."""

    name: str
    """The Workload's name."""
    patch: JsonDict


@dataclass(frozen=True)
class ApplyWorkloadStatus:
    """Server-side apply of the job's Workload status (queueing.release_quota, .finished)."""

    body: JsonDict
    """The applied configuration."""
    manager: str
    """The field manager it is applied as."""


@dataclass(frozen=True)
class PutGivenUp:
    """Write the pipelines given up for good to the job's store (names.GIVEN_UP_FILE), where
    its stages read them: a stage that links again does not wait for theirs."""

    pipelines: tuple[int, ...]
    """Every pipeline given up so far, ascending."""


@dataclass(frozen=True)
class PutFleet:
    """Write the pipelines added to the running job to its store (names.FLEET_FILE), where
    its stages training read them and link to the added stages: before those start."""

    document: JsonDict
    """The document (`stage_config.fleet_document`)."""


@dataclass(frozen=True)
class PutPlan:
    """Name the plan whose stages may write checkpoints in the job's store (names.PLAN_FILE),
    before that plan's stages are created: a stage of a plan it replaced, still running,
    writes no more."""

    document: JsonDict
    """The document (`relaytrain_contract.fence.plan_document`)."""


Action = (
    PatchStatus
    | CreateLinkSecret
    | RenewLinkSecret
    | ExtendLinkSecret
    | Create
    | DeletePod
    | PostEvent
    | PatchWorkload
    | ApplyWorkloadStatus
    | PutGivenUp
    | PutFleet
    | PutPlan
)
