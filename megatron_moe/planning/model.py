"""What one training step costs on a layout: memory per GPU and step time, from the model's shape and a cluster.

Legend: T = tokens of a micro-batch on a rank (micro-batch x seq / CP), Ts = T / (TP under sequence parallelism),
h = hidden, F = an expert's FFN width, F' = the dense MLP's, E = experts, k = top-k, L = layers, v = model chunks
per pipeline rank (VPP), m = micro-batches per step, d = bytes of the run's dtype.

Memory per GPU (the largest over pipeline stages): weights, gradients and sharded optimizer state per parameter,
plus activations under the policy times the layer-micro-batches a stage holds under (interleaved) 1F1B.
Step time: step = m t + (p - 1) / v x t + exposed DP + optimizer, t the slowest stage's time per micro-batch
(compute plus exposed communication; the MoE layer's from the overlap cost model).
Inputs: a `Shape` (the model) and a `Layout` (degrees, micro-batch, policy). Outputs: bytes per GPU here
(`memory_per_gpu`); the step time in step.py (`predict_step`).
Every term's derivation: docs/internals/planning.md.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config import RunConfig
from megatron_moe.config.fields import require

PLACEMENTS = ("e+d", "d+e")
"""e+d: an expert group's ranks adjacent (inside a node), its replicas E ranks apart; d+e: the replicas of an
expert adjacent, the EP group spread (Arctic's D + E)."""
A2A_ALGORITHMS = ("linear", "2dh")
POLICIES = ("none", "arctic", "full")
ARCTIC_TIME = 1.30
"""The layers' compute under --activation-policy arctic over none: measured on one H100 (one MoE layer, GPT2-S
shapes, 13.3 -> 17.3 ms; docs/benchmarks.md), its quantize kernels unfused; 1.06 on the CPU machine."""
QUANT_BYTES = 1
"""A value kept quantized (int8 or fp8; the per-row scales are left out)."""
OPTIMIZER_BYTES = 34
"""Adam per parameter: reads the fp32 master, gradient and two moments, writes them and the d-byte weight, and
the gradient norm's read."""
MAX_DEGREE = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """The model as the planner needs it (from a `RunConfig`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    seq: int
    ffn: int
    expert_ffn: int
    experts: int
    topk: int
    moe_pattern: tuple[int, ...]
    gated: bool
    vocab: int
    make_vocab_divisible_by: int
    untied: bool
    dtype: str
    global_batch: int
    flash_attention: bool
    rope: bool = True
    capacity_factor: float | None = None
    padded: bool = False
    own_layer: bool = True

    @classmethod
    def from_config(cls, cfg: RunConfig, vocab_size: int, flash_attention: bool) -> Shape:
        m, moe, t = cfg.model, cfg.moe, cfg.training
        require(moe.is_moe, "--num-experts", None, "give the experts per MoE layer, e.g. 8 (the planner is for MoE)")
        require(t.global_batch_size is not None, "--global-batch-size", None, "give the samples per step, e.g. 256")
        return cls(
            layers=m.num_layers,
            hidden=m.hidden_size,
            heads=m.num_attention_heads,
            kv_heads=m.num_query_groups or m.num_attention_heads,
            seq=m.seq_length,
            ffn=m.ffn_width,
            expert_ffn=moe.expert_ffn_width(m),
            experts=moe.num_experts,
            topk=moe.moe_router_topk,
            moe_pattern=tuple(moe.layer_pattern(m.num_layers)),
            gated=m.swiglu,
            vocab=vocab_size,
            make_vocab_divisible_by=m.make_vocab_size_divisible_by,
            untied=m.untie_embeddings_and_output_weights,
            dtype="bf16" if t.bf16 else "fp16" if t.fp16 else "fp32",
            global_batch=t.global_batch_size,
            flash_attention=flash_attention,
            rope=m.position_embedding_type == "rope",
            capacity_factor=moe.moe_expert_capacity_factor,
            padded=moe.moe_pad_expert_input_to_capacity,
            own_layer=moe.own_layer,
        )

    @property
    def d(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def kv(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def mats(self) -> int:
        return 3 if self.gated else 2

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_divisible_by * tp
        return -(-self.vocab // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """One candidate: the parallel degrees (CP = 1), the micro-batch, the expert placement, the all-to-all
    algorithm and the activation policy."""

    tp: int
    pp: int
    vpp: int
    ep: int
    esp: int
    dp: int
    micro_batch: int
    placement: str = "e+d"
    a2a: str = "linear"
    activations: str = "none"
    degrees: tuple[int, int] | None = None
    """The MoE pipeline's degrees (forward, backward); None: the ones the cost model picks (as the runtime's auto)."""
    overlap_dp: bool = True
    """The data-parallel reduction runs under backward (--overlap-grad-reduce, or the adaptive schedule)."""
    distributed_optimizer: bool = True
    """Optimizer state sharded over DP and the gradients reduce-scattered (else all-reduced, the state whole)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.dp // (self.ep * self.esp)

    @property
    def sp(self) -> int:
        return self.tp

    def label(self) -> str:
        return (
            f"TP{self.tp} PP{self.pp} VPP{self.vpp} EP{self.ep} ESP{self.esp} DP{self.dp} mbs{self.micro_batch} "
            f"{self.placement} {self.a2a} {self.activations}"
        )


# --- memory ---------------------------------------------------------------------------------------------------


def layer_params(shape: Shape, lay: Layout, moe: bool) -> tuple[float, float]:
    """(dense, expert) weights of one layer on one rank: attention's QKV and projection / TP, the norms, and the
    router with E / EP experts of F / ESP width, or the dense MLP / TP."""
    h = shape.hidden
    dense = (h * (h + 2 * shape.kv) + h * h) / lay.tp + 2 * h
    if not moe:
        return dense + shape.mats * h * shape.ffn / lay.tp, 0.0
    return dense + h * shape.experts, shape.experts / lay.ep * shape.mats * h * shape.expert_ffn / lay.esp


def stage_layers(shape: Shape, lay: Layout, stage: int) -> tuple[int, int]:
    """(MoE layers, dense layers) on one rank of pipeline stage `stage`, over its model chunks (chunk c of rank s
    holds the layers of virtual stage c x PP + s)."""
    per_chunk = shape.layers // (lay.pp * lay.vpp)
    pattern = [
        shape.moe_pattern[(c * lay.pp + stage) * per_chunk + i] for c in range(lay.vpp) for i in range(per_chunk)
    ]
    return sum(pattern), len(pattern) - sum(pattern)


def stage_params(shape: Shape, lay: Layout, stage: int) -> tuple[float, float]:
    """(dense, expert) weights on one rank of pipeline stage `stage`: its layers, the embedding on the first,
    the output layer (untied, or a copy of the tied embedding under PP) and final norm on the last."""
    moe, plain = stage_layers(shape, lay, stage)
    (moe_dense, moe_expert), (plain_dense, _) = layer_params(shape, lay, True), layer_params(shape, lay, False)
    dense, expert = moe * moe_dense + plain * plain_dense, moe * moe_expert
    table = shape.padded_vocab(lay.tp) * shape.hidden / lay.tp
    if stage == 0:
        dense += table
    if stage == lay.pp - 1:
        dense += shape.hidden + (table if shape.untied or lay.pp > 1 else 0.0)
    return dense, expert


def param_bytes(shape: Shape, lay: Layout, dense: float, expert: float) -> float:
    """Weight, gradient and sharded optimizer state (docs/internals/planning.md, model.py)."""
    state = 8 if shape.dtype == "fp32" else 12
    dp, expert_dp = (lay.dp, lay.expert_dp) if lay.distributed_optimizer else (1, 1)
    return dense * (shape.d + 4 + state / dp) + expert * (shape.d + 4 + state / expert_dp)


def activation_bytes(shape: Shape, lay: Layout, moe: bool, policy: str) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one rank, under policy none or arctic (module
    docstring; each tensor once, in the mode the module that keeps it has). Against the exact count of
    tools/bench_activation_memory.py (one MoE layer at GPT2-S shapes, fp32, unfused attention: 129.9 MB kept
    without a policy, 26.3 MB under arctic) this gives 0.97 and 0.90 of it: index tensors, the causal mask and the
    norms' statistics are left out, and arctic's per-row scales."""
    require(policy in ("none", "arctic"), "policy", policy, "none or arctic (full: `layer_activations`)")
    h, d, tp = shape.hidden, shape.d, lay.tp
    t = lay.micro_batch * shape.seq
    ts = t / lay.sp
    quant = policy == "arctic"

    def kept(elements: float, recomputed: bool = False) -> float:
        return 0.0 if quant and recomputed else elements * (QUANT_BYTES if quant else d)

    total = kept(ts * h)  # the layer's input, for input_norm
    total += kept(ts * h, recomputed=True)  # input_norm's output, for QKV
    total += kept(t * (h + 2 * shape.kv) / tp)  # QKV's output, for the attention core (V is a view of it)
    if shape.rope:  # the rotated Q and K, new tensors
        total += kept(t * (h + shape.kv) / tp)
    if shape.flash_attention:  # its output (also the projection's input) and the softmax's log-sum-exp
        total += kept(t * h / tp) + t * shape.heads / tp * 4
    else:  # the softmax's probabilities, and the projection's input
        total += kept(lay.micro_batch * shape.heads / tp * shape.seq * shape.seq) + kept(t * h / tp)
    total += kept(ts * h)  # the residual, for pre_mlp_norm
    total += kept(ts * h, recomputed=True)  # pre_mlp_norm's output, for the router or fc1
    if not moe:
        width = shape.ffn / tp
        return total + kept(t * width * (2 if shape.gated else 1)) + kept(t * width, recomputed=True)
    rows = ts * shape.topk * lay.esp  # rows at this rank's experts (ESP gathers its peers')
    width = shape.expert_ffn / lay.esp
    total += ts * shape.experts * 4  # the router's fp32 scores
    total += kept(rows * h)  # the dispatched rows, for fc1
    total += kept(rows * width * (2 if shape.gated else 1))  # fc1's output, for the activation
    total += kept(rows * width, recomputed=True)  # the activation's output, for fc2
    total += 2 * kept(ts * shape.topk * h)  # the combined rows and their gate-weighted copy, for the unorder
    return total


def layer_activations(shape: Shape, lay: Layout, moe: bool) -> float:
    """Bytes one layer holds per in-flight micro-batch under the layout's policy (full: its input)."""
    if lay.activations == "full":
        return lay.micro_batch * shape.seq / lay.sp * shape.hidden * shape.d
    return activation_bytes(shape, lay, moe, lay.activations)


def in_flight_chunks(lay: Layout, stage: int, microbatches: int) -> int:
    """Model chunks x micro-batches whose activations stage `stage` holds at once (docs/internals/planning.md)."""
    if lay.vpp == 1:
        return min(lay.pp - stage, microbatches)
    warmup = (lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp
    return min(warmup + 1, microbatches * lay.vpp)


def stage_memory(shape: Shape, lay: Layout, stage: int, microbatches: int) -> dict[str, float]:
    """Bytes on one rank of `stage`: "weights" (with gradients and optimizer state), "activations", "total"."""
    dense, expert = stage_params(shape, lay, stage)
    moe, plain = stage_layers(shape, lay, stage)
    kinds = [is_moe for is_moe, count in ((True, moe), (False, plain)) if count]
    per_layer = (moe * layer_activations(shape, lay, True) + plain * layer_activations(shape, lay, False)) / (
        moe + plain
    )
    activations = per_layer * (moe + plain) / lay.vpp * in_flight_chunks(lay, stage, microbatches)
    if lay.activations == "full":  # one layer recomputed whole in backward
        activations += max(activation_bytes(shape, lay, is_moe, "none") for is_moe in kinds)
    if stage == lay.pp - 1:  # the logits, d bytes and fp32 for the loss
        activations += lay.micro_batch * shape.seq * shape.padded_vocab(lay.tp) / lay.tp * (shape.d + 4)
    weights = param_bytes(shape, lay, dense, expert)
    return {"weights": weights, "activations": activations, "total": weights + activations}


def memory_per_gpu(shape: Shape, lay: Layout, microbatches: int) -> dict[str, float]:
    """The stage that needs the most, its bytes and which it is."""
    stages = [stage_memory(shape, lay, s, microbatches) for s in range(lay.pp)]
    worst = max(range(lay.pp), key=lambda s: stages[s]["total"])
    return {**stages[worst], "stage": worst}
