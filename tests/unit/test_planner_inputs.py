"""The planner's inputs: GPU catalog, model configs, pools from nodes, and clear errors."""

from __future__ import annotations

import copy

import pytest
import yaml
from relaytrain_operator.domain.planner import (
    DEFAULT_CATALOG,
    ModelShape,
    ModelShapeError,
    PlanError,
    Pool,
    PoolError,
    TrainingShape,
    UnknownGpuError,
    plan,
    pools_from_file,
    pools_from_nodes,
)
from relaytrain_testkit import REPO
from relaytrain_testkit.shapes import LLAMA3_8B_CONFIG

pytestmark = pytest.mark.unit

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
LLAMA3_8B = LLAMA3_8B_CONFIG
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "head_dim": 128,
}


# --- catalog ---------------------------------------------------------------------------

REQUIRED_PRODUCTS = [
    "NVIDIA-H100-80GB-HBM3",
    "NVIDIA-H100-PCIe",
    "NVIDIA-H200",
    "NVIDIA-A100-SXM4-40GB",
    "NVIDIA-A100-SXM4-80GB",
    "NVIDIA-A100-PCIE-40GB",
    "NVIDIA-A100-80GB-PCIe",
    "NVIDIA-A10",
    "NVIDIA-A40",
    "NVIDIA-L4",
    "NVIDIA-L40S",
    "NVIDIA-GeForce-RTX-3090",
    "NVIDIA-GeForce-RTX-4090",
    "NVIDIA-GeForce-RTX-5090",
    "Tesla-V100-SXM2-16GB",
    "Tesla-V100-SXM2-32GB",
    "Tesla-T4",
]


@pytest.mark.parametrize("product", REQUIRED_PRODUCTS)
def test_catalog_knows_the_labels_gpu_feature_discovery_writes(product):
    gpu = DEFAULT_CATALOG[product]
    assert gpu.tflops > gpu.fp32_tflops > 0
    assert gpu.memory_mib >= 15_000


def test_catalog_orders_gpus_sensibly():
    c = DEFAULT_CATALOG
    assert c["NVIDIA-H100-80GB-HBM3"].tflops > c["NVIDIA-A100-SXM4-80GB"].tflops
    assert c["NVIDIA-A100-SXM4-80GB"].tflops > c["Tesla-V100-SXM2-16GB"].tflops
    assert c["NVIDIA-GeForce-RTX-4090"].tflops > c["NVIDIA-GeForce-RTX-3090"].tflops
    assert not c["Tesla-V100-SXM2-32GB"].bf16 and not c["Tesla-T4"].bf16
    assert c["NVIDIA-A100-SXM4-40GB"].bf16
    assert c["NVIDIA-H200"].memory_mib > c["NVIDIA-H100-80GB-HBM3"].memory_mib


def test_time_sliced_gpus_are_the_same_hardware():
    assert DEFAULT_CATALOG["NVIDIA-A10-SHARED"] == DEFAULT_CATALOG["NVIDIA-A10"]


def test_unknown_gpu_label_lists_the_known_ones():
    with pytest.raises(UnknownGpuError) as err:
        DEFAULT_CATALOG["NVIDIA-Imaginary-9000"]
    message = str(err.value)
    assert "'NVIDIA-Imaginary-9000'" in message
    assert "NVIDIA-H100-80GB-HBM3" in message and "Tesla-T4" in message


def test_catalog_overrides_change_and_add_gpus():
    catalog = DEFAULT_CATALOG.with_overrides(
        {
            "gpus": {
                "NVIDIA-A10": {"tflops": 100},
                "Acme-X1": {
                    "tflops": 50,
                    "fp32Tflops": 10,
                    "memoryMiB": 8192,
                    "memoryBandwidthGBs": 400,
                    "bf16": False,
                },
            }
        }
    )
    assert catalog["NVIDIA-A10"].tflops == 100
    assert catalog["NVIDIA-A10"].memory_mib == DEFAULT_CATALOG["NVIDIA-A10"].memory_mib
    assert catalog["Acme-X1"].memory_mib == 8192
    assert DEFAULT_CATALOG["NVIDIA-A10"].tflops == 125.0  # the default is untouched


def test_catalog_overrides_take_numbers_a_yaml_1_1_reader_left_as_strings():
    """Helm's toYaml writes 0.00001 as 1e-05, which PyYAML reads as a string."""
    doc = yaml.safe_load(
        "Slow: {tflops: 1e-05, fp32Tflops: 2E-5, memoryMiB: 8192, memoryBandwidthGBs: 1e+3,"
        " bf16: true}"
    )
    assert isinstance(doc["Slow"]["tflops"], str)
    slow = DEFAULT_CATALOG.with_overrides(doc)["Slow"]
    assert (slow.tflops, slow.fp32_tflops, slow.memory_bandwidth_gbs) == (1e-5, 2e-5, 1000.0)
    assert slow.memory_mib == 8192 and isinstance(slow.memory_mib, int)
    with pytest.raises(ValueError, match="tflops must be a positive number, got 'fast'"):
        DEFAULT_CATALOG.with_overrides({"NVIDIA-A10": {"tflops": "fast"}})


def test_a_catalog_entry_carries_what_its_card_measured_and_can_drop_it_again():
    """`efficiency` and `layerOverheadMs` are a card's measured figures: set on a known GPU
    (the rest kept), not needed for a new one, and unset again by null."""
    measured = DEFAULT_CATALOG.with_overrides(
        {"NVIDIA-H200": {"efficiency": 0.3, "layerOverheadMs": "2e-1"}}
    )
    h200 = measured["NVIDIA-H200"]
    assert (h200.efficiency, h200.layer_overhead_ms) == (0.3, 0.2)
    assert h200.tflops == DEFAULT_CATALOG["NVIDIA-H200"].tflops
    assert DEFAULT_CATALOG["NVIDIA-H200"].efficiency is None  # the built-in entries measured none
    again = measured.with_overrides({"NVIDIA-H200": {"efficiency": None}})["NVIDIA-H200"]
    assert (again.efficiency, again.layer_overhead_ms) == (None, 0.2)
    datasheet = {"tflops": 50, "fp32Tflops": 10, "memoryMiB": 8192, "memoryBandwidthGBs": 400}
    new = DEFAULT_CATALOG.with_overrides({"Acme-X1": {**datasheet, "bf16": True}})["Acme-X1"]
    assert new.efficiency is None and new.layer_overhead_ms is None


def test_the_planner_docs_catalog_example_is_a_valid_override():
    text = (REPO / "docs" / "planner.md").read_text()
    block = text.split("```yaml\ngpus:\n", 1)[1].split("```", 1)[0]
    catalog = DEFAULT_CATALOG.with_overrides(yaml.safe_load("gpus:\n" + block))
    assert catalog["NVIDIA-A10"].tflops == 100 and catalog["NVIDIA-H200"].efficiency == 0.30
    assert catalog["Acme-X1"].memory_mib == 65536


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"Acme-X1": {"tflops": 50}}, "lacks fp32Tflops, memoryMiB, memoryBandwidthGBs, bf16$"),
        ({"NVIDIA-A10": {"efficiency": 0}}, "efficiency must be a number above 0 and at most 1"),
        ({"NVIDIA-A10": {"efficiency": 45}}, "efficiency must be .*, got 45$"),
        ({"NVIDIA-A10": {"efficiency": True}}, "efficiency must be .*, got True$"),
        ({"NVIDIA-A10": {"layerOverheadMs": -1}}, "layerOverheadMs must be a number of millisec"),
        ({"NVIDIA-A10": {"layerOverheadMS": 1}}, "valid: .*efficiency, layerOverheadMs$"),
        ({"NVIDIA-A10": {"teraflops": 1}}, "unknown field(s) teraflops"),
        ({"NVIDIA-A10": {"tflops": -1}}, "tflops must be a positive number"),
        ({"NVIDIA-A10": {"bf16": "yes"}}, "bf16 must be true or false"),
        ({"NVIDIA-A10": 5}, "must be a mapping"),
    ],
)
def test_bad_catalog_overrides_say_what_is_wrong(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DEFAULT_CATALOG.with_overrides(override)


# --- model shape -----------------------------------------------------------------------


def test_smollm2_135m_shape_and_parameter_count():
    shape = ModelShape.from_hf_config(SMOLLM2_135M)
    assert (shape.num_layers, shape.head_dim, shape.kv_dim) == (30, 64, 192)
    assert shape.tie_word_embeddings
    assert shape.total_params == 134_515_008  # what transformers reports for SmolLM2-135M


def test_llama3_8b_parameter_count():
    assert ModelShape.from_hf_config(LLAMA3_8B).total_params == 8_030_261_248


def test_qwen2_has_attention_biases_and_mistral_reads_head_dim():
    qwen = ModelShape.from_hf_config(QWEN2_7B)
    assert qwen.attention_bias and qwen.layer_params > qwen.layer_matmul_params + 2 * 3584
    assert qwen.total_params == 7_615_616_512
    mistral = ModelShape.from_hf_config(MISTRAL_7B)
    assert mistral.head_dim == 128 and not mistral.attention_bias


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: llama"),
        ({"num_hidden_layers": None}, "lacks 'num_hidden_layers'"),
        ({"hidden_size": "576"}, "'hidden_size' must be an integer"),
        ({"num_hidden_layers": 0}, "num_layers must be a positive integer"),
        ({"num_key_value_heads": 2}, "must be a multiple of num_key_value_heads"),
    ],
)
def test_bad_model_configs_name_the_field(change, message):
    config = {**SMOLLM2_135M, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ModelShapeError, match=message):
        ModelShape.from_hf_config(config)


# --- pools -----------------------------------------------------------------------------


def node(name, product="NVIDIA-A100-SXM4-40GB", gpus="1", pool=None, **extra):
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": "40960"}
    if pool:
        labels["relaytrain.io/pool"] = pool
    annotations = {
        "relaytrain.io/link-bandwidth-mbps": extra.pop("bw", "1000"),
        "relaytrain.io/link-latency-ms": extra.pop("lat", "20"),
    }
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": extra.pop("spec", {}),
        "status": {"allocatable": {"nvidia.com/gpu": gpus}, "capacity": {"nvidia.com/gpu": gpus}},
    }
    return body


def test_nodes_group_into_pools_conservatively():
    nodes = [
        node("a-0", pool="a100", gpus="2", bw="1000", lat="20"),
        node("a-1", pool="a100", gpus="4", bw="400", lat="35"),
        node("cpu-0"),
        node("cordoned", pool="a100", spec={"unschedulable": True}),
        node("h-0", product="NVIDIA-H100-80GB-HBM3", gpus="8"),
    ]
    del nodes[2]["metadata"]["labels"]["nvidia.com/gpu.product"]
    pools = pools_from_nodes(nodes, used={"a-0": 1})
    assert pools == [
        Pool("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3", 8, 1000.0, 20.0, 40960, 1),
        Pool("a100", "NVIDIA-A100-SXM4-40GB", 5, 400.0, 35.0, 40960, 2),
    ]


def test_node_without_link_annotation_is_an_error_unless_a_default_is_given():
    bare = node("n-0")
    bare["metadata"]["annotations"] = {}
    with pytest.raises(PoolError, match=r"node 'n-0' lacks annotation relaytrain\.io/link-band"):
        pools_from_nodes([bare])
    (pool,) = pools_from_nodes([bare], default_link=(1000.0, 5.0))
    assert (pool.link_bandwidth_mbps, pool.link_latency_ms) == (1000.0, 5.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bw": "-5"}, "node 'n-0': relaytrain.io/link-bandwidth-mbps must be > 0"),
        ({"bw": "fast"}, "link-bandwidth-mbps must be a number, got 'fast'"),
        ({"lat": "-1"}, "link-latency-ms must be >= 0"),
        ({"gpus": "two"}, "nvidia.com/gpu must be an integer"),
    ],
)
def test_malformed_nodes_name_the_node_and_field(kwargs, message):
    with pytest.raises(PoolError, match=message.replace(".", r"\.")):
        pools_from_nodes([node("n-0", **kwargs)])


def test_pools_file_accepts_nodelists_and_the_simulated_fleet_format():
    nodelist = {"apiVersion": "v1", "kind": "NodeList", "items": [node("a-0"), node("a-1")]}
    (pool,) = pools_from_file(nodelist)
    assert pool.gpus == 2
    fleet = {
        "pools": [
            {
                "name": "rtx4090",
                "product": "NVIDIA-GeForce-RTX-4090",
                "nodes": 4,
                "gpusPerNode": 2,
                "gpuMemoryMiB": 24564,
                "linkBandwidthMbps": 500,
                "linkLatencyMs": 30,
            }
        ]
    }
    assert pools_from_file(fleet) == [
        Pool("rtx4090", "NVIDIA-GeForce-RTX-4090", 8, 500, 30, 24564, 4)
    ]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"gpus": 0}, "pool 'p': gpus must be a positive integer, got 0"),
        ({"linkBandwidthMbps": -100}, "pool 'p': linkBandwidthMbps must be a positive number"),
        ({"linkBandwidthMbps": 0}, "pool 'p': linkBandwidthMbps must be a positive number"),
        ({"linkLatencyMs": -1}, "pool 'p': linkLatencyMs must be a number >= 0"),
        ({"gpuMemoryMiB": 0}, "pool 'p': gpuMemoryMiB must be a positive integer"),
        ({"name": None}, r"pools\[0\] lacks 'name'"),
    ],
)
def test_malformed_pool_entries_name_the_field(entry, message):
    base = {"name": "p", "product": "Tesla-T4", "gpus": 2, "linkBandwidthMbps": 100}
    raw = {k: v for k, v in {**base, **entry}.items() if v is not None}
    with pytest.raises(PoolError, match=message):
        pools_from_file({"pools": [raw]})


def test_no_gpu_nodes_is_an_error():
    cpu = node("cpu-0")
    del cpu["metadata"]["labels"]["nvidia.com/gpu.product"]
    with pytest.raises(PoolError, match="no GPU nodes found"):
        pools_from_file([cpu])


# --- infeasible and malformed plans ----------------------------------------------------

SMALL = TrainingShape(1, 8, 512, method="lora")


def test_unknown_gpu_label_in_a_pool_fails_the_plan_clearly():
    pools = [Pool("x", "NVIDIA-Imaginary-9000", 2, 1000, 10)]
    with pytest.raises(PlanError, match=r"Pool 'x': unknown GPU product 'NVIDIA-Imaginary-9000'"):
        plan(ModelShape.from_hf_config(SMOLLM2_135M), SMALL, pools)


def test_no_pools_is_an_error():
    with pytest.raises(PlanError, match="No GPU pools were given"):
        plan(ModelShape.from_hf_config(SMOLLM2_135M), SMALL, [])


def test_model_larger_than_the_fleet_says_by_how_much_and_what_would_fit():
    pools = [Pool("t4", "Tesla-T4", 1, 1000, 10)]
    training = TrainingShape(1, 8, 512, method="lora", dtype="float16")
    with pytest.raises(PlanError) as err:
        plan(ModelShape.from_hf_config(LLAMA3_8B), training, pools)
    message = str(err.value)
    assert "do not fit on the 1 usable GPU(s)" in message
    assert "short by" in message and "GiB" in message
    assert err.value.suggestions
    assert "qlora" in err.value.suggestions[0]
    assert any("more Tesla-T4 GPU(s)" in s for s in err.value.suggestions)


def test_suggested_extra_gpus_really_make_the_job_fit():
    model = ModelShape.from_hf_config(LLAMA3_8B)
    pools = [Pool("t4", "Tesla-T4", 2, 1000, 10)]
    training = TrainingShape(1, 8, 512, method="full", dtype="float16")
    with pytest.raises(PlanError) as err:
        plan(model, training, pools)
    (more,) = [s for s in err.value.suggestions if "more Tesla-T4" in s]
    extra = int(more.split()[0])
    plan(model, training, [Pool("t4", "Tesla-T4", 2 + extra, 1000, 10)])
    with pytest.raises(PlanError):
        plan(model, training, [Pool("t4", "Tesla-T4", 1 + extra, 1000, 10)])


def test_output_head_too_big_for_every_gpu_is_named():
    huge_vocab = {**SMOLLM2_135M, "vocab_size": 4_000_000, "tie_word_embeddings": False}
    pools = [Pool("t4", "Tesla-T4", 4, 1000, 10)]
    training = TrainingShape(4, 8, 2048, dtype="float16")
    with pytest.raises(PlanError, match="No GPU can hold the last stage"):
        plan(ModelShape.from_hf_config(huge_vocab), training, pools)


def test_bf16_job_on_gpus_without_bf16_suggests_float16():
    pools = [Pool("v100", "Tesla-V100-SXM2-32GB", 2, 1000, 10)]
    with pytest.raises(PlanError, match="no native bfloat16") as err:
        plan(ModelShape.from_hf_config(SMOLLM2_135M), SMALL, pools)
    assert err.value.suggestions == ["dtype float16"]


def test_pools_without_bf16_are_left_out_with_a_note():
    pools = [
        Pool("v100", "Tesla-V100-SXM2-32GB", 2, 1000, 10),
        Pool("a10", "NVIDIA-A10", 1, 1000, 10),
    ]
    result = plan(ModelShape.from_hf_config(SMOLLM2_135M), SMALL, pools)
    assert {s.pool for s in result.stages} == {"a10"}
    assert any("'v100'" in n and "float16" in n for n in result.notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 0}, "micro_batches must be a positive integer"),
        ({"method": "dora"}, "method 'dora' is not one of lora, qlora, full"),
        ({"compression": "zip"}, "compression 'zip' is not one of none, bf16, int8, int4"),
        ({"lora_targets": ("qkv",)}, "lora_targets"),
    ],
)
def test_bad_training_settings_name_the_field(kwargs, message):
    base = {"micro_batch_size": 1, "micro_batches": 4, "sequence_length": 128}
    with pytest.raises(ValueError, match=message):
        TrainingShape(**{**base, **kwargs})


def test_all_linear_targets_expand():
    t = TrainingShape(1, 4, 128, lora_targets=("all-linear",))
    assert len(t.lora_targets) == 7


def test_inputs_are_not_mutated():
    nodes = [node("a-0"), node("a-1")]
    before = copy.deepcopy(nodes)
    pools_from_nodes(nodes, used={"a-0": 1})
    assert nodes == before
