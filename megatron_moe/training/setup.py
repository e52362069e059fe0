"""Model chunks wrapped in megatron-core DDP, the megatron optimizer and LR scheduler; the MoE pipeline's degrees."""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import param_is_not_shared

from megatron_moe.config import RunConfig
from megatron_moe.config.moe_layer import AUTO
from megatron_moe.model import build_model
from megatron_moe.model.builder import params_dtype
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.metrics import moe_layer_modules
from megatron_moe.overlap import WgradQueue, install_wgrad_overlap
from megatron_moe.overlap.cost_model import LayerSizes, Schedule
from megatron_moe.overlap.degrees import layer_sizes, plan_degrees
from megatron_moe.overlap.profiler import ProfileGroups, ProfileSettings, layer_profile_settings, load_or_measure

log = logging.getLogger(__name__)
PROFILE_FILE = "cost_profile.json"
"""Where the cost-model fits are kept in --save when --moe-cost-profile is not given."""


def build_wgrad_queue(cfg: RunConfig) -> WgradQueue | None:
    """Lancet's weight-gradient queue as --overlap-wgrad says (None: off, or nothing to hide under)."""
    policy = cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size)
    if policy == "off":
        return None
    max_mb = cfg.moe.overlap_wgrad_max_mb or None
    return WgradQueue(policy, max_mb=max_mb, num_layers=cfg.model.num_layers, report=cfg.moe.overlap_wgrad_report)


def build_ddp_model(
    cfg: RunConfig, config: TransformerConfig, vocab_size: int, wgrad_queue: WgradQueue | None = None
) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per stage, no virtual pipeline) in megatron-core DDP; with `wgrad_queue`,
    its deferrable modules' weight gradients go through it (megatron-core's `delay_wgrad_compute` protocol)."""
    module = build_model(cfg, config, vocab_size)
    if wgrad_queue is not None:
        install_wgrad_overlap([module], wgrad_queue)
    ddp_config = DistributedDataParallelConfig(
        delay_wgrad_compute=wgrad_queue is not None,
        grad_reduce_in_fp32=cfg.training.bf16 or cfg.training.fp16,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        # Ours instead (training/divergence.py, off under fp16): it names the iteration, rank and parameter.
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    model.broadcast_params()
    return [model]


def build_optimizer(cfg: RunConfig, model: list[DistributedDataParallel]):
    t = cfg.training
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        params_dtype=params_dtype(cfg),
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    _set_tensor_parallel_groups(optimizer)
    return optimizer


def _set_tensor_parallel_groups(optimizer) -> None:
    """Tell each optimizer which TP group its replicated parameters are duplicated over.

    The grad norm counts a parameter that is not TP-sharded on TP rank 0 only.
    Without a `tp_group` megatron-core uses the global TP rank for expert
    parameters too, so with TP>1 and expert-TP=1 the norm on TP rank 1 left out
    the experts' biases (and differed between ranks).
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        is_expert = any(group.get("is_expert_parallel", False) for group in sub.optimizer.param_groups)
        sub.tp_group = (
            parallel_state.get_expert_tensor_parallel_group()
            if is_expert
            else parallel_state.get_tensor_model_parallel_group()
        )


@torch.no_grad()
def params_norm(optimizer) -> float:
    """L2 norm of every parameter of the model, each counted once (Megatron-LM's --log-params-norm).

    Collective: every rank calls it. The norm is taken as the optimizer takes the
    grad norm, over the parameters it steps (fp32 main copies under bf16/fp16,
    this rank's shards under the distributed optimizer), leaving out shared and
    TP-duplicated ones, each sub-optimizer (dense, expert) reduced over its own
    group: the same figure in every layout as in a single process.
    """
    squares = 0.0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        tp_group = getattr(sub, "tp_group", None)
        once = [p for p in sub.get_parameters() if param_is_not_shared(p)]
        once = [p for p in once if param_is_not_tensor_parallel_duplicate(p, tp_group)]
        squares += get_grad_norm_fp32(once, grad_stats_parallel_group=sub.get_grad_stats_parallel_group()) ** 2
    return math.sqrt(squares)


def build_scheduler(cfg: RunConfig, optimizer) -> OptimizerParamScheduler:
    """Warm-up then decay, counted in samples like Megatron-LM (steps x global batch)."""
    t = cfg.training
    gbs = t.global_batch_size
    decay_iters = t.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if t.lr_warmup_iters else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters * gbs,
        lr_decay_steps=max(decay_iters, t.lr_warmup_iters + 1) * gbs,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=max(t.train_iters, 1) * gbs,
        wd_incr_style="constant",
    )


def wire_model_config(config: TransformerConfig, model, optimizer) -> None:
    """Hooks megatron-core's schedules call: grad finalisation, loss scaling, no_sync."""
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync


# ---------------------------------------------------------------------------------------------- pipeline degrees


def resolve_pipeline_degrees(cfg: RunConfig, model) -> dict[int, Schedule] | None:
    """Resolve --moe-pipeline-degree / --moe-bp-pipeline-degree auto (FSMoE, issue 15) on every MoE layer of
    `model`: the cluster's fits (`--moe-cost-profile`, loaded when it describes this cluster, else measured on
    this run's EP / ESP / DP groups and saved), each layer's sizes, FSMoE's Algorithm 1. Every rank calls it (the
    profile is collective). Returns MoE layer number -> schedule; None when nothing is auto."""
    moe = cfg.moe
    if not (moe.is_moe and moe.own_layer) or AUTO not in (moe.moe_pipeline_degree, moe.moe_bp_pipeline_degree):
        return None
    layers = list(moe_layer_modules(model))
    sizes = layer_sizes(cfg)
    if sizes.ep * sizes.esp == 1:
        for layer in layers:
            layer.set_pipeline_degrees(*_degrees(layer, 1, 1))
        if dist.get_rank() == 0:
            log.info("pipeline degrees: auto is 1 (EP = ESP = 1: no all-to-all or all-gather to pipeline)")
        return None
    path = moe.moe_cost_profile or (os.path.join(cfg.checkpoint.save, PROFILE_FILE) if cfg.checkpoint.save else None)
    if path is not None and os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fits, measured = load_or_measure(path, ProfileGroups.from_parallel_state(), profile_settings(sizes, cfg))
    schedules = plan_degrees(cfg, fits)
    for layer in layers:
        schedule = schedules.get(layer.layer_number) or next(iter(schedules.values()))
        layer.set_pipeline_degrees(*_degrees(layer, schedule.forward, schedule.backward))
    first = next(iter(schedules.values()))
    if dist.get_rank() != 0:  # every rank resolved the same degrees (the profile is agreed)
        return schedules
    log.info(
        "pipeline degrees (FSMoE cost model, profile %s): forward %d, backward %d on every MoE layer; predicted "
        "ms forward %.2f (case %d), backward %.2f (case %d)",
        "measured" if measured else f"loaded from {path}",
        first.forward,
        first.backward,
        first.predicted_ms["forward"],
        first.case["forward"],
        first.predicted_ms["backward"],
        first.case["backward"],
    )
    return schedules


def _degrees(layer: MoELayer, forward: int, backward: int) -> tuple[int, int]:
    """The solver's degrees where the layer's flag says auto, the flag's integer elsewhere."""
    configured = (layer.cfg.pipeline_degree, layer.cfg.bp_pipeline_degree)
    return tuple(solved if flag == AUTO else flag for flag, solved in zip(configured, (forward, backward)))


def profile_settings(sizes: LayerSizes, cfg: RunConfig) -> ProfileSettings:
    """`megatron_moe.overlap.profiler.layer_profile_settings` at this run's MoE layer widths."""
    layer = cfg.moe.layer_config(cfg.model)
    return layer_profile_settings(
        sizes,
        hidden_size=layer.hidden_size,
        ffn_hidden_size=layer.ffn_hidden_size,
        num_experts=layer.num_experts,
        gated=layer.expert_type == "swiglu",
    )
