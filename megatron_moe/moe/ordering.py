"""Order and I-Order: tokens [T, H] <-> rows grouped by expert [R, H].

Legend: T = tokens, H = hidden, E = experts (global), C = capacity (slots per expert), N = routed pairs,
R = rows of the expert-major buffer, Z = soft slots.

`make_row_map(routing, ...)` -> `RowMap`: ONE stable sort of the pairs by expert (in the gate's claim order)
gives each pair its slot; pairs past the capacity are dropped. Rows are exact (kept pairs, expert after expert)
or padded (C rows per expert, empty slots zero); either way `counts[e]` rows for expert e, all the dispatchers
and experts see. `SparseOrdering` (Tutel's gather / scatter-add) and `DenseOrdering` (GShard's one-hot einsum)
give the same rows; both weight the rows by the gate scores inside `decode`. Details: docs/internals/moe.md.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from megatron_moe import comm
from megatron_moe.moe.routing import Routing


@dataclasses.dataclass
class RowMap:
    """Where each kept (token, expert) pair sits in the expert-major row buffer."""

    num_tokens: int
    counts: list[int]
    """Rows per expert in the buffer (len E); all equal to `capacity` when padded."""
    capacity: int | None
    """Slots per expert when the rows are padded; None for exact rows."""
    routed_E: torch.Tensor
    """Pairs each expert was given before dropping (long [E]), for statistics."""
    dropped: int
    token_of_row: torch.Tensor | None = None
    """Source token of each kept pair, in buffer order (long [R'])."""
    weight_of_row: torch.Tensor | None = None
    """Gate weight of each kept pair (fp32, differentiable)."""
    row_index: torch.Tensor | None = None
    """Buffer row of each kept pair when padded (None: kept pair i is row i)."""
    expert_of_row: torch.Tensor | None = None
    slot_of_row: torch.Tensor | None = None
    routing: Routing | None = None

    @property
    def num_rows(self) -> int:
        return sum(self.counts)

    @property
    def padded(self) -> bool:
        return self.capacity is not None


def expert_counts(expert_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed pairs per expert, computed on the device without waiting for it (bincount would)."""
    return torch.zeros(num_experts, dtype=torch.long, device=expert_N.device).scatter_add_(
        0, expert_N, torch.ones_like(expert_N, dtype=torch.long)
    )


def sort_pairs(routing: Routing, routed_E: torch.Tensor | None = None):
    """(pair index, expert, slot within the expert) of every pair grouped by expert, and the counts.

    Within an expert, pairs keep the gate's claim order, so the slot number is
    the claim rank and dropping "slot >= C" drops the last claimants.
    """
    expert_N = routing.expert_N
    claim_N = routing.claim_N
    key_N = expert_N if claim_N is None else expert_N.index_select(0, claim_N)
    expert_sorted, order = torch.sort(key_N, stable=True)
    pair_sorted = order if claim_N is None else claim_N.index_select(0, order)
    if routed_E is None:
        routed_E = expert_counts(expert_N, routing.num_experts)
    starts_E = torch.cumsum(routed_E, 0) - routed_E
    slot_sorted = torch.arange(expert_sorted.numel(), device=expert_N.device) - starts_E.index_select(0, expert_sorted)
    return pair_sorted, expert_sorted, slot_sorted, routed_E


def make_row_map(
    routing: Routing,
    *,
    capacity: int | None,
    padded: bool,
    routed_E: torch.Tensor | None = None,
    routed: list[int] | None = None,
) -> RowMap:
    """Lay the routed pairs out by expert: exact rows, or C padded rows per expert.

    `capacity` None means nothing is dropped; `padded` needs a capacity.
    `routed_E` / `routed`: the pairs per expert on the device / on the host,
    if the caller has them (reading them on the host waits for the device).
    """
    num_experts = routing.num_experts
    if routing.is_soft:
        slots = routing.slots_per_expert
        zero = torch.zeros(num_experts, dtype=torch.long, device=routing.probs_TE.device)
        return RowMap(
            num_tokens=routing.num_tokens,
            counts=[slots] * num_experts,
            capacity=slots,
            routed_E=zero + routing.num_tokens,
            dropped=0,
            routing=routing,
        )
    assert capacity is not None or not padded, "padded rows need a capacity"
    pair_sorted, expert_sorted, slot_sorted, routed_E = sort_pairs(routing, routed_E)
    if routed is None:  # callers outside the MoE layer (tests, tools): the layer reads it in its one host read
        with comm.host_read("moe plan counts"):
            routed = routed_E.tolist()
    dropped = 0
    if capacity is not None and max(routed, default=0) > capacity:
        # The number kept is known on the host: a mask index would wait for the device to count it.
        num_kept = sum(min(c, capacity) for c in routed)
        keep = torch.nonzero_static(slot_sorted < capacity, size=num_kept).view(-1)
        pair_sorted, expert_sorted, slot_sorted = (
            t.index_select(0, keep) for t in (pair_sorted, expert_sorted, slot_sorted)
        )
        dropped = sum(routed) - num_kept
    if padded:
        counts, row_index = [capacity] * num_experts, expert_sorted * capacity + slot_sorted
    else:
        counts = [min(c, capacity) for c in routed] if capacity is not None else routed
        row_index = None
    return RowMap(
        num_tokens=routing.num_tokens,
        counts=counts,
        capacity=capacity if padded else None,
        routed_E=routed_E,
        dropped=dropped,
        token_of_row=routing.token_of(pair_sorted),
        weight_of_row=routing.weight_N.index_select(0, pair_sorted),
        row_index=row_index,
        expert_of_row=expert_sorted,
        slot_of_row=slot_sorted,
        routing=routing,
    )


class Ordering(abc.ABC):
    """Order (encode) tokens into expert-major rows, and I-Order (decode) them back, weighted."""

    @abc.abstractmethod
    def encode(self, x_TH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        """[T, H] -> [R, H] rows grouped by expert (`row_map.counts`)."""

    @abc.abstractmethod
    def decode(self, rows_RH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        """[R, H] -> [T, H]: each token's rows times their gate weights, summed."""


def _soft_encode(x_TH, row_map: RowMap) -> torch.Tensor:
    # Slot s = sum_t dispatch[t, s] * x_t; slots are expert-major (E x C), as the rows.
    return row_map.routing.dispatch_TZ.t().to(x_TH.dtype) @ x_TH


def _soft_decode(rows_RH, row_map: RowMap) -> torch.Tensor:
    return row_map.routing.combine_TZ.to(rows_RH.dtype) @ rows_RH


class SparseOrdering(Ordering):
    """Index gather on the way in, weighted index-add on the way out (Tutel fast encode/decode)."""

    def encode(self, x_TH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        if row_map.routing.is_soft:
            return _soft_encode(x_TH, row_map)
        kept_RH = x_TH.index_select(0, row_map.token_of_row)
        if row_map.row_index is None:
            return kept_RH
        rows_RH = x_TH.new_zeros(row_map.num_rows, x_TH.shape[1])
        return rows_RH.index_copy(0, row_map.row_index, kept_RH)

    def decode(self, rows_RH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        if row_map.routing.is_soft:
            return _soft_decode(rows_RH, row_map)
        kept_RH = rows_RH if row_map.row_index is None else rows_RH.index_select(0, row_map.row_index)
        # The gate-score weighting is fused into the scatter: one pass over the rows.
        weighted_RH = kept_RH * row_map.weight_of_row.to(rows_RH.dtype).unsqueeze(1)
        out_TH = rows_RH.new_zeros(row_map.num_tokens, rows_RH.shape[1])
        return out_TH.index_add(0, row_map.token_of_row, weighted_RH)


class DenseOrdering(Ordering):
    """GShard: one-hot dispatch mask and combine weights [T, E, C], then einsum. Needs padded rows."""

    def _masks(self, row_map: RowMap, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        num_experts, capacity = len(row_map.counts), row_map.capacity
        assert capacity is not None, "the dense ordering lays rows out padded to a capacity"
        flat = (row_map.token_of_row * num_experts + row_map.expert_of_row) * capacity + row_map.slot_of_row
        size = row_map.num_tokens * num_experts * capacity
        device = row_map.token_of_row.device
        combine = torch.zeros(size, dtype=dtype, device=device).index_put((flat,), row_map.weight_of_row.to(dtype))
        dispatch = torch.zeros(size, dtype=dtype, device=device).index_fill_(0, flat, 1.0)
        shape = (row_map.num_tokens, num_experts, capacity)
        return dispatch.view(shape), combine.view(shape)

    def encode(self, x_TH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        if row_map.routing.is_soft:
            return _soft_encode(x_TH, row_map)
        dispatch_TEC, _ = self._masks(row_map, x_TH.dtype)
        return torch.einsum("tec,th->ech", dispatch_TEC, x_TH).reshape(-1, x_TH.shape[1])

    def decode(self, rows_RH: torch.Tensor, row_map: RowMap) -> torch.Tensor:
        if row_map.routing.is_soft:
            return _soft_decode(rows_RH, row_map)
        _, combine_TEC = self._masks(row_map, rows_RH.dtype)
        rows_ECH = rows_RH.view(combine_TEC.shape[1], combine_TEC.shape[2], rows_RH.shape[1])
        return torch.einsum("tec,ech->th", combine_TEC, rows_ECH)


def build_ordering(name: str) -> Ordering:
    return {"sparse": SparseOrdering, "dense": DenseOrdering}[name]()
