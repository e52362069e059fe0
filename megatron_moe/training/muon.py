"""--optimizer muon: megatron-core 0.16.1's Muon (`TensorParallelMuon`) for the transformer layers' 2-D weights,
its Adam(W) for the rest, chained, or in its layer-wise distributed optimizer (`LayerWiseDistributedOptimizer`).

`build_muon_optimizer` is megatron-core's `get_megatron_muon_optimizer` (optimizer/muon.py), copied (the probe
below fails when upstream changes it), with three changes:
1. our MoE layer's expert weights, one [experts, out, in] tensor per matrix, are Muon's too, each expert's matrix
   orthogonalized on its own (`expert_matrix_muon`): what Megatron-LM does with transformer-engine's grouped experts
   (a 2-D weight per expert); upstream's 2-D test would give them to Adam;
2. expert parameters get their own Muon optimizer under the layer-wise optimizer too (upstream chains them in one
   there), so that each sub-optimizer's TP group is one group (`optimizer._set_tensor_parallel_groups`); the same
   arithmetic (Muon steps each parameter alone);
3. `coefficient_type` is passed (HEAD's --muon-coefficient-type; 0.16.1 uses quintic), and expert groups are not
   removed from the list while iterating it (upstream skips the group after each one it removes).
Inputs: megatron-core's OptimizerConfig, the DDP model chunks, the Muon settings. Output: the chained optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_megatron_optimizer
from megatron.core.optimizer import muon as mcore_muon
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_moe.platform.patch import Patch, source_sha256

log = logging.getLogger(__name__)

UPSTREAM_SHA256 = "4a1aedc3cc76d8b4d24b5b39753df82fa30841acfae4f2e853d250f2525f4ed9"
"""sha256 of megatron-core 0.16.1's `get_megatron_muon_optimizer` as copied here."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """What Muon is told beyond megatron-core's OptimizerConfig (its `muon_*` fields carry the rest)."""

    coefficient_type: str = "quintic"
    """Newton-Schulz coefficient set (--muon-coefficient-type)."""
    layer_wise: bool = False
    """Muon's layer-wise distributed optimizer (--use-distributed-optimizer or dist_muon)."""


def expert_matrix_muon() -> type:
    """TensorParallelMuon that orthogonalizes a 3-D [experts, out, in] parameter (our MoE layer's experts) one
    expert matrix at a time, each with its own scale; 2-D parameters as upstream. Made on first use: megatron-core's
    muon.py is re-imported once the emerging_optimizers stand-in is installed (platform/upstream_fixes.py)."""
    return _expert_matrix_muon(mcore_muon.TensorParallelMuon)


@functools.cache
def _expert_matrix_muon(base: type) -> type:
    class ExpertMatrixMuon(base):
        def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            if grad.dim() != 3:
                return super().orthogonalize(p, grad, **kwargs)
            tp_group = self.pg_collection.expt_tp if self.pg_collection else None
            partition_dim = None if self.mode == "blockwise" else getattr(p, "partition_dim", None)
            if partition_dim is not None and partition_dim >= 1 and getattr(p, "tensor_model_parallel", False):
                partition_dim -= 1  # the expert axis goes; a matrix's own axes remain
            else:
                partition_dim = None
            return torch.stack([self.scaled_orthogonalize_fn(g, tp_group, partition_dim) for g in grad])

    return ExpertMatrixMuon


def _is_muon_weight(name: str, param: torch.nn.Parameter) -> bool:
    """Muon's parameters: 2-D weights that are not the embedding or output layer (upstream), and our MoE layer's
    3-D expert weights (change 1)."""
    if getattr(param, "is_embedding_or_output_parameter", False):
        return False
    return param.dim() == 2 or (param.dim() == 3 and getattr(param, "expert_tp", False))


def build_muon_optimizer(
    config: OptimizerConfig, model_chunks: list, settings: MuonSettings, pg_collection=None
) -> ChainedOptimizer:
    """megatron-core 0.16.1's get_megatron_muon_optimizer with the changes the module docstring lists."""
    assert mcore_muon.HAVE_EMERGING_OPTIMIZERS, "emerging_optimizers (or its stand-in) is not installed"
    config.optimizer = "adam"  # upstream: the Adam part is built by get_megatron_optimizer from this config
    if config.use_distributed_optimizer:
        raise ValueError("muon with megatron-core's distributed optimizer is not supported (use the layer-wise one)")
    if config.fp16:
        raise ValueError("muon with fp16 is not supported")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()

    def muon_init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)

    def adam_init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    if config is None or not config.use_precision_aware_optimizer:
                        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                    else:
                        opt.initialize_state(p)

    linear_params, nonlinear_params = [], []
    for model_chunk in model_chunks:
        c = model_chunk.config
        qkv_split_shapes = [c.num_attention_heads // c.num_query_groups * c.kv_channels, c.kv_channels, c.kv_channels]
        for name, param in model_chunk.named_parameters():
            if not param.requires_grad:
                continue
            if "experts" in name and "shared" not in name:
                param.expert_tp = True
            if "linear_qkv.weight" in name and len(param.shape) == 2:
                param.is_qkv = True
            (linear_params if _is_muon_weight(name, param) else nonlinear_params).append(param)

    muon_kwargs = {
        "lr": config.lr,
        "momentum_beta": config.muon_momentum,
        "use_nesterov": config.muon_use_nesterov,
        "weight_decay": config.weight_decay,
        "fp32_matmul_prec": config.muon_fp32_matmul_prec,
        "coefficient_type": settings.coefficient_type,
        "num_ns_steps": config.muon_num_ns_steps,
        "scale_mode": config.muon_scale_mode,
        "split_qkv": config.muon_split_qkv,
        "is_qkv_fn": lambda p: getattr(p, "is_qkv", False),
        "qkv_split_shapes": qkv_split_shapes,
        "extra_scale_factor": config.muon_extra_scale_factor,
        "pg_collection": pg_collection,
        "mode": config.muon_tp_mode,
    }

    for param in nonlinear_params:
        param.requires_grad = False
    groups = _get_param_groups(model_chunks, config, None)
    dense_groups = [g for g in groups if not g["is_expert_parallel"]]  # change 3
    expert_groups = [g for g in groups if g["is_expert_parallel"]]  # change 2: apart under layer-wise too

    def wrapped(optimizer):
        if settings.layer_wise:  # LayerWiseDistributedOptimizer makes the master weights after sharding
            return FP32Optimizer(optimizer, config, muon_init_state_fn)
        if config.bf16:
            return Float16OptimizerWithFloat16Params(optimizer, config, None, muon_init_state_fn)
        return FP32Optimizer(optimizer, config, muon_init_state_fn)

    bf16 = config.bf16
    if settings.layer_wise:
        config.bf16 = False  # upstream: the Adam part below unwrapped too; restored for the layer-wise wrapper
    optimizers, muon_count = [], 0
    for param_groups in (dense_groups, expert_groups):
        if not param_groups:
            continue
        optimizer = wrapped(expert_matrix_muon()(param_groups, **muon_kwargs))
        if param_groups is expert_groups:
            optimizer.grad_stats_parallel_group = pg_collection.tp_ep_pp
        optimizers.append(optimizer)
        muon_count += 1

    for param in nonlinear_params:
        param.requires_grad = True
    for param in linear_params:
        param.requires_grad = False
    chained_adam = get_megatron_optimizer(config, model_chunks, use_gloo_process_groups=True)
    for param in linear_params:
        param.requires_grad = True

    adam_optimizers = getattr(chained_adam, "chained_optimizers", [chained_adam])
    init_fns = [muon_init_state_fn] * muon_count + [adam_init_state_fn] * len(adam_optimizers)
    optimizers += adam_optimizers
    if settings.layer_wise:
        config.bf16 = bf16
        return LayerWiseDistributedOptimizer(optimizers, config, pg_collection, init_state_fn_list=init_fns)
    return ChainedOptimizer(optimizers)


def _upstream_unchanged() -> bool:
    return source_sha256("megatron.core.optimizer.muon", "get_megatron_muon_optimizer") == UPSTREAM_SHA256


PROBES: tuple[Patch, ...] = (
    Patch(
        "muon_optimizer_copy",
        "training/muon.py: build_muon_optimizer is megatron-core's get_megatron_muon_optimizer with our 3-D "
        "expert weights given to Muon per expert matrix (--optimizer muon).",
        None,
        _upstream_unchanged,
    ),
)
