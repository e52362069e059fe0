"""Each MoE layer's pipeline degrees for a run: its flags -> `LayerSizes` -> `solve_degrees` (FSMoE Algorithm 1).

What the training set-up calls to resolve `--moe-pipeline-degree auto` / `--moe-bp-pipeline-degree auto` (with
the fits of `megatron_moe.overlap.profiler.load_or_measure`), and what tools/plan_schedule.py prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.overlap.cost_model import ClusterFits, LayerSizes, Schedule, solve_degrees

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig


def layer_sizes(cfg: RunConfig) -> LayerSizes:
    """One MoE layer's sizes on one rank, from the run's flags: tokens per rank = micro-batch x seq-length /
    (TP under sequence parallelism) / CP; 2-byte rows under --bf16 / --fp16, else 4."""
    model, moe, par, training = cfg.model, cfg.moe, cfg.parallel, cfg.training
    split = (par.tensor_model_parallel_size if par.sequence_parallel else 1) * par.context_parallel_size
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
        ep=par.expert_model_parallel_size,
        esp=par.expert_tensor_parallel_size or 1,
        capacity_factor=layer.capacity_factor,
        padded=layer.pad_expert_input_to_capacity,
        dtype_bytes=2 if (training.bf16 or training.fp16) else 4,
        gated=layer.expert_type == "swiglu",
    )


def experts_defer_wgrad(cfg: RunConfig) -> bool:
    """Whether Lancet's queue (--overlap-wgrad, issue 14) takes the experts' weight gradients out of the layer's
    backward (the cost model then leaves them out of it)."""
    return cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size) != "off"


def moe_layers(cfg: RunConfig) -> list[int]:
    """The MoE layers' numbers (from 1, as `megatron_moe.overlap.plan` keys them)."""
    return [i + 1 for i, is_moe in enumerate(cfg.moe.layer_pattern(cfg.model.num_layers)) if is_moe]


def plan_degrees(
    cfg: RunConfig,
    fits: ClusterFits,
    *,
    t_gar_ms: float = 0.0,
    max_degree: int = 8,
) -> dict[int, Schedule]:
    """MoE layer number -> its schedule. Every MoE layer of a run has the same sizes, so the same degrees, until
    t_gar differs per layer (the gradient-partition issue). The experts' weight gradients count in the backward
    unless Lancet's queue defers them (`experts_defer_wgrad`)."""
    sizes = layer_sizes(cfg)
    schedule = solve_degrees(
        fits, sizes, t_gar_ms=t_gar_ms, max_degree=max_degree, dw_in_backward=not experts_defer_wgrad(cfg)
    )
    return {layer: schedule for layer in moe_layers(cfg)}
