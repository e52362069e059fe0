"""MoE auxiliary-loss figures for the log, reduced with a fixed shape on every rank.

megatron-core's MoE layers record their balancing and z losses per layer in
its tracker. A pipeline stage without MoE layers has no entries, so every
rank first makes sure each tracked name exists with one slot per layer:
all ranks then join the same reductions and none can hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils

from megatron_moe import comm
from megatron_moe.platform import current_platform

TRACKED = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
"""megatron-core's tracker names."""
BALANCING_NAMES = {"seq_aux_loss": "seq_load_balancing_loss", "global_aux_loss": "global_load_balancing_loss"}
"""--moe-router-load-balancing-type -> the name megatron-core tracks its loss under (else load_balancing_loss)."""
SUMMED = ("global_load_balancing_loss",)
"""Losses of which each rank tracks its share (reduced over the stage's ranks with DP): summed over them, not
averaged, as megatron-core's `reduce_aux_losses_tracker_across_ranks` does."""
SHARED_OVER_TP_CP = ("load_balancing_loss", "seq_load_balancing_loss")
"""Losses of which each TP x CP rank tracks its share (megatron-core's router counts the tokens of the TP x CP
group): summed over TP x CP, averaged over DP, as `reduce_aux_losses_tracker_across_ranks` does. The rest (z_loss)
is each rank's whole figure: averaged over the stage's ranks."""


def pop_moe_aux_losses(num_layers: int, num_moe_layers: int, num_microbatches: int) -> dict[str, float]:
    """Per-step mean over MoE layers of each tracked aux loss (unweighted by its coefficient)."""
    if num_moe_layers == 0:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in TRACKED:
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(num_layers, device=current_platform().device)}
    # One fixed-shape reduction over the whole world: a sum over pipeline stages (each holds its own layers'
    # slots), then per loss an average over the ranks of a stage, over its DP ranks, or none (`SHARED_OVER_TP_CP`,
    # `SUMMED`).
    values = torch.stack([tracker[name]["values"] for name in TRACKED])
    comm.reduce_moe_metrics(values)
    averaged = torch.tensor([float(_ranks_averaged(name)) for name in TRACKED], device=values.device)
    totals = values.sum(dim=1) / (averaged * num_moe_layers * num_microbatches)
    with comm.host_read("moe aux losses"):
        figures = dict(zip(TRACKED, totals.tolist()))
    moe_utils.clear_aux_losses_tracker()
    return figures


def _ranks_averaged(name: str) -> int:
    """How many of a pipeline stage's ranks tracked loss `name` is averaged over (see `pop_moe_aux_losses`)."""
    if name in SUMMED:
        return 1
    ranks_per_stage = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
    if name in SHARED_OVER_TP_CP:
        tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
        return ranks_per_stage // (tp * cp)
    return ranks_per_stage
