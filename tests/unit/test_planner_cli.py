"""`relaytrain plan`: a readable table, JSON for scripts, and clear failures."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml
from relaytrain_operator import cli
from relaytrain_testkit.jobs import Job
from relaytrain_testkit.shapes import LLAMA3_8B_CONFIG

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MIXED_NODES = ROOT / "examples" / "nodes-mixed.yaml"
HACK_POOLS = ROOT / "hack" / "pools.yaml"
LORA = Job.example("finetunejob-lora")

LLAMA3_8B = LLAMA3_8B_CONFIG


def relaytrain(*argv: str) -> int:
    """Run `relaytrain ...` through the real entry point."""
    return cli.main(list(argv))


@pytest.fixture
def model_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_table_names_every_stage_and_the_bottleneck(tmp_path, model_config, capsys):
    dataset = {"uri": "s3://data/x.jsonl", "sequenceLength": 2048}  # the whole section
    manifest = LORA.set("spec.dataset", dataset).write(tmp_path / "job.yaml")
    rc = relaytrain(
        "plan", str(manifest), "--nodes", str(HACK_POOLS), "--model-config", str(model_config)
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("Plan for smollm-lora: ")
    header = next(line for line in out.splitlines() if line.startswith("STAGE"))
    for column in ("POOL", "GPU", "LAYERS", "COMPUTE", "LINK", "BEAT", "MEMORY"):
        assert column in header
    stage_lines = [line for line in out.splitlines() if line[:1].isdigit()]
    assert stage_lines and stage_lines[-1].split()[3].endswith("-31")
    assert "tokens/s" in out and "Bottleneck: stage" in out
    assert "'v100'" in out  # left out for lacking bfloat16, and the table says so


def test_json_is_the_plan_for_scripts(tmp_path, model_config, capsys):
    rc = relaytrain(
        "plan",
        str(LORA.write(tmp_path / "job.yaml")),
        "--nodes",
        str(MIXED_NODES),
        "--model-config",
        str(model_config),
        "--json",
        "--replicas",  # one pipeline: today's shape (several: tests/unit/test_planner_fleet.py)
        "1",
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"] == "smollm-lora"
    stages = doc["stages"]
    assert stages[0]["layerStart"] == 0 and stages[-1]["layerEnd"] == 32
    assert all(a["layerEnd"] == b["layerStart"] for a, b in itertools.pairwise(stages))
    for s in stages:
        assert s["predictedMemoryBytes"] <= s["availableMemoryBytes"]
        assert s["pool"] in {"h100", "a100", "l40s", "rtx4090", "v100"}
    assert doc["predictedTokensPerSecond"] > 0
    assert doc["bottleneck"]["resource"] in ("compute", "memory", "link")


def test_fixed_stage_count_and_allowed_pools_come_from_the_job(tmp_path, model_config, capsys):
    job = LORA.pipeline(stages=3).placement(pools=["rtx4090", "NVIDIA-L40S"]).method("qlora")
    manifest = job.write(tmp_path / "job.yaml")
    rc = relaytrain(
        "plan",
        str(manifest),
        "--nodes",
        str(MIXED_NODES),
        "--model-config",
        str(model_config),
        "--json",
        "--replicas",
        "1",
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["stages"]) == 3
    assert {s["pool"] for s in doc["stages"]} <= {"rtx4090", "l40s"}


def test_catalog_file_adds_a_gpu(tmp_path, model_config, capsys):
    nodes = {
        "pools": [
            {
                "name": "x1",
                "product": "Acme-X1",
                "nodes": 2,
                "linkBandwidthMbps": 1000,
                "linkLatencyMs": 5,
            }
        ]
    }
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    args = [
        "plan",
        str(LORA.method("qlora").write(tmp_path / "job.yaml")),
        "--nodes",
        str(tmp_path / "nodes.yaml"),
        "--model-config",
        str(model_config),
    ]
    assert relaytrain(*args) == 2
    assert "unknown GPU product 'Acme-X1'" in capsys.readouterr().err
    catalog = {
        "gpus": {
            "Acme-X1": {
                "tflops": 400,
                "fp32Tflops": 40,
                "memoryMiB": 65536,
                "memoryBandwidthGBs": 2000,
                "bf16": True,
            }
        }
    }
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    assert relaytrain(*args, "--catalog", str(tmp_path / "catalog.json")) == 0
    assert "Acme-X1" in capsys.readouterr().out


def test_a_catalog_file_prices_a_card_at_what_it_measured_and_the_plan_says_so(
    tmp_path, model_config, capsys
):
    """An H100 whose entry measured a third of the default efficiency: the same job's plan
    is priced slower, the table names the card and its figures, the JSON carries them."""
    nodes = {
        "pools": [
            {"name": "h100", "product": "NVIDIA-H100-80GB-HBM3", "nodes": 2,
             "linkBandwidthMbps": 10_000, "linkLatencyMs": 1},
        ]
    }  # fmt: skip
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    job, pools = LORA.write(tmp_path / "job.yaml"), tmp_path / "nodes.yaml"
    args = ["plan", str(job), "--nodes", str(pools), "--model-config", str(model_config), "--json"]
    assert relaytrain(*args) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["measured"] == {}
    catalog = {"NVIDIA-H100-80GB-HBM3": {"efficiency": 0.15, "layerOverheadMs": 0.5}}
    (tmp_path / "catalog.yaml").write_text(yaml.safe_dump(catalog))
    assert relaytrain(*args, "--catalog", str(tmp_path / "catalog.yaml")) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["measured"] == {"NVIDIA-H100-80GB-HBM3": {"efficiency": 0.15,
                                                          "layerOverheadMs": 0.5}}  # fmt: skip
    assert slow["predictedTokensPerSecond"] < default["predictedTokensPerSecond"] / 2
    assert relaytrain(*args[:-1], "--catalog", str(tmp_path / "catalog.yaml")) == 0
    assert (
        "Priced as measured (their catalog entries): NVIDIA-H100-80GB-HBM3 efficiency 0.15, "
        "0.5 ms a layer and micro-batch; any other GPU at the cost model's efficiency 0.45."
    ) in capsys.readouterr().out
    bad = {"NVIDIA-H100-80GB-HBM3": {"efficiency": 15}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert relaytrain(*args, "--catalog", str(tmp_path / "bad.yaml")) == 2
    assert "efficiency must be a number above 0 and at most 1" in capsys.readouterr().err


def test_a_job_that_does_not_fit_exits_1_and_says_why(tmp_path, model_config, capsys):
    nodes = {
        "pools": [{"name": "a10", "product": "NVIDIA-A10", "nodes": 1, "linkBandwidthMbps": 1000}]
    }
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    manifest = LORA.model("s3://models/llama/", dtype="float16").write(tmp_path / "job.yaml")
    rc = relaytrain(
        "plan",
        str(manifest),
        "--nodes",
        str(tmp_path / "nodes.yaml"),
        "--model-config",
        str(model_config),
    )
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    assert "the job does not fit" in captured.err and "short by" in captured.err
    assert "method qlora" in captured.err


def test_model_config_is_read_from_a_local_model_uri(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    manifest = LORA.model(str(model_dir)).write(tmp_path / "job.yaml")
    args = ["--nodes", str(MIXED_NODES), "--json", "--replicas", "1"]
    assert relaytrain("plan", str(manifest), *args) == 0
    assert json.loads(capsys.readouterr().out)["stages"][-1]["layerEnd"] == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"job_model": {"uri": "hf://acme/unknown-model"}}, "none is named 'unknown-model'"),
        ({"nodes": "missing.yaml"}, "cannot read nodes file"),
        ({"job_training": {"microBatches": 0}}, "spec.training.microBatches"),
        # A target the model has not (expert weights on a dense model) is bad input too.
        ({"job_method": {"targetModules": ["experts.down_proj"]}}, "spec.method.targetModules"),
        (
            {
                "nodes_doc": {
                    "pools": [
                        {"name": "p", "product": "Tesla-T4", "gpus": 0, "linkBandwidthMbps": 10}
                    ]
                }
            },
            "gpus must be a positive",
        ),
        (
            {
                "nodes_doc": {
                    "pools": [
                        {"name": "p", "product": "Tesla-T4", "gpus": 1, "linkBandwidthMbps": -10}
                    ]
                }
            },
            "linkBandwidthMbps must be",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_problem(tmp_path, model_config, change, message, capsys):
    job = LORA
    for key in ("job_training", "job_method", "job_model"):
        if key in change:  # the whole section replaced
            job = job.set(f"spec.{key.removeprefix('job_')}", change[key])
    manifest = job.write(tmp_path / "job.yaml")
    nodes = str(HACK_POOLS)
    if "nodes" in change:
        nodes = str(tmp_path / change["nodes"])
    if "nodes_doc" in change:
        nodes = str(tmp_path / "nodes.yaml")
        Path(nodes).write_text(yaml.safe_dump(change["nodes_doc"]))
    extra = [] if "job_model" in change else ["--model-config", str(model_config)]
    assert relaytrain("plan", str(manifest), "--nodes", nodes, *extra) == 2
    assert message in capsys.readouterr().err


def test_kubeconfig_reads_live_nodes_and_leaves_out_gpus_pods_hold(
    tmp_path, model_config, capsys, monkeypatch
):
    """The API objects the kubernetes client returns go through the same pools code; a pod
    bound to a node takes its GPU away. (The API server itself is faked: unit tier.)"""
    from kubernetes import client, config

    api = client.ApiClient()
    fleet = yaml.safe_load(MIXED_NODES.read_text())
    for item in fleet["items"]:
        item["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    busy = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "other-job", "namespace": "default"},
        "spec": {
            "nodeName": "h100-0",
            "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "2"}}}],
        },
        "status": {"phase": "Running"},
    }

    class FakeCore:
        def __init__(self, api_client):
            assert api_client is api

        def list_node(self):
            return api._ApiClient__deserialize(fleet, "V1NodeList")

        def list_pod_for_all_namespaces(self):
            return api._ApiClient__deserialize({"items": [busy]}, "V1PodList")

    seen = []
    monkeypatch.setattr(
        config, "new_client_from_config", lambda config_file: seen.append(config_file) or api
    )
    monkeypatch.setattr(client, "CoreV1Api", FakeCore)
    rc = relaytrain(
        "plan",
        str(LORA.write(tmp_path / "job.yaml")),
        "--kubeconfig",
        str(tmp_path / "kc.yaml"),
        "--model-config",
        str(model_config),
        "--json",
        "--replicas",
        "1",
    )
    assert rc == 0 and seen == [str(tmp_path / "kc.yaml")]
    pools = {s["pool"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert "h100" not in pools  # both H100s are held by another job's pod


JOINING_NODES = ROOT / "examples" / "nodes-joining.yaml"


def test_join_shows_what_the_job_would_add_and_whether_it_pays(tmp_path, model_config, capsys):
    """Two H100 join a job that runs two H100 pipelines (periodic sync): two more pipelines,
    the shares even at 2 each; worth it over 20,000 steps, not over the job's 200 (joining
    costs more than the 9.9 % would save)."""
    job = str(LORA.write(tmp_path / "job.yaml"))
    common = ["plan", job, "--nodes", str(MIXED_NODES), "--model-config", str(model_config),
              "--replicas", "auto", "--sync", "periodic", "--sync-every", "8",
              "--join", str(JOINING_NODES)]  # fmt: skip
    assert relaytrain(*common, "--steps-left", "20000", "--json") == 0
    growth = json.loads(capsys.readouterr().out)["growth"]
    assert [[s["pool"] for s in p["stages"]] for p in growth["added"]] == [["h100"], ["h100"]]
    assert growth["shares"] == [2, 2, 2, 2] and growth["pays"]
    assert growth["tokensPerSecondAfter"] > 1.05 * growth["tokensPerSecondBefore"]
    assert relaytrain(*common) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"If the nodes of {JOINING_NODES} joined: add 2 pipeline(s): h100")
    assert "Not done: " in last and "over the 200 steps left" in last
    # One pipeline (the job's default replicas, periodic sync as above): nothing is added.
    assert relaytrain(*common[:6], *common[8:]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for smollm-lora: 1 stage(s)")
    last = out.strip().splitlines()[-1]
    assert last.endswith("joined: nothing to add (the job runs as many pipelines as it may (1)).")


def test_join_refuses_what_it_cannot_judge(tmp_path, model_config, capsys):
    base = ["--nodes", str(MIXED_NODES), "--model-config", str(model_config)]
    epochs = LORA.set("spec.training", {"epochs": 2}).write(tmp_path / "epochs.yaml")
    assert relaytrain("plan", str(epochs), *base, "--join", str(JOINING_NODES)) == 2
    assert "--join needs --steps-left N" in capsys.readouterr().err
    clash = tmp_path / "clash.yaml"
    nodes = yaml.safe_load(JOINING_NODES.read_text())
    nodes["items"][0]["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-L40S"
    clash.write_text(yaml.safe_dump(nodes))
    job = str(LORA.write(tmp_path / "job.yaml"))
    assert relaytrain("plan", job, *base, "--join", str(clash)) == 2
    err = capsys.readouterr().err
    assert "--join's pool 'h100' is NVIDIA-L40S, but the fleet's pool of that name" in err


def test_an_outer_code_prices_a_gather_of_its_bits(tmp_path, model_config, capsys):
    """`--outer-code int2` (or the job's spec.pipeline.sync.outerCode): the outer step moves
    2.25 bits a LoRA value instead of float64's 64, gathered (codes do not add): with two
    pipelines one code each way, as the float64 weights and mean are."""
    job = str(LORA.write(tmp_path / "job.yaml"))
    common = ["plan", job, "--nodes", str(MIXED_NODES), "--model-config", str(model_config),
              "--replicas", "2", "--sync", "periodic", "--sync-every", "8", "--json"]  # fmt: skip
    assert relaytrain(*common) == 0
    weights = json.loads(capsys.readouterr().out)["sync"]
    assert relaytrain(*common, "--outer-code", "int2") == 0
    coded = json.loads(capsys.readouterr().out)["sync"]
    assert weights["outerCode"] == "float64" and coded["outerCode"] == "int2"
    assert coded["gradientBytes"] == round(weights["gradientBytes"] * 2.25 / 64)
    assert coded["collective"] == "all-gather" and coded["exchanged"] == "updates"
    ratio = weights["predictedBandwidthSeconds"] / coded["predictedBandwidthSeconds"]
    assert ratio == pytest.approx(64 / 2.25, rel=0.01)
    int2 = {"mode": "periodic", "everySteps": 8, "outerCode": "int2"}
    from_job = LORA.set("spec.pipeline.sync", int2).write(tmp_path / "int2.yaml")
    assert relaytrain("plan", str(from_job), *common[2:6], "--replicas", "2", "--json") == 0
    assert json.loads(capsys.readouterr().out)["sync"]["gradientBytes"] == coded["gradientBytes"]
    assert relaytrain("plan", job, *common[2:6], "--outer-code", "int2") == 2
    assert "--outer-code int2 needs --sync periodic (outer steps)" in capsys.readouterr().err


def test_leave_shows_what_the_job_would_do_if_nodes_left(tmp_path, model_config, capsys):
    """The lab job on the mixed fleet: two H100 pipelines (one node of two H100). If that
    node left, both pipelines leave at a step boundary and come back at once on the L40S
    pool (the smallest free GPUs whose usable memory fits 21.3 GiB: a 4090's 20.6 does
    not; the V100 has no bfloat16). With one pipeline, its stage moves there instead."""
    job = str(LORA.write(tmp_path / "job.yaml"))
    common = ["plan", job, "--nodes", str(MIXED_NODES), "--model-config", str(model_config),
              "--leave", "h100-0"]  # fmt: skip
    assert relaytrain(*common, "--replicas", "2", "--json") == 0
    left = json.loads(capsys.readouterr().out)["ifLeft"]
    assert left["lost"] == {"h100": 2} and left["leaving"] == [0, 1] and left["waiting"] == []
    assert {m["pool"] for m in left["moves"]} == {"l40s"} and left["sharesOut"] == []
    assert 0 < left["tokensPerSecondAfter"] < left["tokensPerSecondBefore"]
    assert relaytrain(*common, "--replicas", "2") == 0
    out = capsys.readouterr().out
    tail = out[out.index("If h100-0 left (pool h100: 2 GPU(s)):") :].splitlines()
    assert tail[1] == "- pipeline 0 (h100) leaves at a step boundary: no step lost."
    assert "- pipeline 1 comes back at once on l40s." in tail
    assert relaytrain(*common) == 0
    out = capsys.readouterr().out
    assert "- stage 0 (h100, 21.3 GiB) trains on until its node ends, then starts on a free " \
        "GPU of pool l40s from the last commit, no restart counted." in out  # fmt: skip
    # A node the job may not use (the example's placement allows H100 and RTX 4090 only).
    qlora = str(ROOT / "examples" / "finetunejob-qlora-mixed.yaml")
    assert relaytrain("plan", qlora, "--nodes", str(MIXED_NODES), "--leave", "l40s-0") == 0
    out = capsys.readouterr().out
    assert "If l40s-0 left (none of the GPUs the job may use):\n- no stage of the job is on " \
        "them: nothing changes." in out  # fmt: skip


def test_leave_names_nodes_of_the_fleet(tmp_path, model_config, capsys):
    job = str(LORA.write(tmp_path / "job.yaml"))
    base = ["plan", job, "--model-config", str(model_config)]
    assert relaytrain(*base, "--nodes", str(MIXED_NODES), "--leave", "h100-9") == 2
    err = capsys.readouterr().err
    assert "--leave 'h100-9': no node named h100-9 in the fleet; its nodes: a100-0, a100-1" in err
    assert relaytrain(*base, "--nodes", str(HACK_POOLS), "--leave", "h100-0") == 2
    assert "--nodes is a pools file without node names: give a NodeList" in capsys.readouterr().err


def test_an_explicit_exact_merge_of_float64_weights_prices_a_gather(tmp_path, model_config, capsys):
    """`loraMerge: exact` needs every pipeline's factors: float64 weights among four
    pipelines are gathered, (R - 1)^2 copies at the star's leader instead of a sum's R - 1;
    `auto` (float64 among more than two) averages and is priced as the sum."""
    common = ["--nodes", str(MIXED_NODES), "--model-config", str(model_config),
              "--replicas", "4", "--json"]  # fmt: skip
    sync = {"mode": "periodic", "everySteps": 8}
    priced = {}
    for merge in ("auto", "exact"):
        job = LORA.set("spec.pipeline.sync", {**sync, "loraMerge": merge})
        assert relaytrain("plan", str(job.write(tmp_path / f"{merge}.yaml")), *common) == 0
        priced[merge] = json.loads(capsys.readouterr().out)["sync"]
    assert priced["exact"]["collective"] == "all-gather"
    assert priced["exact"]["gradientBytes"] == priced["auto"]["gradientBytes"]
    ratio = (
        priced["exact"]["predictedBandwidthSeconds"] / priced["auto"]["predictedBandwidthSeconds"]
    )
    assert ratio == pytest.approx(3, rel=0.01)  # (4 - 1)^2 copies against 4 - 1


@pytest.mark.parametrize(
    ("training", "says"),
    [
        ({"epochs": 6}, "priced at 3.77 bits a value, the mean of its 6 epochs: the first at 4.31"),
        ({"steps": 100}, "priced at 4.31 bits a value, its first epoch's rate, the dearest (a job"),
    ],
)
def test_the_table_says_how_delta_is_priced(tmp_path, model_config, capsys, training, says):
    """A job of epochs pays delta's first-crossing rate once and 0.85 of it after; a job of
    steps, whose passes the plan cannot know, its first epoch's rate throughout."""
    manifest = (
        LORA.pipeline(stages=4, compression="delta")
        .set("spec.training", {"microBatches": 8, **training})
        .write(tmp_path / "job.yaml")
    )
    rc = relaytrain(
        "plan", str(manifest), "--nodes", str(HACK_POOLS), "--model-config", str(model_config)
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    (line,) = [line for line in out.splitlines() if line.startswith("Boundary code delta")]
    assert says in line, line
    assert line.endswith("gradients at 2.25; deflate counted as 1.3 % off the activations."), line
    int8 = LORA.pipeline(stages=4).write(tmp_path / "int8.yaml")
    assert (
        relaytrain(
            "plan", str(int8), "--nodes", str(HACK_POOLS), "--model-config", str(model_config)
        )
        == 0
    )
    assert "Boundary code" not in capsys.readouterr().out


def test_the_table_says_what_a_fitted_basis_costs_a_frame(tmp_path, model_config, capsys):
    """With ``activationBasis: fitted`` each stage that sends activations pays a share of a
    basis's fit and bytes: the table says how much, the stages' link time grows by it, and
    where the encoder sets the pace the bottleneck names it and the basis's share."""
    link = {}
    for basis in ("identity", "fitted"):
        job = (
            LORA.pipeline(stages=4, compression="delta")
            .set("spec.pipeline.activationBasis", basis)
            .set("spec.training", {"microBatches": 8, "epochs": 3})
        )
        manifest = job.write(tmp_path / f"{basis}.yaml")
        common = ("--nodes", str(HACK_POOLS), "--model-config", str(model_config))
        assert relaytrain("plan", str(manifest), *common) == 0
        out = capsys.readouterr().out.splitlines()
        lines = [x for x in out if x.startswith("Fitted bases")]
        (bottleneck,) = [x for x in out if x.startswith("Bottleneck")]
        # 256 tokens a micro-batch over these links: delta's encoder sets the pace, and the
        # table says so, with the basis's share where there is one
        assert "its encoder (delta's codes) takes" in bottleneck, bottleneck
        assert ("its share of the bases it fits" in bottleneck) is (basis == "fitted")
        assert relaytrain("plan", str(manifest), *common, "--json") == 0
        stages = json.loads(capsys.readouterr().out)["stages"]
        link[basis] = [stage["predictedLinkSeconds"] for stage in stages]
        if basis == "identity":
            assert lines == []
            continue
        (line,) = lines
        assert line.startswith("Fitted bases: one of 4096 x 4096 fitted and sent every 96 frames")
        assert "at most 17.0 MiB" in line, line
    # every stage but the last sends activations; each pays for the bases it fits and sends
    assert all(f > i for f, i in zip(link["fitted"][:-1], link["identity"][:-1], strict=True))


def test_forwards_ahead_auto_is_chosen_over_slow_links_and_shown(tmp_path, model_config, capsys):
    """Over 100 Mbit/s links with 50 ms each way the step played out through 1F1B is shorter
    with forwards ahead: the table's header and --json say how many auto took, and its step
    (played out) is shorter than with none, whose table says how many would help."""
    pools = tmp_path / "pools.yaml"
    pool = {"name": "rtx4090", "product": "NVIDIA-GeForce-RTX-4090", "nodes": 4}
    pool |= {"gpusPerNode": 1, "gpuMemoryMiB": 24564, "cpu": "16", "memory": "64Gi"}
    pool |= {"linkBandwidthMbps": 100, "linkLatencyMs": 50}
    pools.write_text(yaml.safe_dump({"pools": [pool]}))
    job = LORA.set("spec.training", {"microBatches": 16, "steps": 100})
    argv = ("--nodes", str(pools), "--model-config", str(model_config))

    def played_out(forwards_ahead: int | str) -> tuple[str, float]:
        manifest = job.pipeline(stages=4, forwards_ahead=forwards_ahead).write(tmp_path / "j.yaml")
        assert relaytrain("plan", str(manifest), *argv) == 0
        lines = capsys.readouterr().out.splitlines()
        (line,) = [line for line in lines if line.startswith("Step ")]
        assert "(1F1B played out over its links)" in line
        return lines[0], float(line.split()[1].rstrip("s"))

    header, auto_step = played_out("auto")
    assert relaytrain("plan", str(tmp_path / "j.yaml"), *argv, "--json") == 0
    chosen = json.loads(capsys.readouterr().out)["forwardsAhead"]
    assert chosen > 0
    assert f", 1F1B with {chosen} forward" in header, header
    none_header, none_step = played_out(0)
    assert ", 1F1B, 16 micro-batches" in none_header, none_header
    assert auto_step < none_step
    manifest = job.pipeline(stages=4, forwards_ahead=0).write(tmp_path / "j.yaml")
    assert relaytrain("plan", str(manifest), *argv) == 0
    (gain,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("With ")]
    assert float(gain.split(": ")[1].split("s a step")[0]) < none_step, gain
