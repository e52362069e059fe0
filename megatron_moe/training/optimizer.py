"""The run's optimizer: megatron-core's Adam(W) or Muon as --optimizer says (`build_optimizer`), each sub-optimizer
told its TP group, and the parameters' norm taken as the optimizer takes the grad norm (`params_norm`).

Inputs: the RunConfig and the DDP model chunks. Output: megatron-core's (chained) optimizer.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_moe.config import RunConfig
from megatron_moe.model.builder import params_dtype
from megatron_moe.training.muon import MuonSettings, build_muon_optimizer


def build_optimizer(cfg: RunConfig, model: list[DistributedDataParallel]):
    """megatron-core's optimizer as --optimizer says: Adam(W) (`get_megatron_optimizer`, distributed with
    --use-distributed-optimizer), or Muon chained with Adam(W) for the rest (training/muon.py; layer-wise
    distributed with --use-distributed-optimizer or dist_muon)."""
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
        use_distributed_optimizer=cfg.sharded_by_ddp,
        overlap_param_gather=cfg.parallel.overlap_param_gather and cfg.sharded_by_ddp,
        log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
        muon_momentum=t.muon_momentum,
        muon_split_qkv=not t.muon_no_split_qkv,
        muon_use_nesterov=t.muon_nesterov,
        muon_scale_mode=t.muon_scale_mode,
        muon_fp32_matmul_prec=t.muon_fp32_matmul_prec,
        muon_num_ns_steps=t.muon_num_ns_steps,
        muon_tp_mode=t.muon_tp_mode,
        muon_extra_scale_factor=t.muon_extra_scale_factor,
    )
    if t.uses_muon:
        settings = MuonSettings(
            coefficient_type=t.muon_coefficient_type, layer_wise=cfg.optimizer_kind == "layer_wise_muon"
        )
        optimizer = build_muon_optimizer(opt_config, model, settings)
    else:
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
    group: the same figure in every layout as in a single process. Under Muon's
    layer-wise distributed optimizer each parameter is stepped on one data-parallel
    rank: the squares are summed over every rank, as its grad norm is.
    """
    layer_wise = isinstance(optimizer, LayerWiseDistributedOptimizer)
    squares, local = 0.0, []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        tp_group = getattr(sub, "tp_group", None)
        once = [p for p in sub.get_parameters() if param_is_not_shared(p)]
        once = [p for p in once if param_is_not_tensor_parallel_duplicate(p, tp_group)]
        if layer_wise:
            local += once
            continue
        squares += get_grad_norm_fp32(once, grad_stats_parallel_group=sub.get_grad_stats_parallel_group()) ** 2
    if layer_wise:
        squares = get_grad_norm_fp32(local, grad_stats_parallel_group=None) ** 2  # None: over every rank
    return math.sqrt(squares)
