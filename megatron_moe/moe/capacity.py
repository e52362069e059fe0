"""Expert capacity with Tutel's semantics for the capacity factor f.

    C = ceil(|f| * k * T / E)        slots per expert, per source rank

T is the number of tokens this rank routes, k the top-k and E the number of
experts over all EP ranks. Every EP rank sends at most C rows to each expert,
so an expert receives at most EP * C = |f| * k * T_group / E rows, where
T_group = EP * T are the EP group's tokens: f is the factor by which an
expert may exceed its fair share k * T_group / E of the group's tokens.

    f > 0    fixed: C as above; pairs beyond C (in the gate's claim order) are dropped.
    f = 0    dropless (also f unset): C = the largest count any expert gets from
             any rank in this step, so nothing is dropped.
    f < 0    adaptive: dropless, but C is capped at the formula with |f|.

Capacity is recomputed every step from T and k, so top-k may change between
iterations. With the padded all-to-all every rank must use the same C: the
dispatcher agrees on the group maximum (`Dispatcher.agree_capacity`, on the device).
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
