"""One reconciliation of one FineTuneJob as a pure decision: observed state → actions.

`decide(observed, settings)` reads only what it is given — the job as stored (spec and
status), its stage pods, the nodes, and when needed the cluster's GPU pods, the model's
config.json and the workers' progress — and returns the actions that bring the cluster to
what the job asks for, in order, and the job's new status (a typed `FineTuneJobStatus`).
`needs(job, pods)` says which of the costly inputs a pass needs, so the observer reads
them only then. Nothing here talks to the API server or the store; `apply.Executor`
applies the actions and `runner` ties observing, deciding and applying together.

Because every input comes from the cluster, an operator restarted at any point decides
the same again: pod names are fixed per stage (a second create is refused), the plan and
`startTime` are written before the first pod, and a failure is counted in status before
its pod is deleted (see recovery.py), so nothing is counted twice or lost.

By concern: flow.py (the branches of a pass, in order, and `needs`), context.py (the
types, and the pass that accumulates actions and status), admission.py (the first plan,
and Kueue), stages.py (per stage keep, create, replace or wait), create.py (the stage
pods: back-off, placement, what each pod holds), progress.py (progress, and how a job ends).
"""

from relaytrain_operator.loop.decide.admission import workloads_of
from relaytrain_operator.loop.decide.context import (
    WAITING_ANNOTATION,
    Decision,
    InputProblem,
    ModelConfig,
    Needs,
    Observed,
    Settings,
    parse_spec,
    stage_pods,
)
from relaytrain_operator.loop.decide.flow import decide, needs

__all__ = [
    "WAITING_ANNOTATION",
    "Decision",
    "InputProblem",
    "ModelConfig",
    "Needs",
    "Observed",
    "Settings",
    "decide",
    "needs",
    "parse_spec",
    "stage_pods",
    "workloads_of",
]
