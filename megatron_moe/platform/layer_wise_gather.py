"""Part of the CPU platform layer (cpu_compat.py's Patch layer_wise_uneven_gather_gloo): Muon's layer-wise
distributed optimizer's uneven all-gather on gloo."""

from __future__ import annotations

import functools

import torch

from megatron_moe.platform.patch import source

# ---------------------------------------------------------------------------
# 8. Muon's layer-wise distributed optimizer all-gathers each rank's updated
#    parameters, a different number of elements per rank, in one list
#    all_gather (NCCL's grouped broadcasts); gloo wants equal sizes. During its
#    allgather_params, an uneven list is gathered padded to the longest.
# ---------------------------------------------------------------------------


def _all_gather_padded(output_list, tensor, group=None, async_op=False):
    """torch.distributed.all_gather for a list of unequal 1-D outputs: pad, gather, copy each rank's part."""
    sizes = [out.numel() for out in output_list]
    if len(set(sizes)) == 1:
        return _ORIGINAL_ALL_GATHER(output_list, tensor, group=group, async_op=async_op)
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.numel()] = tensor.reshape(-1)
    gathered = [torch.empty_like(padded) for _ in sizes]
    _ORIGINAL_ALL_GATHER(gathered, padded, group=group)
    for out, part, size in zip(output_list, gathered, sizes):
        out.copy_(part[:size].view_as(out))
    return None


_ORIGINAL_ALL_GATHER = None


def apply_layer_wise_gather() -> None:
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    allgather_params = LayerWiseDistributedOptimizer.allgather_params

    @functools.wraps(allgather_params)
    def allgather_params_padded(self):
        global _ORIGINAL_ALL_GATHER
        _ORIGINAL_ALL_GATHER = torch.distributed.all_gather
        torch.distributed.all_gather = _all_gather_padded
        try:
            return allgather_params(self)
        finally:
            torch.distributed.all_gather = _ORIGINAL_ALL_GATHER

    LayerWiseDistributedOptimizer.allgather_params = allgather_params_padded


def layer_wise_gathers_uneven_lists() -> bool:
    src = source("megatron.core.optimizer.layer_wise_optimizer", "LayerWiseDistributedOptimizer")
    return "torch.distributed.all_gather(output_list, src, group=group)" in src
