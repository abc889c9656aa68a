"""The cost model: time and memory of a pipeline stage (its links' cost: link_cost.py).

Everything is per micro-batch of T = micro_batch_size * sequence_length tokens, for one
decoder layer unless said otherwise. All layers of a Llama-family model are identical, so a
stage's cost is ``layers * per_layer + fixed`` where the fixed part depends only on whether
the stage is first (embedding), last (output head, logits) and on its neighbours' links.

Compute (FLOPs; W = matmul weights of a layer, q = query width, b, s = batch, sequence):
- forward: 2·T·W for the matmuls plus 2·b·s²·q for causal attention (QKᵀ and AV over the
  lower triangle, as SDPA/flash kernels skip the masked half);
- backward, full: 4·T·W (gradients of activations and of weights) + 2x attention forward;
- backward, lora/qlora: 2·T·W — frozen weights need no weight gradient — + 2x attention;
- LoRA adapters: 6·T·r·(in + out) per target (forward, input and weight gradients);
- qlora: each 4-bit weight is dequantised in forward and again in backward: per pass it
  reads 0.5 B, writes a dtype copy and the matmul reads it back, bounded by memory bandwidth;
- output head (last stage): 2·T·h·V forward, the same backward (+ weight gradient if full).
Time = FLOPs / (peak · efficiency) + layers · overhead. The efficiency stands for everything a
roofline misses (kernel launch, normalisations, the optimizer step): one number the user may
tune (``CostSettings.efficiency``), or a card's own where its catalog entry gives one it
measured (``GpuSpec.efficiency``; likewise the overhead, ``GpuSpec.layer_overhead_ms``).

Memory (bytes): weights in their precision (4-bit + a fp32 absmax per 64 for qlora), LoRA
parameters with fp32 weight, gradient and two Adam moments (16 B each), or for full training
weights + gradients in dtype + two fp32 Adam moments; activations saved for backward for each
micro-batch in flight (1F1B: stage k of P holds min(M, P - k)), the norms' inputs in fp32;
the logits, the fp32 log-probabilities and two fp32 gradients on the last stage; a fixed
reserve for the CUDA context and a margin of the GPU's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from relaytrain_contract.families import family

from relaytrain_operator.domain.planner import targets
from relaytrain_operator.domain.planner.catalog import GpuSpec
from relaytrain_operator.domain.planner.model_shape import EXPERT_NAMES, ModelShape
from relaytrain_operator.domain.planner.pools import Pool
from relaytrain_operator.domain.planner.targets import check_lora_targets, expert_lora_weights
from relaytrain_operator.domain.planner.training import TrainingShape

MIB = 1 << 20
#: LoRA parameters one decoder layer gets (planner/targets.py; named here for sync.py).
lora_params_per_layer = targets.lora_params_per_layer
GIB = 1 << 30

#: ``delta`` with ``pipeline.activationBasis: fitted`` (relaytrain_worker.pipeline.transform),
#: device bytes per h^2 (h the hidden size): a stage that sends activations holds two second
#: moments in float64 and two bases in float32 (16 + 8), one that receives them two bases (8).
BASIS_SEND_BYTES_PER_H2 = 24
BASIS_RECEIVE_BYTES_PER_H2 = 8
#: 4-bit NF4 weight plus one fp32 absmax per block of 64 (bitsandbytes, no double quant).
QLORA_BYTES_PER_PARAM = 0.5 + 4 / 64
#: Bytes of trainable state per parameter kept in fp32: weight, gradient, Adam m and v.
FP32_TRAINABLE_BYTES = 16
#: Adam's two moments in fp32.
ADAM_BYTES = 8
#: Bytes of a float32 value (what norms and the loss compute in, whatever the dtype).
FP32 = 4
#: How several pipelines reduce their gradients (planner/sync.py).
Collective = Literal["all-gather", "ring"]
COLLECTIVES: tuple[str, ...] = get_args(Collective)


@dataclass(frozen=True)
class CostSettings:
    """Knobs of the cost model that are not facts about the job or the hardware."""

    efficiency: float = 0.45
    """Fraction of peak matmul FLOP/s a stage reaches (model FLOPs utilisation) on a card
    whose catalog entry measured none (`GpuSpec.efficiency`)."""
    memory_efficiency: float = 0.7
    """Fraction of peak memory bandwidth reached by qlora dequantisation."""
    memory_margin: float = 0.10
    """Fraction of each GPU's memory never planned for (fragmentation, spikes)."""
    reserved_mib: int = 1024
    """Memory taken before training starts: CUDA context, allocator, libraries."""
    layer_overhead_seconds: float = 0.0
    """Fixed time per decoder layer per micro-batch that FLOPs do not see (kernel launches,
    framework dispatch) on a card whose catalog entry measured none
    (`GpuSpec.layer_overhead_ms`). 0 by default; bench/bench_plan_vs_measured.py fits about 3
    ms on CPU stages, where it brings held-out step-time error from 16-35 % to under 8 %."""
    sync_collective: Collective = "all-gather"
    """How several pipelines reduce their gradients (planner/sync.py): ``all-gather``, what
    the worker does (every holder sends to every other holder), or ``ring``."""

    def efficiency_of(self, gpu: GpuSpec) -> float:
        """The share of ``gpu``'s peak its stages are priced at: its catalog entry's measured
        one, else ``efficiency``."""
        return self.efficiency if gpu.efficiency is None else gpu.efficiency

    def layer_overhead_of(self, gpu: GpuSpec) -> float:
        """Seconds per decoder layer and micro-batch beyond the FLOPs on ``gpu``: its catalog
        entry's measured overhead, else ``layer_overhead_seconds``."""
        measured = gpu.layer_overhead_ms
        return self.layer_overhead_seconds if measured is None else measured / 1000

    def usable_bytes(self, memory_mib: int) -> int:
        """What a plan may use of a GPU of ``memory_mib``: less the margin and the reserve."""
        return int(memory_mib * MIB * (1 - self.memory_margin)) - self.reserved_mib * MIB

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if not 0 < self.memory_efficiency <= 1:
            raise ValueError(f"memory_efficiency must be in (0, 1], got {self.memory_efficiency}")
        if not 0 <= self.memory_margin < 1:
            raise ValueError(f"memory_margin must be in [0, 1), got {self.memory_margin}")
        if self.reserved_mib < 0:
            raise ValueError(f"reserved_mib must be >= 0, got {self.reserved_mib}")
        if self.sync_collective not in COLLECTIVES:
            raise ValueError(
                f"sync_collective must be one of {', '.join(COLLECTIVES)}, "
                f"got {self.sync_collective!r}"
            )
        if self.layer_overhead_seconds < 0:
            raise ValueError(
                f"layer_overhead_seconds must be >= 0, got {self.layer_overhead_seconds}"
            )


@dataclass(frozen=True)
class PoolCost:
    """Per-micro-batch time and memory of stages placed on one pool, for one job."""

    pool: Pool
    gpu: GpuSpec
    layer_seconds: float
    """Forward + backward compute of one decoder layer."""
    head_seconds: float
    """Forward + backward of the final norm and output head (last stage only)."""
    layer_static_bytes: int
    """Weights and trainable state of one decoder layer."""
    layer_activation_bytes: int
    """Activations one decoder layer saves for backward, per micro-batch in flight."""
    embed_bytes: int
    """Embedding weights and state (first stage)."""
    head_bytes: int
    """Output head and final norm weights and state (last stage); 0 when the head is tied
    to the embedding: the last stage then holds a copy of it (none when also first) and
    ``norm_bytes``."""
    logits_bytes: int
    """The loss's peak for one micro-batch (last stage): logits in dtype, fp32
    log-probabilities and two fp32 gradients."""
    workspace_bytes: int
    """Transient buffers every stage needs (qlora: a dequantised weight)."""
    available_bytes: int
    """Memory the plan may use on one GPU of this pool."""
    bandwidth_bytes_per_s: float
    latency_s: float
    layer_weight_bytes: int = 0
    """Of ``layer_static_bytes``, the base weights alone (what the checkpoint loads)."""
    embed_weight_bytes: int = 0
    """Of ``embed_bytes``, the embedding weights alone."""
    head_weight_bytes: int = 0
    """Of ``head_bytes``, the weights alone (0 when tied)."""
    norm_bytes: int = 0
    """The final norm's weight and state (last stage; part of ``head_bytes`` when untied)."""
    norm_weight_bytes: int = 0
    """Of ``norm_bytes``, the weight alone."""
    basis_send_bytes: int = 0
    """A fitted basis's moments and bases where a stage sends activations (not the last)."""
    basis_receive_bytes: int = 0
    """A fitted basis's bases where a stage receives activations (not the first)."""

    def fixed_seconds(self, first: bool, last: bool) -> float:
        """Compute time a stage pays beyond its decoder layers."""
        return self.head_seconds if last else 0.0

    def fixed_bytes(self, first: bool, last: bool) -> int:
        """Memory a stage needs beyond its decoder layers."""
        return (
            self.workspace_bytes
            + self.stage_static_bytes(0, first, last)
            + (self.logits_bytes if last else 0)
            + (0 if last else self.basis_send_bytes)
            + (0 if first else self.basis_receive_bytes)
        )

    def stage_static_bytes(self, layers: int, first: bool, last: bool) -> int:
        """Weights and training state a stage holds: its layers, the embedding if first,
        the final norm and head if last (a tied head is the embedding: once when also first)."""
        total = layers * self.layer_static_bytes
        if first:
            total += self.embed_bytes
        if last:
            total += self.head_bytes or (0 if first else self.embed_bytes) + self.norm_bytes
        return total

    def stage_weight_bytes(self, layers: int, first: bool, last: bool) -> int:
        """Base weights a stage holds: its layers, the embedding if first, the final norm
        and head if last (a tied head is the embedding: held once when also first)."""
        total = layers * self.layer_weight_bytes
        if first:
            total += self.embed_weight_bytes
        if last:
            tied = (0 if first else self.embed_weight_bytes) + self.norm_weight_bytes
            total += self.head_weight_bytes or tied
        return total

    def stage_bytes(self, layers: int, first: bool, last: bool, in_flight: int) -> int:
        """Memory of a stage holding ``layers`` decoder layers."""
        per_layer = self.layer_static_bytes + in_flight * self.layer_activation_bytes
        return layers * per_layer + self.fixed_bytes(first, last)

    def max_layers(self, first: bool, last: bool, in_flight: int) -> int:
        """Most decoder layers that fit on one GPU of this pool in that position."""
        room = self.available_bytes - self.fixed_bytes(first, last)
        per_layer = self.layer_static_bytes + in_flight * self.layer_activation_bytes
        return max(room // per_layer, 0) if room > 0 else 0


def step_flops(model: ModelShape, training: TrainingShape) -> tuple[float, float]:
    """FLOPs of one micro-batch, forward and backward: (one decoder layer, the output head).

    A layer's matmuls are priced at the weights a token multiplies by (its routed experts,
    the shared expert and the router in an MoE layer; the mean over layers where MoE and
    dense layers mix); attention at the (query, key) pairs it scores, averaged over the
    layers (sliding layers score at most their window).
    """
    tokens = training.tokens_per_micro_batch
    b, s = training.micro_batch_size, training.sequence_length
    h, v = model.hidden_size, model.vocab_size
    # QK^T and AV: 2 FLOPs per (query, key) pair and query dimension, each.
    attention = 4.0 * b * model.attention_pairs(s) * model.q_dim
    matmul = 2.0 * tokens * model.mean_active_matmul_params
    if training.method == "full":
        return 3 * matmul + 3 * attention, 3 * 2.0 * tokens * h * v
    r = training.lora_rank
    routed = tokens * model.experts_per_token / max(model.num_experts, 1)
    # An adapted expert weight is merged (W + B·A, every expert) in forward; its backward
    # forms the merged weight's gradient from the routed tokens, then those of A and B.
    experts = expert_lora_weights(model, training)
    expert_lora = sum(6.0 * n * r + 2.0 * routed * n for n in experts)
    linear_lora = lora_params_per_layer(model, training) - sum(
        r * sum(model.linear_shape(t)) * model.num_experts
        for t in training.lora_targets
        if t in EXPERT_NAMES
    )
    layer = 2 * matmul + 3 * attention + 6.0 * tokens * linear_lora + expert_lora
    return layer, 2 * 2.0 * tokens * h * v


def saved_bytes_per_token(model: ModelShape, training: TrainingShape) -> int:
    """Bytes one decoder layer saves for backward per token, as torch saves them
    (tests/unit/test_planner_memory.py counts a real layer's saved tensors in every dense
    family; the GPU check on an H200, 2026-11-27, found the peak 8-9.5 % above an estimate
    that counted the norms' inputs in dtype and no adapter intermediates).

    Each norm keeps its input upcast to fp32 and its fp32 rsqrt (and, when its weight
    trains, its output before the weight); so do q/k norms and the Gemma 2/3 output norms.
    Attention keeps q, k and v after the rotary embedding (eager attention: k and v repeated
    to every query head), its output and an fp32 log-sum-exp per head; the MLP its gate, up
    and act(gate) outputs - per routed expert, and the shared expert's. A frozen linear
    keeps no input, so a norm's output (the next linears' input) and the MLP's product (the
    down projection's) are kept only where a linear reading them trains; every adapter
    keeps its rank-wide x·A for B's gradient. Phi-3's fused qkv output is kept whole (v is
    a view of it) and its attention output copied for o_proj. MoE layers are counted as if
    every input were kept.
    """
    e, h, q, kv = training.dtype_bytes, model.hidden_size, model.q_dim, model.kv_dim
    full = training.method == "full"
    adapted = set(training.lora_targets) if not full else set()
    kind = family(model.model_type)

    def read_by(*names: str) -> bool:
        return full or model.moe or bool(adapted.intersection(names))

    mlp = 3 * model.intermediate_size
    product = model.intermediate_size if read_by("down_proj", "gate_up_proj") else 0
    if model.moe:
        routed = 4 * model.intermediate_size * model.experts_per_token
        mlp = routed + 4 * model.shared_expert_size + 2 * model.num_experts
        product = 0
        if model.dense_layers:
            mlp = max(mlp, 4 * model.dense_intermediate_size)
    normed = h * (read_by("q_proj", "k_proj", "v_proj", "qkv_proj")
                  + read_by("gate_proj", "up_proj", "gate_up_proj"))  # fmt: skip
    modules = {kind.fused.get(t, t) for t in adapted if t not in EXPERT_NAMES}
    keys = q if model.eager_attention else kv  # eager repeats k and v to every head
    elems = normed + 2 * q + 2 * keys + mlp + product + training.lora_rank * len(modules)
    elems += 2 * h if full else 0  # the norms' weights train: their input to the weight
    elems += 2 * q + kv if kind.fused else 0
    norms = (4 if kind.post_norms else 2) * (h + 1)
    if kind.qk_norm:
        norms += q + kv + (model.num_heads + model.num_kv_heads if kind.qk_norm == "head" else 2)
    return elems * e + (norms + model.num_heads) * FP32


def pool_cost(
    model: ModelShape,
    training: TrainingShape,
    pool: Pool,
    gpu: GpuSpec,
    settings: CostSettings,
) -> PoolCost:
    """Cost of placing stages of this job on one GPU of ``pool``.

    Raises LoraTargetError (a PlanError) for LoRA targets the model's family does not have.
    """
    check_lora_targets(model, training)
    tokens = training.tokens_per_micro_batch
    b, s = training.micro_batch_size, training.sequence_length
    e = training.dtype_bytes
    h, v = model.hidden_size, model.vocab_size
    w = model.layer_matmul_params  # in memory: every expert
    flops_per_s = gpu.peak_flops(training.dtype) * settings.efficiency_of(gpu)
    lora = lora_params_per_layer(model, training)
    experts = expert_lora_weights(model, training)
    layer_flops, head_flops = step_flops(model, training)
    layer_seconds = layer_flops / flops_per_s + settings.layer_overhead_of(gpu)
    linear = model.layer_linear_params  # nn.Linear weights: what qlora quantises
    if training.method == "qlora":
        # Two dequantisations per step of each weight: read 0.5 B, write and re-read e bytes.
        dequant_bytes = 2 * linear * (QLORA_BYTES_PER_PARAM + 2 * e)
        bandwidth = gpu.memory_bandwidth_gbs * 1e9 * settings.memory_efficiency
        layer_seconds += dequant_bytes / bandwidth

    other = model.layer_params - w  # biases, norms, sinks: kept in dtype, frozen unless full
    if training.method == "full":
        layer_weights = model.layer_params * e
        layer_static = model.layer_params * (2 * e + ADAM_BYTES)
        embed_weights = model.embedding_params * e
        embed = model.embedding_params * (2 * e + ADAM_BYTES)
    else:
        weight_bytes = QLORA_BYTES_PER_PARAM if training.method == "qlora" else e
        # Expert weights and routers are 3-D parameters, not nn.Linear: qlora leaves them
        # in dtype (bitsandbytes quantises Linear modules only).
        layer_weights = int(linear * weight_bytes) + (w - linear + other) * e
        layer_static = layer_weights + lora * FP32_TRAINABLE_BYTES
        embed_weights = model.embedding_params * e
        embed = embed_weights
    # The last stage needs the head; with tied embeddings it is the embedding matrix, which
    # a last stage that is also first already holds (head_bytes 0 signals "tied"). The
    # final norm is the last stage's too.
    norm = h * (2 * e + ADAM_BYTES if training.method == "full" else e)
    head = 0 if model.tie_word_embeddings else embed + norm
    head_weights = 0 if model.tie_word_embeddings else embed_weights + h * e

    activation = tokens * saved_bytes_per_token(model, training)
    if model.eager_attention:
        # Eager attention keeps every score: softmax output in fp32, its dtype copy for AV,
        # and (soft-capped, Gemma 2) the tanh output.
        score_bytes = 4 + e + (e if model.model_type == "gemma2" else 0)
        activation += b * model.num_heads * s * s * score_bytes
    workspace = 0
    if training.method == "qlora":
        largest = max(a * b for a, b in map(model.linear_shape, ("q_proj", "gate_proj")))
        workspace = 2 * largest * e
    if experts:
        workspace += 2 * max(experts) * e  # a merged expert weight and its gradient
    # The loss's peak, in its backward: the logits in dtype, the fp32 log-probabilities
    # cross-entropy saved, the gradient it gets and the one it returns (fp32 both).
    logits = tokens * v * (e + 12 + (e if model.logit_softcapping else 0))
    fitted = training.compression == "delta" and training.activation_basis == "fitted"
    memory_mib = pool.memory_mib if pool.memory_mib is not None else gpu.memory_mib
    available = settings.usable_bytes(memory_mib)
    return PoolCost(
        pool=pool,
        gpu=gpu,
        layer_seconds=layer_seconds,
        head_seconds=head_flops / flops_per_s,
        layer_static_bytes=int(layer_static),
        layer_activation_bytes=int(activation),
        embed_bytes=int(embed),
        head_bytes=int(head),
        logits_bytes=int(logits),
        workspace_bytes=int(workspace),
        available_bytes=available,
        bandwidth_bytes_per_s=pool.link_bandwidth_mbps * 1e6 / 8,
        latency_s=pool.link_latency_ms / 1000,
        layer_weight_bytes=int(layer_weights),
        embed_weight_bytes=int(embed_weights),
        head_weight_bytes=int(head_weights),
        norm_bytes=int(norm),
        norm_weight_bytes=h * e,
        basis_send_bytes=BASIS_SEND_BYTES_PER_H2 * h * h if fitted else 0,
        basis_receive_bytes=BASIS_RECEIVE_BYTES_PER_H2 * h * h if fitted else 0,
    )
