"""Placement, the one module that says where stages may go: eligible nodes, free GPUs, the
replacement's pool, for the first plan, a replacement and `relaytrain plan` alike."""

from __future__ import annotations

from typing import Any

import pytest
from relaytrain_operator.domain.placement import (
    Choice,
    PoolRoom,
    choose_pool,
    eligible_nodes,
    file_pools,
    free_nodes,
    job_pools,
    node_pool,
    node_ready,
    place_replacements,
    pod_gpus,
    pool_rooms,
    pool_selector,
    usable_mib,
    why_ineligible,
)
from relaytrain_operator.domain.planner import DEFAULT_CATALOG, PlanError, PoolError
from relaytrain_operator.spec import PlacementSpec, parse_job
from relaytrain_testkit.jobs import Job

pytestmark = pytest.mark.unit

LABEL = "nvidia.com/gpu.product"
GIB = 1024**3


def node(
    name: str,
    product: str = "NVIDIA-A100-SXM4-40GB",
    *,
    pool: str | None = None,
    gpus: Any = 1,
    memory: int | None = None,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    ready: bool | None = True,
    cordoned: bool = False,
) -> dict[str, Any]:
    all_labels = {LABEL: product, **(labels or {})}
    if pool:
        all_labels["relaytrain.io/pool"] = pool
    if memory:
        all_labels["nvidia.com/gpu.memory"] = str(memory)
    conditions = [{"type": "MemoryPressure", "status": "False"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    return {
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"unschedulable": cordoned, "taints": taints or []},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "conditions": conditions},
    }


def placement(**fields: Any) -> PlacementSpec:
    return PlacementSpec.model_validate(fields)


JOB = (
    Job("j", "ns")
    .model("s3://models/m/")
    .dataset("s3://data/d.jsonl")
    .training(steps=10)
    .checkpoint("s3://ckpt/x")
)
"""The job placed: `j` in `ns`."""


def gpu_pod(
    node_name: str | None,
    *,
    job_name: str = "other",
    pool: str | None = None,
    phase: str = "Running",
    limits_only: bool = False,
    gpus: str | None = "1",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ns", "labels": {"relaytrain.io/job": job_name}}
    if pool:
        meta["annotations"] = {"relaytrain.io/pool": pool}
    resources = {"limits" if limits_only else "requests": {"nvidia.com/gpu": gpus}} if gpus else {}
    return {
        "metadata": meta,
        "status": {"phase": phase},
        "spec": {"nodeName": node_name, "containers": [{"resources": resources}]},
    }


@pytest.mark.parametrize(
    ("fields", "n", "why"),
    [
        ({}, node("a"), None),
        ({}, {"metadata": {"name": "cpu"}}, "no label nvidia.com/gpu.product"),
        ({"pools": ["h100"]}, node("a"), "not in spec.placement.pools"),
        # A pool is named by its pool label or by its GPU label value.
        ({"pools": ["a100"]}, node("a", pool="a100"), None),
        ({"pools": ["NVIDIA-A100-SXM4-40GB"]}, node("a", pool="a100"), None),
        ({"nodeSelector": {"zone": "a"}}, node("a", labels={"zone": "b"}), "no label zone=a"),
        ({"nodeSelector": {"zone": "a"}}, node("a", labels={"zone": "a"}), None),
        ({}, node("a", ready=False), "not Ready or cordoned"),
        ({}, node("a", ready=None), "not Ready or cordoned"),
        ({}, node("a", cordoned=True), "not Ready or cordoned"),
        (
            {},
            node("a", taints=[{"key": "gpu", "value": "big", "effect": "NoSchedule"}]),
            "taint gpu=big:NoSchedule not tolerated",
        ),
        ({}, node("a", taints=[{"key": "gpu", "effect": "NoExecute"}]), "taint gpu:NoExecute"),
        # PreferNoSchedule only prefers: no reason to leave a node out.
        ({}, node("a", taints=[{"key": "gpu", "effect": "PreferNoSchedule"}]), None),
    ],
)
def test_which_nodes_are_eligible(
    fields: dict[str, Any], n: dict[str, Any], why: str | None
) -> None:
    reason = why_ineligible(n, placement(**fields))
    if why is None:
        assert reason is None
    else:
        assert reason is not None and why in reason


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        ({"key": "gpu", "operator": "Equal", "value": "big"}, True),
        ({"key": "gpu", "operator": "Equal", "value": "small"}, False),
        ({"key": "gpu", "operator": "Exists"}, True),
        ({"key": "other", "operator": "Exists"}, False),
        ({"operator": "Exists"}, True),
        ({"operator": "Exists", "effect": "NoSchedule"}, True),
        ({"operator": "Exists", "effect": "NoExecute"}, False),
    ],
)
def test_tolerations_follow_kubernetes_rules(toleration: dict[str, Any], tolerated: bool) -> None:
    tainted = node("a", taints=[{"key": "gpu", "value": "big", "effect": "NoSchedule"}])
    spec = placement(tolerations=[toleration])
    assert (why_ineligible(tainted, spec) is None) is tolerated


def test_nodes_read_from_a_file_need_no_conditions() -> None:
    bare = node("a", ready=None)
    assert eligible_nodes([bare], placement(), require_ready=False) == [bare]
    assert eligible_nodes([bare], placement()) == []


def test_node_basics() -> None:
    assert node_ready(node("a")) and not node_ready(node("a", ready=None))
    assert node_pool(node("a", pool="p"), LABEL) == "p"
    assert node_pool(node("a"), LABEL) == "NVIDIA-A100-SXM4-40GB"
    assert node_pool({"metadata": {}}, LABEL) is None
    assert pod_gpus(gpu_pod("a", limits_only=True)) == 1
    assert pod_gpus(gpu_pod("a", gpus="x")) == 0
    assert pod_gpus({"spec": {}}) == 0


def test_free_gpus_count_bound_and_pinned_pods_but_not_cpu_pods() -> None:
    nodes = [node("a", gpus=2, pool="p"), node("b", pool="p"), node("c", ready=False)]
    pods = [
        gpu_pod("a"),
        gpu_pod("b", gpus=None),  # no GPU: holds nothing
        gpu_pod(None),  # unbound and unpinned: the scheduler may put it anywhere
        gpu_pod(None, pool="p"),  # pinned to pool p, not yet bound: takes one of p's
        gpu_pod("b", phase="Failed"),
    ]
    free = free_nodes(nodes, pods, LABEL)
    assert {n["metadata"]["name"]: n["status"]["allocatable"]["nvidia.com/gpu"] for n in free} == {
        "b": "1"
    }
    # Nodes from a file have no conditions: with require_ready=False they count.
    assert [
        n["metadata"]["name"]
        for n in free_nodes([node("z", ready=None)], [], LABEL, require_ready=False)
    ] == ["z"]


def test_job_pools_apply_the_job_s_placement() -> None:
    nodes = [
        node("a", pool="a100", labels={"zone": "a"}),
        node("b", "NVIDIA-H100-80GB-HBM3", pool="h100", labels={"zone": "b"}),
    ]
    own = gpu_pod("a", job_name="j")  # the job's own pod: its GPU is the job's to use
    pools = job_pools(
        parse_job(JOB.placement(node_selector={"zone": "a"}).build()),
        nodes,
        [own],
        default_link=(1000, 10),
    )
    assert [(p.name, p.gpus) for p in pools] == [("a100", 1)]


def test_pool_rooms_take_memory_from_the_label_else_the_catalog() -> None:
    nodes = [
        node("a", memory=40000, pool="a100"),
        node("b", "NVIDIA-H100-80GB-HBM3", pool="h100"),
        node("c", "Acme-X1", pool="acme"),
    ]
    rooms = pool_rooms(free_nodes(nodes, [], LABEL), LABEL)
    assert rooms == {
        "a100": PoolRoom(1, 40000),
        "h100": PoolRoom(1, DEFAULT_CATALOG["NVIDIA-H100-80GB-HBM3"].memory_mib),
        "acme": PoolRoom(1, 0),  # unknown product, no label: fits nothing that needs memory
    }


def test_pool_selector_pins_to_the_pool_label_where_nodes_carry_one() -> None:
    assert pool_selector("a100", [node("a", pool="a100")], LABEL) == {
        LABEL: "NVIDIA-A100-SXM4-40GB",
        "relaytrain.io/pool": "a100",
    }
    assert pool_selector("NVIDIA-L4", [node("a")], LABEL) == {LABEL: "NVIDIA-L4"}


def test_choose_pool_prefers_its_own_then_the_smallest_memory_that_fits() -> None:
    rooms = {"A": PoolRoom(0, 40960), "B": PoolRoom(1, 0), "C": PoolRoom(1, 81559)}
    assert choose_pool("A", 30000, rooms) == "C"  # B's memory is unknown: it fits nothing
    assert choose_pool("A", 30000, {**rooms, "D": PoolRoom(1, 49140)}) == "D"


def test_another_pool_fits_a_stage_only_within_what_a_plan_may_use_of_it() -> None:
    """An RTX 4090 has 24,564 MiB; a plan may use 90 % of it less a 1 GiB reserve (21,083
    MiB). A stage planned at 21,811 MiB on an H100 would fit the total but not that: it
    goes to the A100, where the planner itself would have put it."""
    rooms = {"h100": PoolRoom(0, 81559), "rtx": PoolRoom(1, 24564), "a100": PoolRoom(1, 81920)}
    assert usable_mib(24564) == 21083
    assert choose_pool("h100", 21811, rooms) == "a100"
    assert choose_pool("h100", 21083, rooms) == "rtx"


def test_a_replacement_keeps_to_the_allowed_pools() -> None:
    nodes = [
        node("a0", pool="a100"),
        node("l0", "NVIDIA-L40S", pool="l40s"),
        node("h0", "NVIDIA-H100-80GB-HBM3", pool="h100"),
    ]
    held = [gpu_pod("a0")]
    need = {0: ("a100", 30 * GIB)}
    assert place_replacements(parse_job(JOB.build()), need, nodes, held)[0].pool == "l40s"
    assert (
        place_replacements(
            parse_job(JOB.placement(pools=["a100", "h100"]).build()), need, nodes, held
        )[0].pool
        == "h100"
    )


def test_replacements_skip_excluded_pools_and_say_why_when_nothing_fits() -> None:
    nodes = [
        node("a0", pool="a100", labels={"zone": "a"}),
        node("h0", "NVIDIA-H100-80GB-HBM3", pool="h100", labels={"zone": "b"}),
        node("r0", "NVIDIA-GeForce-RTX-4090", pool="rtx", memory=24564, labels={"zone": "a"}),
        node("t0", "Tesla-T4", pool="t4", labels={"zone": "a"}),
        node("l0", "NVIDIA-L4", pool="l4", labels={"zone": "a"}, ready=False),
    ]
    held = [gpu_pod("a0")]
    choices = place_replacements(
        parse_job(JOB.placement(node_selector={"zone": "a"}).build()),
        {0: ("a100", 30 * GIB)},
        nodes,
        held,
    )
    assert choices[0].pool == "a100" and not choices[0].free
    why = choices[0].why
    assert why.startswith("no eligible node has a free GPU with 30.0 GiB")
    assert "pool a100: no free GPU" in why
    assert "pool h100: no label zone=a (spec.placement.nodeSelector)" in why
    assert "pool rtx: 24.0 GiB per GPU, 20.6 usable" in why
    assert "pool t4: no native bfloat16 (spec.model.dtype)" in why  # before its readiness
    assert "pool l4: not Ready or cordoned" in why
    # Without the nodeSelector the H100 takes it.
    assert place_replacements(parse_job(JOB.build()), {0: ("a100", 30 * GIB)}, nodes, held) == {
        0: Choice("h100", True)
    }


def test_a_replacement_never_goes_to_a_gpu_without_the_job_s_dtype() -> None:
    """A V100 has no bfloat16: the planner leaves it out of a bf16 plan, and a replaced
    stage of that job does not go there either."""
    nodes = [node("a0", pool="a100"), node("v0", "Tesla-V100-SXM2-32GB", pool="v100")]
    job = parse_job(JOB.build())
    assert job.spec.model.dtype == "bfloat16"
    choice = place_replacements(job, {0: ("a100", GIB)}, nodes, [gpu_pod("a0")])[0]
    assert not choice.free and "pool v100: no native bfloat16" in choice.why
    fp16 = parse_job(JOB.set("spec.model.dtype", "float16").build())
    assert place_replacements(fp16, {0: ("a100", GIB)}, nodes, [gpu_pod("a0")])[0] == Choice(
        "v100", True
    )


def test_no_gpu_nodes_at_all_is_said_plainly() -> None:
    choices = place_replacements(
        parse_job(JOB.build()), {0: ("a100", GIB)}, [{"metadata": {"name": "cpu"}}], []
    )
    assert choices[0] == Choice("a100", False, "no eligible node has a free GPU with 1.0 GiB")


# --- `relaytrain plan` reads nodes through the same rules ---------------------------------


def test_file_pools_apply_the_job_s_placement_to_a_node_list() -> None:
    nodes = {
        "kind": "NodeList",
        "items": [
            node("a", pool="a100", labels={"zone": "a"}, ready=None),
            node("b", "NVIDIA-H100-80GB-HBM3", pool="h100", labels={"zone": "b"}, ready=None),
        ],
    }
    pools = file_pools(
        parse_job(JOB.placement(node_selector={"zone": "a"}).build()),
        nodes,
        default_link=(1000, 10),
    )
    assert [p.name for p in pools] == ["a100"]
    assert [
        p.name
        for p in file_pools(
            parse_job(JOB.build()), {**nodes["items"][1], "kind": "Node"}, default_link=(1000, 10)
        )
    ] == ["h100"]
    with pytest.raises(PlanError, match=r"No node in the file is eligible .*b: no label zone=c"):
        file_pools(
            parse_job(JOB.placement(node_selector={"zone": "c"}).build()),
            nodes["items"],
            default_link=(1000, 10),
        )
    with pytest.raises(PoolError, match="nodes file must be"):
        file_pools(parse_job(JOB.build()), "nodes", default_link=(1000, 10))


def test_file_pools_of_a_pools_file_apply_the_allowed_pools() -> None:
    doc = {
        "pools": [
            {"name": "a100", "product": "NVIDIA-A100-SXM4-40GB", "linkBandwidthMbps": 1000},
            {"name": "l4", "product": "NVIDIA-L4", "linkBandwidthMbps": 1000},
        ]
    }
    assert [
        p.name for p in file_pools(parse_job(JOB.placement(pools=["NVIDIA-L4"]).build()), doc)
    ] == ["l4"]
    assert len(file_pools(parse_job(JOB.build()), doc)) == 2
    with pytest.raises(PlanError, match=r"matches none of the pools: a100, l4"):
        file_pools(parse_job(JOB.placement(pools=["h100"]).build()), doc)


def test_relaytrain_plan_keeps_a_job_off_nodes_its_node_selector_excludes(
    tmp_path: Any, capsys: Any
) -> None:
    import json
    from pathlib import Path

    import yaml
    from relaytrain_operator import cli
    from relaytrain_testkit.shapes import SMOLLM2_135M_CONFIG

    root = Path(__file__).resolve().parents[2]
    fleet = yaml.safe_load((root / "examples" / "nodes-mixed.yaml").read_text())
    for item in fleet["items"]:
        item["metadata"]["labels"]["site"] = "b" if "h100" in item["metadata"]["name"] else "a"
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(fleet))
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG))
    job = Job.example("finetunejob-lora").placement(node_selector={"site": "a"})
    argv = ["plan", str(job.write(tmp_path / "job.yaml")), "--nodes", str(tmp_path / "nodes.yaml")]
    rc = cli.main([*argv, "--model-config", str(tmp_path / "config.json"), "--json"])
    assert rc == 0
    pools = {s["pool"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert pools and "h100" not in pools
