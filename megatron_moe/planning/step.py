"""The step time of a layout (the model: docs/internals/planning.md).

`predict_step` gives a `Prediction`: the step's ms split into where the time goes (`breakdown`, which sums to
the step), memory per GPU, throughput, and the MoE layer's pipeline degrees the runtime's cost model picks.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_moe.overlap.cost_model import ClusterFits, LayerSizes, predict, required_gain
from megatron_moe.planning.hardware import Cluster, Compute, GroupShape
from megatron_moe.planning.model import (
    ARCTIC_TIME,
    MAX_DEGREE,
    OPTIMIZER_BYTES,
    Layout,
    Shape,
    memory_per_gpu,
    stage_layers,
    stage_params,
)

GEMM_ALPHA_MS = 0.01
"""Start-up of one chunk of the experts (two GEMM launches and the chunk's bookkeeping)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoETimes:
    """One MoE layer, one micro-batch, on one rank (ms)."""

    forward_ms: float
    backward_ms: float
    experts_forward_ms: float
    experts_backward_ms: float
    degrees: tuple[int, int]
    """The pipeline degrees (forward, backward) the cost model picks."""

    @property
    def exposed_forward_ms(self) -> float:
        return max(0.0, self.forward_ms - self.experts_forward_ms)

    @property
    def exposed_backward_ms(self) -> float:
        return max(0.0, self.backward_ms - self.experts_backward_ms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    layout: Layout
    step_ms: float
    breakdown: dict[str, float]
    """Per step, ms: compute, bubble, ep (exposed all-to-all and ESP), tp, pp (point-to-point), dp, optimizer."""
    memory: dict[str, float]
    microbatches: int
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    moe: MoETimes | None
    per_microbatch: dict[str, float]
    """The slowest stage's ms per micro-batch: compute, ep, tp, pp (their sum is t of the bubble formula)."""


@functools.lru_cache(maxsize=4096)
def groups(lay: Layout, gpus_per_node: int) -> dict[str, GroupShape]:
    """How each group of the layout lies on the nodes. megatron-core orders ranks tp (innermost), cp, dp, pp; in a
    pipeline stage the expert ranks esp (innermost), then ep and expert-dp (e+d) or expert-dp and ep (d+e)."""
    edp = lay.expert_dp
    ep_stride, edp_stride = (lay.esp, lay.esp * lay.ep) if lay.placement == "e+d" else (lay.esp * edp, lay.esp)
    return {
        "tp": GroupShape.of(lay.tp, 1, gpus_per_node),
        "dp": GroupShape.of(lay.dp, lay.tp, gpus_per_node),
        "esp": GroupShape.of(lay.esp, 1, gpus_per_node),
        "ep": GroupShape.of(lay.ep, ep_stride, gpus_per_node),
        "edp": GroupShape.of(edp, edp_stride, gpus_per_node),
    }


def moe_sizes(shape: Shape, lay: Layout) -> LayerSizes:
    return LayerSizes.from_layer(
        tokens=lay.micro_batch * shape.seq // lay.sp,
        topk=shape.topk,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.expert_ffn,
        num_experts=shape.experts,
        ep=lay.ep,
        esp=lay.esp,
        capacity_factor=shape.capacity_factor,
        padded=shape.padded,
        dtype_bytes=shape.d,
        gated=shape.gated,
    )


def layer_fits(shape: Shape, lay: Layout, cluster: Cluster, compute: Compute, sizes: LayerSizes) -> ClusterFits:
    """The cost model's lines for this layout: the all-to-all over the EP group, ring all-gather / reduce-scatter
    over ESP, and the experts' GEMMs at the rate of one local expert's calls."""
    shapes = groups(lay, cluster.gpus_per_node)
    a2a = cluster.a2a_line(shapes["ep"], lay.a2a)
    ring = cluster.ring_line(shapes["esp"])
    local_experts = shape.experts // lay.ep
    call = 2 * sizes.n_exp / local_experts / 2  # FLOPs of one of a local expert's two GEMM calls
    per_mac = compute.gemm_ms(2 * sizes.n_exp, call) / sizes.n_exp if sizes.n_exp > 0 else 0.0
    alpha = {"a2a": a2a[0], "ag": ring[0], "rs": ring[0], "ar": 0.0, "gemm": GEMM_ALPHA_MS}
    beta = {"a2a": a2a[1], "ag": ring[1], "rs": ring[1], "ar": 0.0, "gemm": per_mac}
    return ClusterFits.from_coefficients(alpha, beta)


def _best_degree(fits: ClusterFits, sizes: LayerSizes, direction: str) -> tuple[int, float]:
    """The degree in 1..MAX_DEGREE the cost model predicts fastest, kept only where it saves `required_gain` of
    r = 1's time (the runtime's rule, `solve_degrees`); every integer is evaluated, no solver needed."""
    times = {r: predict(fits, sizes, r, r).predicted_ms[direction] for r in range(1, MAX_DEGREE + 1)}
    best = min(times, key=lambda r: (times[r], r))
    if sizes.ep == 1 or times[best] > (1.0 - required_gain(fits, direction)) * times[1]:
        return 1, times[1]
    return best, times[best]


def moe_times(shape: Shape, lay: Layout, cluster: Cluster, compute: Compute) -> MoETimes:
    """One MoE layer's forward and backward with the weight gradients in it (the cost model's `dw_in_backward`:
    Lancet's deferral moves them under other all-to-alls, which this leaves out)."""
    unused = {"pp": 1, "vpp": 1, "activations": "none", "overlap_dp": True, "distributed_optimizer": True}
    return _moe_times(shape, dataclasses.replace(lay, **unused), cluster, compute)


@functools.lru_cache(maxsize=4096)
def _moe_times(shape: Shape, lay: Layout, cluster: Cluster, compute: Compute) -> MoETimes:
    sizes = moe_sizes(shape, lay)
    fits = layer_fits(shape, lay, cluster, compute, sizes)
    if lay.degrees is None:
        forward, forward_ms = _best_degree(fits, sizes, "forward")
        backward, backward_ms = _best_degree(fits, sizes, "backward")
    else:
        forward, backward = lay.degrees
        times = predict(fits, sizes, forward, backward).predicted_ms
        forward_ms, backward_ms = times["forward"], times["backward"]
    experts = fits["gemm"].time_ms(sizes.n_exp)
    return MoETimes(
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        experts_forward_ms=experts,
        experts_backward_ms=2 * experts,
        degrees=(forward, backward),
    )


def dense_forward_ms(shape: Shape, lay: Layout, compute: Compute, moe: bool) -> float:
    """One layer's forward GEMMs but the experts, one micro-batch, one rank: QKV, the attention core (the full
    s x s square, as Megatron-LM counts it), the projection, and the router or the dense MLP."""
    h, tp = shape.hidden, lay.tp
    t = lay.micro_batch * shape.seq
    gemms = [
        2 * t * h * (h + 2 * shape.kv) / tp,
        4 * t * shape.seq * h / tp,
        2 * t * h * h / tp,
    ]
    if moe:
        gemms.append(2 * t / lay.sp * h * shape.experts)
    else:
        gemms += [2 * t * h * shape.ffn * (2 if shape.gated else 1) / tp, 2 * t * shape.ffn * h / tp]
    return sum(compute.gemm_ms(f) for f in gemms)


def tp_ms(shape: Shape, lay: Layout, cluster: Cluster, moe: bool) -> float:
    """One layer's TP all-gather and reduce-scatter in one direction (around attention, and a dense MLP)."""
    if lay.tp == 1:
        return 0.0
    nbytes = lay.micro_batch * shape.seq * shape.hidden * shape.d
    pairs = 1 if moe else 2
    return pairs * 2 * cluster.ring_ms(groups(lay, cluster.gpus_per_node)["tp"], nbytes)


def stage_microbatch(
    shape: Shape, lay: Layout, cluster: Cluster, compute: Compute, stage: int, moe: MoETimes | None
) -> dict[str, float]:
    """One pipeline stage's ms per micro-batch: compute, ep, tp, pp. Forward and backward together, with full
    recompute's second forward; the last stage also runs the output layer."""
    moe_layers, plain_layers = stage_layers(shape, lay, stage)
    forwards = 2 if lay.activations == "full" else 1
    compute_ms = ep_ms = comm_tp = 0.0
    for is_moe, count in ((True, moe_layers), (False, plain_layers)):
        if not count:
            continue
        fwd = dense_forward_ms(shape, lay, compute, is_moe) + (moe.experts_forward_ms if is_moe else 0.0)
        compute_ms += count * fwd * (forwards + 2) * (ARCTIC_TIME if lay.activations == "arctic" else 1.0)
        if is_moe:
            ep_ms += count * (forwards * moe.exposed_forward_ms + moe.exposed_backward_ms)
        comm_tp += count * (forwards + 1) * tp_ms(shape, lay, cluster, is_moe)
    t = lay.micro_batch * shape.seq
    if stage == lay.pp - 1:
        compute_ms += 3 * compute.gemm_ms(2 * t * shape.hidden * shape.padded_vocab(lay.tp) / lay.tp)
    p2p = 0.0
    if lay.pp > 1:
        nbytes = t / lay.sp * shape.hidden * shape.d
        p2p = 2 * lay.vpp * cluster.p2p_ms(nbytes, across_nodes=cluster.nodes > 1)
    return {"compute": compute_ms, "ep": ep_ms, "tp": comm_tp, "pp": p2p}


def per_microbatch(shape: Shape, lay: Layout, cluster: Cluster, compute: Compute) -> tuple[dict, MoETimes | None]:
    """The slowest stage's `stage_microbatch` (every stage runs at its pace), and the MoE layer's times. On a
    host whose cores all the processes share (`Compute.host_cores`, fewer than the processes), a stage with less
    work waits for its neighbours and lends them its core time: the pipeline computes at the stages' mean pace
    (its waits on links do not pool)."""
    moe = moe_times(shape, lay, cluster, compute) if any(shape.moe_pattern) else None
    stages = [stage_microbatch(shape, lay, cluster, compute, s, moe) for s in range(lay.pp)]
    slowest = max(stages, key=lambda parts: sum(parts.values()))
    if 0 < compute.host_cores < lay.world:
        slowest = {**slowest, "compute": sum(s["compute"] for s in stages) / lay.pp}
    return slowest, moe


def dp_ms(shape: Shape, lay: Layout, cluster: Cluster, window_bwd_ms: float, window_fwd_ms: float) -> float:
    """The exposed reduce-scatter of the gradients and all-gather of the weights (distributed optimizer; without
    it an all-reduce of the gradients, a reduce-scatter and an all-gather of fp32) over DP and expert-DP, for the
    stage with the most weights (docs/internals/planning.md, model.py); all of it without overlap."""
    shapes = groups(lay, cluster.gpus_per_node)
    dense, expert = max((stage_params(shape, lay, s) for s in range(lay.pp)), key=sum)
    d = shape.d if lay.distributed_optimizer else 4
    scatter = cluster.dp_ring_ms(shapes["dp"], dense * 4) + cluster.dp_ring_ms(shapes["edp"], expert * 4)
    gather = cluster.dp_ring_ms(shapes["dp"], dense * d) + cluster.dp_ring_ms(shapes["edp"], expert * d)
    if not lay.overlap_dp:
        return scatter + gather
    share = 1.0 / (shape.layers // lay.pp)
    return max(scatter - window_bwd_ms, scatter * share) + max(gather - window_fwd_ms, gather * share)


def predict_step(
    shape: Shape,
    lay: Layout,
    cluster: Cluster,
    compute: Compute,
    flops_per_token: float,
    *,
    memory: dict[str, float] | None = None,
) -> Prediction:
    """The layout's step (docs/internals/planning.md, model.py); `memory`: its `memory_per_gpu` where known."""
    m = shape.global_batch // (lay.micro_batch * lay.dp)
    parts, moe = per_microbatch(shape, lay, cluster, compute)
    t = sum(parts.values())
    # in the bubble one stage's processes compute; on a shared host (cpu) they run faster on the idle ones' cores
    bubble = (lay.pp - 1) / lay.vpp * t / compute.busy_rate(lay.world, lay.world // lay.pp)
    backward_share = 2 / (3 if lay.activations != "full" else 4)
    dp = dp_ms(shape, lay, cluster, parts["compute"] * backward_share, parts["compute"] / 3)
    dense, expert = max((stage_params(shape, lay, s) for s in range(lay.pp)), key=sum)
    local = dense / lay.dp + expert / lay.expert_dp if lay.distributed_optimizer else dense + expert
    optimizer = compute.memory_ms(local * OPTIMIZER_BYTES)
    breakdown = {
        "compute": m * parts["compute"],
        "bubble": bubble,
        "ep": m * parts["ep"],
        "tp": m * parts["tp"],
        "pp": m * parts["pp"],
        "dp": dp,
        "optimizer": optimizer,
    }
    step = sum(breakdown.values())
    tokens = shape.global_batch * shape.seq
    world = lay.world
    return Prediction(
        layout=lay,
        step_ms=step,
        breakdown=breakdown,
        memory=memory if memory is not None else memory_per_gpu(shape, lay, m),
        microbatches=m,
        tokens_per_s_per_gpu=tokens / (step / 1e3) / world,
        tflops_per_gpu=flops_per_token * tokens / (step / 1e3) / world / 1e12,
        moe=moe,
        per_microbatch=parts,
    )
