"""Each MoE layer's pipeline degrees for a run: its flags -> `LayerSizes` -> `solve_degrees` (FSMoE Algorithm 1).

What the training set-up calls to resolve `--moe-pipeline-degree auto` / `--moe-bp-pipeline-degree auto` (with
the fits of `megatron_moe.overlap.profiler.load_or_measure`), and what tools/plan_schedule.py prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.overlap.cost_model import ClusterFits, LayerSizes, Schedule, solve_degrees

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig


def layer_sizes(cfg: RunConfig) -> LayerSizes:
    """One MoE layer's sizes on one rank, from the run's flags: tokens per rank = micro-batch x seq-length /
    (TP under sequence parallelism) / CP; 2-byte rows under --bf16 / --fp16, else 4."""
    model, moe, training = cfg.model, cfg.moe, cfg.training
    dims = ParallelDims.from_config(cfg.parallel)
    split = dims.token_split
    tokens = training.micro_batch_size * model.seq_length
    require(
        tokens % split == 0,
        "--seq-length",
        model.seq_length,
        f"micro-batch x seq-length = {tokens} tokens must split over (TP under SP) x CP = {split}",
    )
    layer = moe.layer_config(model)
    return LayerSizes.from_layer(
        tokens=tokens // split,
        topk=layer.topk,
        hidden_size=layer.hidden_size,
        ffn_hidden_size=layer.ffn_hidden_size,
        num_experts=layer.num_experts,
        ep=dims.ep,
        esp=dims.esp,
        capacity_factor=layer.capacity_factor,
        padded=layer.pad_expert_input_to_capacity,
        dtype_bytes=2 if (training.bf16 or training.fp16) else 4,
        gated=layer.expert_type == "swiglu",
    )


def experts_defer_wgrad(cfg: RunConfig) -> bool:
    """Whether Lancet's queue (--overlap-wgrad) takes the experts' weight gradients out of the layer's
    backward (the cost model then leaves them out of it)."""
    return cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size) != "off"


def moe_layers(cfg: RunConfig) -> list[int]:
    """The MoE layers' numbers (from 1, as `megatron_moe.overlap.wgrad_schedule` keys them)."""
    return [i + 1 for i, is_moe in enumerate(cfg.moe.layer_pattern(cfg.model.num_layers)) if is_moe]


def plan_degrees(
    cfg: RunConfig,
    fits: ClusterFits,
    *,
    t_gar_ms: float | dict[int, float] = 0.0,
    max_degree: int = 8,
) -> dict[int, Schedule]:
    """MoE layer number -> its schedule. Every MoE layer of a run has the same sizes; their backward degrees
    differ by the gradient all-reduce each one's backward carries (`t_gar_ms`: one for all, or layer -> ms from
    the adaptive gradient partition, 0 for a layer it does not name). The experts' weight gradients count in the
    backward unless Lancet's queue defers them (`experts_defer_wgrad`)."""
    sizes = layer_sizes(cfg)
    per_layer = t_gar_ms if isinstance(t_gar_ms, dict) else dict.fromkeys(moe_layers(cfg), t_gar_ms)
    kw = {"max_degree": max_degree, "dw_in_backward": not experts_defer_wgrad(cfg)}
    return {layer: solve_degrees(fits, sizes, t_gar_ms=per_layer.get(layer, 0.0), **kw) for layer in moe_layers(cfg)}


def dense_backward_ms(cfg: RunConfig, fits: ClusterFits) -> dict[int, tuple[float, float]]:
    """Layer number -> (its attention's backward ms, its dense MLP's backward ms; 0 for an MoE layer): the work
    that also hides a gradient reduction started at a MoE layer (FSMoE's t_olp,dense, "measured before
    training"; here estimated): twice the forward's multiply-adds per token (input and weight gradients) x the
    tokens of a micro-batch on this rank, at the experts' fitted rate (the "gemm" line's beta). Per token:
    QKV and the projection 4 h^2 / TP, the attention core 2 s h / TP, the MLP (2 or 3 with SwiGLU) h F / TP."""
    model, par = cfg.model, cfg.parallel
    h, t = model.hidden_size, par.tensor_model_parallel_size
    tokens = cfg.training.micro_batch_size * model.seq_length / par.context_parallel_size
    per_mac = max(fits["gemm"].beta, 0.0)
    mats = 3 if model.swiglu else 2
    ffn = model.ffn_width
    attention = 2 * tokens * (4 * h * h + 2 * model.seq_length * h) / t * per_mac
    mlp = 2 * tokens * mats * h * ffn / t * per_mac
    pattern = cfg.moe.layer_pattern(model.num_layers)
    return {number: (attention, 0.0 if is_moe else mlp) for number, is_moe in enumerate(pattern, start=1)}


def olp_dense_ms(cfg: RunConfig, fits: ClusterFits) -> dict[int, float]:
    """MoE layer number -> the dense backward between it and the next MoE layer below (its own attention, then
    every dense layer down to that one; for the lowest, down to the embedding): `dense_backward_ms` summed."""
    per_layer, moe = dense_backward_ms(cfg, fits), moe_layers(cfg)
    out = {}
    for layer in moe:
        below = max((m for m in moe if m < layer), default=0)
        out[layer] = per_layer[layer][0] + sum(sum(per_layer[j]) for j in range(below + 1, layer))
    return out
