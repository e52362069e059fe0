"""Multi-token prediction's per-layer losses for the log: `mtp_1 loss`, ... (Megatron-LM's names).

megatron-core's GPTModel adds each MTP layer's loss into the backward (MTPLossAutoScaler, weighted by
--mtp-loss-scaling-factor / --mtp-num-layers) and records its unweighted mean token loss per micro-batch in
MTPLossLoggingHelper's tracker, on the stage that holds the MTP layers (the last). `pop_mtp_losses` reads it as
Megatron-LM's training_log does: averaged over the data-parallel ranks (a sum here: gloo has no AVG) and the
micro-batches, then cleared. The lm loss stays the main token's alone (the MTP losses are not in it).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_moe import comm


def pop_mtp_losses(mtp_layers: int, num_microbatches: int) -> dict[str, float]:
    """{"mtp_1 loss": ..., ...} of the step on a rank that holds the `mtp_layers` MTP layers, else {} (none
    recorded, or no MTP). Every rank of the MTP stage's data-parallel group calls it together (one all-reduce)."""
    tracker = MTPLossLoggingHelper.tracker
    if not mtp_layers or "values" not in tracker:
        return {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    values = comm.reduce_mtp_losses(tracker["values"].clone(), group)
    with comm.host_read("mtp losses"):
        values = (values / (dist.get_world_size(group) * num_microbatches)).tolist()
    MTPLossLoggingHelper.clean_loss_in_tracker()
    return {f"mtp_{i + 1} loss": value for i, value in enumerate(values)}


def clear_mtp_losses() -> None:
    """Zero what was recorded (evaluation records nothing; a step's losses are popped by `pop_mtp_losses`). A new
    model empties the tracker itself (`model.builder.reset_loss_trackers`)."""
    if "values" in MTPLossLoggingHelper.tracker:
        MTPLossLoggingHelper.clean_loss_in_tracker()
