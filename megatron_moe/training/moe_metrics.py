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


def pop_moe_aux_losses(num_layers: int, num_moe_layers: int, num_microbatches: int) -> dict[str, float]:
    """Per-step mean over MoE layers of each tracked aux loss (unweighted by its coefficient)."""
    if num_moe_layers == 0:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in TRACKED:
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(num_layers, device=current_platform().device)}
    # One fixed-shape reduction over the whole world: a sum over pipeline stages
    # (each holds its own layers' slots) and an average over the ranks of a stage (a sum for the `SUMMED`).
    values = torch.stack([tracker[name]["values"] for name in TRACKED])
    comm.reduce_moe_metrics(values)
    ranks_per_stage = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
    averaged = torch.tensor([1.0 if name in SUMMED else ranks_per_stage for name in TRACKED], device=values.device)
    totals = values.sum(dim=1) / (averaged * num_moe_layers * num_microbatches)
    with comm.host_read("moe aux losses"):
        figures = dict(zip(TRACKED, totals.tolist()))
    moe_utils.clear_aux_losses_tracker()
    return figures
