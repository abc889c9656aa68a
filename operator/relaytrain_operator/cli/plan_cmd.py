"""`relaytrain plan JOB.yaml --nodes NODES.yaml`: show how a FineTuneJob would be split.

Reads the job (validated by ``relaytrain_operator.spec.parse_job``), the model's
architecture (its config.json: ``--model-config``, else ``spec.model.uri`` when it can be
read from here, else a config shipped for the model the URI names; see
``relaytrain_operator.store.model_config``), and the GPU pools (``--nodes``: a NodeList or
hack/pools.yaml; ``--kubeconfig``: the live cluster's nodes, minus GPUs that pods already
hold). Prints a table, or with ``--json`` the plan as a JSON object; both say where the
architecture came from. The job's ``spec.pipeline.replicas`` (default 1, the one pipeline
the operator deploys) says how many pipelines to plan; ``--replicas`` overrides it (``auto``
plans as many as make the step fastest, one included); ``--sync`` says how they keep their
weights equal. ``--join NODES`` also shows what the job would do once those nodes joined
it while it runs: the pipelines it would add, its running ones kept
(``planner.plan_growth``), and whether that pays; ``--leave NODE,...`` what it would do
if those nodes of the fleet left (``membership.if_left``). Exit status: 0 planned, 1 the
job does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from relaytrain_operator import cli
from relaytrain_operator.cli.plan_format import (
    format_if_left,
    format_table,
    if_left_dict,
    measured,
)
from relaytrain_operator.domain.membership import if_left
from relaytrain_operator.domain.placement import file_pools, job_pools
from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    OUTER_CODES,
    SYNC_MODES,
    Catalog,
    FleetPlan,
    Growth,
    LoraTargetError,
    ModelShape,
    ModelShapeError,
    Plan,
    PlanError,
    Pool,
    PoolError,
    Sync,
    TrainingShape,
    UnknownGpuError,
    choose_compression,
    plan,
    plan_fleet,
    plan_forwards_ahead,
    plan_growth,
)
from relaytrain_operator.domain.planning import job_sync
from relaytrain_operator.store.model_config import ModelConfigError, Resolved, resolve

if TYPE_CHECKING:
    from relaytrain_operator.spec import FineTuneJob

EXIT_INFEASIBLE = 1
EXIT_BAD_INPUT = 2


class InputError(Exception):
    """Input the command cannot use; the message says which and why."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `plan` on the `relaytrain` subcommand parsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "plan",
        help="show the stage plan for a FineTuneJob on a set of GPU nodes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("job", type=Path, help="FineTuneJob manifest (YAML)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--nodes", type=Path, help="nodes file: NodeList/List YAML or JSON, or hack/pools.yaml"
    )
    source.add_argument("--kubeconfig", type=Path, help="read the live nodes of this cluster")
    parser.add_argument("--catalog", type=Path, help="GPU catalog overrides (YAML or JSON)")
    parser.add_argument(
        "--model-config",
        type=Path,
        help="the model's config.json (default: read spec.model.uri, else a shipped config "
        "for the model it names)",
    )
    parser.add_argument(
        "--default-link",
        metavar="MBPS,MS",
        help="link to assume for nodes without link annotations, e.g. 1000,10",
    )
    parser.add_argument(
        "--replicas",
        type=cli.replicas,
        default=None,
        metavar="auto|N",
        help="pipelines that train together on one global batch: auto (as many as make the "
        "step fastest, one included) or a number; default: the job's "
        "spec.pipeline.replicas (1 unless it says otherwise)",
    )
    parser.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default=None,
        help="how several pipelines keep their weights equal: synchronous (reduce gradients "
        "every step) or periodic (every --sync-every steps); default: the job's "
        "spec.pipeline.sync (synchronous unless it says otherwise)",
    )
    parser.add_argument(
        "--sync-every",
        type=cli.positive_int,
        metavar="H",
        help="steps between synchronisations with --sync periodic; default: the job's "
        "spec.pipeline.sync.everySteps",
    )
    parser.add_argument(
        "--outer-code",
        choices=OUTER_CODES,
        help="what a periodic outer step sends: float64 weights or an int4/int2/int1 code of "
        "each pipeline's update; default: the job's spec.pipeline.sync.outerCode",
    )
    parser.add_argument(
        "--join",
        type=Path,
        metavar="NODES",
        help="nodes file of GPUs that join once the job runs: also show which pipelines the "
        "job would add on them (its running pipelines kept) and whether that pays",
    )
    parser.add_argument(
        "--leave",
        metavar="NODE[,NODE...]",
        help="nodes of the fleet (by name) that leave once the job runs: also show what the "
        "job would do (a stage moved, or pipelines leaving at a step boundary and coming "
        "back where they fit) and its tokens/s before and after",
    )
    parser.add_argument(
        "--steps-left",
        type=cli.positive_int,
        metavar="N",
        help="with --join: steps the job has left when they join (default: its "
        "spec.training.steps)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def _sync(args: argparse.Namespace, job: Sync) -> Sync:
    """The command line's --sync/--sync-every over the job's spec.pipeline.sync."""
    if (args.sync or job.mode) == "periodic":
        periodic = job.mode == "periodic"
        every = args.sync_every or (job.every if periodic else None)
        if every is None:
            raise InputError(
                "--sync periodic needs --sync-every H (steps between synchronisations)"
            )
        code = args.outer_code or (job.code if periodic else "float64")
        return Sync("periodic", every, code, job.exact)
    if args.outer_code not in (None, "float64"):
        raise InputError(f"--outer-code {args.outer_code} needs --sync periodic (outer steps)")
    if args.sync_every is not None:
        raise InputError(
            f"--sync-every {args.sync_every} needs --sync periodic; synchronous pipelines "
            "synchronise every step"
        )
    return Sync()


def _load(path: Path, what: str) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise InputError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise InputError(f"{what} {str(path)!r} is not YAML/JSON: {err}") from None
    if len(docs) != 1:
        raise InputError(f"{what} {str(path)!r} must hold one document, found {len(docs)}")
    return docs[0]


def _live_nodes(
    kubeconfig: Path, job: FineTuneJob, default_link: Any
) -> tuple[list[Pool], list[Any]]:
    # Imported here: `relaytrain plan --nodes` must work without the kubernetes client.
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    core = client.CoreV1Api(api)
    nodes = api.sanitize_for_serialization(core.list_node())["items"]
    pods = api.sanitize_for_serialization(core.list_pod_for_all_namespaces())["items"]
    return job_pools(job, nodes, pods, default_link=default_link), nodes


def _node_items(doc: Any) -> list[Any] | None:
    """The nodes of a nodes file (a NodeList or List, a list, or one Node); None for a pools
    file, which names no nodes."""
    if isinstance(doc, dict) and isinstance(doc.get("items"), list):
        return list(doc["items"])
    if isinstance(doc, dict) and doc.get("kind") == "Node":
        return [doc]
    return list(doc) if isinstance(doc, list) else None


def _leaving(
    job: FineTuneJob, names: str, nodes: list[Any] | None, default_link: Any
) -> list[Pool]:
    """The pools of --leave's nodes, each with the GPUs it would lose."""
    if nodes is None:
        raise InputError(
            "--leave names nodes, but --nodes is a pools file without node names: give a "
            "NodeList (or --kubeconfig)"
        )
    wanted = [n for n in names.split(",") if n]
    have = {(n.get("metadata") or {}).get("name"): n for n in nodes if isinstance(n, dict)}
    unknown = [n for n in wanted if n not in have]
    if unknown or not wanted:
        raise InputError(
            f"--leave {names!r}: no node named {', '.join(unknown) or '(none given)'} in the "
            f"fleet; its nodes: {', '.join(sorted(str(k) for k in have))}"
        )
    try:
        return file_pools(job, {"items": [have[n] for n in wanted]}, default_link=default_link)
    except PlanError:
        return []  # none of them is one the job may use: their leaving changes nothing


def _default_link(raw: str | None) -> tuple[float, float] | None:
    if raw is None:
        return None
    try:
        mbps, ms = (float(x) for x in raw.split(","))
    except ValueError:
        raise InputError(f"--default-link must be MBPS,MS (e.g. 1000,10), got {raw!r}") from None
    if mbps <= 0 or ms < 0:
        raise InputError(f"--default-link needs bandwidth > 0 and latency >= 0, got {raw!r}")
    return mbps, ms


@dataclass(frozen=True)
class _Inputs:
    """What `plan` needs, read from the command line's files."""

    name: str
    model: ModelShape
    model_source: Resolved
    training: TrainingShape
    pools: list[Pool]
    catalog: Catalog
    stages: int | None
    replicas: int | Literal["auto"]
    """The job's spec.pipeline.replicas."""
    sync: Sync
    """The job's spec.pipeline.sync."""
    joining: list[Pool]
    """The pools of --join's nodes (empty without it)."""
    leaving: list[Pool]
    """The pools of --leave's nodes, with the GPUs that leave (empty without it)."""
    steps: int | None
    """The job's spec.training.steps (None: it counts epochs)."""
    auto: bool
    """Whether the job's spec.pipeline.compression is `auto` (the planner chooses)."""
    auto_ahead: bool
    """Whether its spec.pipeline.forwardsAhead is `auto` (the planner chooses)."""


def _inputs(args: argparse.Namespace) -> _Inputs:
    """Read and check the job, the model config, the pools and the catalog."""
    from relaytrain_operator.domain.planning import training_shape
    from relaytrain_operator.spec import SpecError, parse_job

    manifest = _load(args.job, "job")
    try:
        job = parse_job(manifest, default_checkpoint_uri="checkpoints")
    except SpecError as err:
        raise InputError(f"job {str(args.job)!r}: {err}") from None
    spec = job.spec
    try:
        source = resolve(
            spec.model.uri,
            model_config=args.model_config,
            endpoint=spec.checkpoint.endpoint,
            environ=os.environ,
        )
    except ModelConfigError as err:
        raise InputError(str(err)) from None
    model = ModelShape.from_hf_config(source.config)
    training = training_shape(job)
    default_link = _default_link(args.default_link)
    # Which nodes the job may use, and what is free there: the operator's own rules.
    if args.nodes is not None:
        doc = _load(args.nodes, "nodes file")
        pools = file_pools(job, doc, default_link=default_link)
        nodes = _node_items(doc)
    else:
        pools, nodes = _live_nodes(args.kubeconfig, job, default_link)
    leaving = [] if args.leave is None else _leaving(job, args.leave, nodes, default_link)
    catalog: Catalog = DEFAULT_CATALOG
    if args.catalog is not None:
        catalog = DEFAULT_CATALOG.with_overrides(_load(args.catalog, "catalog"))
    joining = []
    if args.join is not None:
        try:
            joining = file_pools(
                job, _load(args.join, "--join nodes file"), default_link=default_link
            )
        except PlanError as err:
            raise InputError(f"--join {str(args.join)!r}: {err}") from None
    stages = spec.pipeline.stages
    return _Inputs(
        job.metadata.name,
        model,
        source,
        training,
        pools,
        catalog,
        None if stages == "auto" else int(stages),
        spec.pipeline.replicas,
        job_sync(job),
        joining,
        leaving,
        spec.training.steps,
        spec.pipeline.compression == "auto",
        spec.pipeline.forwards_ahead == "auto",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of `relaytrain plan`."""
    try:
        inputs = _inputs(args)
        sync = _sync(args, inputs.sync)
        replicas = inputs.replicas if args.replicas is None else args.replicas

        def plan_with(training: TrainingShape) -> Plan | FleetPlan:
            if replicas == 1:
                return plan(
                    inputs.model, training, inputs.pools, inputs.catalog, stages=inputs.stages
                )
            fleet = plan_fleet(
                inputs.model, training, inputs.pools, inputs.catalog, stages=inputs.stages,
                replicas=None if replicas == "auto" else replicas, sync=sync,
            )  # fmt: skip
            return fleet.single if len(fleet.pipelines) == 1 else fleet

        if inputs.auto:  # compression: auto; the table and --json say which code it took
            chosen, result = choose_compression(plan_with, inputs.training)
            inputs = replace(inputs, training=replace(inputs.training, compression=chosen))
        else:
            result = plan_with(inputs.training)
        if inputs.auto_ahead:  # forwardsAhead: auto; the table and --json say how many
            ahead, result = plan_forwards_ahead(plan_with, inputs.training, result)
            inputs = replace(inputs, training=replace(inputs.training, forwards_ahead=ahead))
        growth = None
        if args.join is not None:
            growth = _growth(args, inputs, result, sync, replicas)
        pipelines = result.pipelines if isinstance(result, FleetPlan) else (result,)
        left = None
        if args.leave is not None:
            left = if_left(inputs.model, inputs.training, pipelines, inputs.pools,
                           inputs.leaving, catalog=inputs.catalog, sync=sync,
                           paying_only=replicas == "auto", fixed_stages=inputs.stages)  # fmt: skip
    except UnknownGpuError as err:
        print(f"relaytrain plan: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LoraTargetError as err:
        # The job asks for something the model has not: bad input, not a fleet too small.
        print(f"relaytrain plan: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PlanError as err:
        print(f"relaytrain plan: the job does not fit: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (InputError, PoolError, ModelShapeError, ValueError) as err:
        print(f"relaytrain plan: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        model = {**inputs.model_source.to_dict(), "layers": inputs.model.num_layers}
        doc = {"job": inputs.name, "model": model, **result.to_dict()}
        doc["compression"] = inputs.training.compression
        doc["forwardsAhead"] = inputs.training.forwards_ahead
        doc["measured"] = measured(result, inputs.catalog)
        if growth is not None:
            doc["growth"] = _growth_dict(growth)
        if left is not None:
            doc["ifLeft"] = if_left_dict(left)
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(inputs.name, inputs.training, result, inputs.model, inputs.model_source,
                           catalog=inputs.catalog))  # fmt: skip
        if growth is not None:
            print("\n" + format_growth(args.join, growth))
        if left is not None:
            print("\n" + format_if_left(args.leave, left, pipelines))
    return 0


def _growth(
    args: argparse.Namespace,
    inputs: _Inputs,
    result: Plan | FleetPlan,
    sync: Sync,
    replicas: int | Literal["auto"],
) -> Growth:
    """What the job would add if --join's nodes joined (its pipelines as planned, kept)."""
    steps_left = args.steps_left or inputs.steps
    if steps_left is None:
        raise InputError(
            "--join needs --steps-left N: the job counts epochs, so its steps are not known here"
        )
    running = result.pipelines if isinstance(result, FleetPlan) else (result,)
    return plan_growth(
        inputs.model, inputs.training, running, merged_pools(inputs.pools, inputs.joining),
        inputs.joining, steps_left=steps_left, catalog=inputs.catalog, sync=sync,
        stages=inputs.stages, max_pipelines=None if replicas == "auto" else replicas,
    )  # fmt: skip


def merged_pools(pools: Sequence[Pool], joining: Sequence[Pool]) -> list[Pool]:
    """The fleet once `joining` has joined `pools`: a pool of the same name grows by its
    GPUs (InputError when the two name different GPUs)."""
    out = {p.name: p for p in pools}
    for p in joining:
        have = out.get(p.name)
        if have is None:
            out[p.name] = p
        elif have.product != p.product:
            raise InputError(
                f"--join's pool {p.name!r} is {p.product}, but the fleet's pool of that name "
                f"is {have.product}"
            )
        else:
            out[p.name] = replace(have, gpus=have.gpus + p.gpus, nodes=have.nodes + p.nodes)
    return list(out.values())


def format_growth(source: Path, growth: Growth) -> str:
    """What --join shows: the pipelines added (their pools and shares) and the verdict."""
    if not growth.added:
        return f"If the nodes of {source} joined: nothing to add ({growth.reason})."
    added = "; ".join(
        f"{'+'.join(s.pool for s in p.stages)} ({p.micro_batches} micro-batches)"
        for p in growth.added
    )
    verdict = "Worth it" if growth.pays else "Not done"
    return (
        f"If the nodes of {source} joined: add {len(growth.added)} pipeline(s): {added}; "
        f"shares {'+'.join(str(m) for m in growth.shares)}; "
        f"{growth.tokens_per_second_before:,.0f} -> {growth.tokens_per_second_after:,.0f} "
        f"tokens/s. {verdict}: {growth.reason}."
    )


def _growth_dict(growth: Growth) -> dict[str, Any]:
    return {
        "added": [p.to_dict() for p in growth.added],
        "shares": list(growth.shares),
        "tokensPerSecondBefore": round(growth.tokens_per_second_before, 1),
        "tokensPerSecondAfter": round(growth.tokens_per_second_after, 1),
        "pays": growth.pays,
        "reason": growth.reason,
    }
