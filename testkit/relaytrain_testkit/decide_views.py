"""Views of a `Decision` that the decision's tests share (the job, nodes and pods they
decide on are relaytrain_testkit.decide_cases'): the actions as one word each, the Ready
reason, an object created, the status patches; and a progress.json as the workers fold it.
"""

from __future__ import annotations

from typing import Any

from relaytrain_operator.domain.progress import Progress
from relaytrain_operator.domain.status import READY, condition
from relaytrain_operator.loop.actions import (
    Create,
    CreateLinkSecret,
    DeletePod,
    PatchStatus,
    PostEvent,
    PutGivenUp,
    PutPlan,
)
from relaytrain_operator.loop.decide import Decision
from relaytrain_operator.spec import FineTuneJobStatus

from relaytrain_testkit.decide_cases import pod

RUNNING = [pod(0), pod(1)]
"""Both stages' pods, Running on their planned nodes."""


def summary(decision: Decision) -> list[str]:
    """The actions in order, one short word each."""
    out = []
    for a in decision.actions:
        if isinstance(a, PatchStatus):
            out.append("patch")
        elif isinstance(a, CreateLinkSecret):
            out.append("secret")
        elif isinstance(a, Create):
            out.append(f"create:{a.obj['metadata']['name']}")
        elif isinstance(a, DeletePod):
            out.append(f"delete:{a.name}" + ("!" if a.force else ""))
        elif isinstance(a, PutGivenUp):
            out.append(f"given-up:{','.join(map(str, a.pipelines))}")
        elif isinstance(a, PutPlan):
            out.append(f"plan:{a.document['epoch']}")
        else:
            assert isinstance(a, PostEvent)
            out.append(f"event:{a.reason}")
    return out


def ready_reason(decision: Decision) -> str | None:
    assert decision.status is not None
    ready = condition(decision.status, READY)
    return ready.reason if ready else None


def created(decision: Decision, name: str) -> dict[str, Any]:
    return next(
        a.obj
        for a in decision.actions
        if isinstance(a, Create) and a.obj["metadata"]["name"] == name
    )


def patches(decision: Decision) -> list[FineTuneJobStatus]:
    return [a.status for a in decision.actions if isinstance(a, PatchStatus)]


def progress(step: int, committed: int | None = None, **extra: Any) -> Progress:
    status: dict[str, Any] = {"step": step, "totalSteps": 100, "stepOfTotal": f"{step}/100"}
    if committed is not None:
        status["lastCommittedStep"] = committed
    return Progress(status=status, done=extra.get("done", False), output=extra.get("output"))
