"""Dispatch and Combine: move expert-major rows to the EP rank that owns each expert and back.

Legend: G = EP group size, E = experts (global), L = local experts (E / G),
C = capacity, R = rows, H = hidden.

A dispatcher sees rows grouped by global expert with `counts[e]` rows for
expert e (expert e lives on EP rank e // L). `dispatch` returns a handle whose
`wait()` gives a `Dispatched`: the rows of this rank's L experts grouped by
local expert, their counts, and the state `combine` needs to send the
expert outputs back into the original layout. Dispatch starts its all-to-all
asynchronously; the layer does independent work (the shared expert) before
waiting. A later hierarchical (2DH) or expert-sharded dispatcher implements
the same three methods. All collectives go through `comm.py`.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from megatron_moe.moe import comm
from megatron_moe.platform import from_host


@dataclasses.dataclass
class Dispatched:
    rows_RH: torch.Tensor
    """Rows for this rank's local experts, grouped by local expert."""
    counts: list[int]
    """Rows per local expert."""
    state: object = None
    """What `combine` needs (split sizes, permutations); opaque to the layer."""


class Dispatcher(abc.ABC):
    """Moves rows to expert owners (dispatch) and back (combine) over the EP group."""

    needs_padding: bool = False
    """True when every expert must get the same number of rows from every rank (capacity-padded)."""

    def __init__(self, group, num_experts: int):
        self.group = group
        self.group_size = comm.group_size(group)
        assert num_experts % self.group_size == 0, (num_experts, self.group_size)
        self.num_local_experts = num_experts // self.group_size

    def agree_capacity(self, capacity: int, device) -> int:
        """One capacity for the whole EP group when the layout needs it (the group maximum)."""
        return comm.all_reduce_max(capacity, self.group, device) if self.needs_padding else capacity

    @abc.abstractmethod
    def dispatch(self, rows_RH: torch.Tensor, counts: list[int]) -> comm.CommHandle:
        """Start sending; `wait()` returns a `Dispatched`."""

    @abc.abstractmethod
    def combine(self, rows_RH: torch.Tensor, dispatched: Dispatched) -> comm.CommHandle:
        """Start sending expert outputs back; `wait()` returns rows in the pre-dispatch layout."""


class PaddedAllToAll(Dispatcher):
    """Equal splits: C rows per expert from every rank (Tutel's flexible all-to-all layout)."""

    needs_padding = True

    def dispatch(self, rows_RH, counts):
        capacity = counts[0]
        assert all(c == capacity for c in counts), "the padded all-to-all needs equal counts"
        local = [capacity * self.group_size] * self.num_local_experts
        if self.group_size == 1:
            return comm.CommHandle(Dispatched(rows_RH, local))
        g, l, h = self.group_size, self.num_local_experts, rows_RH.shape[1]
        splits = [l * capacity] * g

        def regroup(received):
            # 1. received [G(source), L, C, H]; 2. each local expert's rows from all sources together.
            rows = received.view(g, l, capacity, h).transpose(0, 1).reshape(-1, h)
            return Dispatched(rows, local, capacity)

        return comm.all_to_all(rows_RH, splits, splits, self.group, async_op=True, then=regroup)

    def combine(self, rows_RH, dispatched):
        if self.group_size == 1:
            return comm.CommHandle(rows_RH)
        g, l, h, capacity = self.group_size, self.num_local_experts, rows_RH.shape[1], dispatched.state
        # 1. [L, G, C, H] -> [G(destination), L, C, H]; 2. all-to-all back to the sources.
        rows = rows_RH.view(l, g, capacity, h).transpose(0, 1).reshape(-1, h)
        splits = [l * capacity] * g
        return comm.all_to_all(rows, splits, splits, self.group)


@dataclasses.dataclass
class _VState:
    send_splits: list[int]
    recv_splits: list[int]
    to_expert: torch.Tensor | None
    """Row permutation (source, expert) -> (expert, source) chunks; None with one local expert."""
    to_source: torch.Tensor | None


def _chunk_permutation(sizes_GL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row permutation taking chunks in (source, expert) order to (expert, source) order, and back."""
    g, l = sizes_GL.shape
    sizes = sizes_GL.reshape(-1)
    starts_in = torch.cumsum(sizes, 0) - sizes
    chunk_ids = torch.arange(g * l, device=sizes.device).view(g, l).t().reshape(-1)
    sizes_out = sizes.index_select(0, chunk_ids)
    starts_out = torch.cumsum(sizes_out, 0) - sizes_out
    shift = torch.repeat_interleave(starts_in.index_select(0, chunk_ids) - starts_out, sizes_out)
    to_expert = shift + torch.arange(shift.numel(), device=sizes.device)
    to_source = torch.empty_like(to_expert).scatter_(0, to_expert, torch.arange(to_expert.numel(), device=sizes.device))
    return to_expert, to_source


class AllToAllV(Dispatcher):
    """Irregular all-to-all: exchange per-expert counts, then send exactly the routed rows."""

    def dispatch(self, rows_RH, counts):
        if self.group_size == 1:
            return comm.CommHandle(Dispatched(rows_RH, list(counts)))
        g, l = self.group_size, self.num_local_experts
        # 1. counts: rank r learns how many rows each source sends to each of its experts.
        send_GL = from_host(counts, torch.long, rows_RH.device).view(g, l)
        recv_GL = comm.exchange_counts(send_GL, self.group)
        send_splits, recv_splits = send_GL.sum(1).tolist(), recv_GL.sum(1).tolist()
        local_counts = recv_GL.sum(0).tolist()
        # 2. the exact rows; 3. on arrival, regroup (source, expert) chunks into (expert, source).
        to_expert, to_source = (None, None) if l == 1 else _chunk_permutation(recv_GL)
        state = _VState(send_splits, recv_splits, to_expert, to_source)

        def regroup(received):
            rows = received if to_expert is None else received.index_select(0, to_expert)
            return Dispatched(rows, local_counts, state)

        return comm.all_to_all(rows_RH, recv_splits, send_splits, self.group, async_op=True, then=regroup)

    def combine(self, rows_RH, dispatched):
        if self.group_size == 1:
            return comm.CommHandle(rows_RH)
        state: _VState = dispatched.state
        rows = rows_RH if state.to_source is None else rows_RH.index_select(0, state.to_source)
        return comm.all_to_all(rows, state.send_splits, state.recv_splits, self.group)


def build_dispatcher(name: str, group, num_experts: int) -> Dispatcher:
    return {"alltoall": PaddedAllToAll, "alltoallv": AllToAllV}[name](group, num_experts)
