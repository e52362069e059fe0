"""Expert capacity with Tutel's semantics for the capacity factor f: C = ceil(|f| * k * T / E) slots per
expert per source rank (T: this rank's tokens, k: top-k, E: experts over all EP ranks).

    f > 0    fixed C; pairs beyond C (in the gate's claim order) are dropped.
    f = 0    dropless (also f unset): C = the largest count any expert gets from any rank this step.
    f < 0    adaptive: dropless, but C capped at the formula with |f|.

C is recomputed every step (k and T may change); with the padded all-to-all the dispatcher agrees on the
group's maximum on the device (`Dispatcher.agree_capacity`). What f bounds: docs/internals/moe.md.
"""

from __future__ import annotations

import math

import torch


def capacity_limit(capacity_factor: float, num_tokens: int, topk: int, num_experts: int) -> int:
    """ceil(|f| * k * T / E), at least 1."""
    return max(1, math.ceil(abs(capacity_factor) * topk * num_tokens / num_experts))


def expert_capacity(
    capacity_factor: float | None, *, num_tokens: int, topk: int, num_experts: int, largest_count: int | torch.Tensor
) -> int | torch.Tensor | None:
    """Slots per expert for this step, or None when nothing limits them (dropless).

    `largest_count`: the most pairs any expert got from this rank (or from any
    rank of the EP group when the caller needs one C for the whole group). The
    layer passes it as a device tensor, so that adaptive capacity is one too
    and is read on the host with the other counts, in one copy.
    """
    if capacity_factor is None or capacity_factor == 0:
        return None
    limit = capacity_limit(capacity_factor, num_tokens, topk, num_experts)
    if capacity_factor > 0:
        return limit
    if torch.is_tensor(largest_count):
        return torch.clamp(largest_count, max=limit)
    return min(limit, largest_count)
