"""Dispatch and Combine: move expert-major rows to the EP rank that owns each expert and back.

Legend: G = EP group size, E = experts (global), L = local experts (E / G),
C = capacity, R = rows, H = hidden.

A dispatcher sees rows grouped by global expert with `counts[e]` rows for
expert e (expert e lives on EP rank e // L). Planning and moving are apart, so
that the layer waits for the device once per forward (`MoELayer.plan`):

1. in planning, on the device: `agree_capacity` (one C for the EP group when
   the layout needs it) and `exchange_counts` (what the other ranks send this
   one, when the layout needs it); neither reads anything on the host;
2. the layer reads their results with its own counts in ONE device->host copy,
   and `plan_dispatch` turns those host values into a `DispatchPlan` (split
   sizes, row permutations);
3. `dispatch(rows, plan)` returns a handle whose `wait()` gives a
   `Dispatched`: the rows of this rank's L experts grouped by local expert and
   their counts; `combine` sends the expert outputs back. Neither reads the
   device. Dispatch starts its all-to-all asynchronously; the layer does
   independent work (the shared expert) before waiting.

A later hierarchical (2DH) or expert-sharded dispatcher implements the same
methods. Every collective goes through `megatron_moe.comm`.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from megatron_moe import comm


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """One dispatch's split sizes, known on the host before any row moves."""

    send_splits: list[int]
    """Rows to each EP rank [G]."""
    recv_splits: list[int]
    """Rows from each EP rank [G]."""
    local_counts: list[int]
    """Rows per local expert after dispatch [L]."""
    capacity: int | None = None
    """Rows per (source rank, expert) when padded."""
    to_expert: torch.Tensor | None = None
    """Received row permutation (source, expert) -> (expert, source); None when not needed."""
    to_source: torch.Tensor | None = None


@dataclasses.dataclass
class Dispatched:
    rows_RH: torch.Tensor
    """Rows for this rank's local experts, grouped by local expert."""
    counts: list[int]
    """Rows per local expert."""
    state: object = None
    """What `combine` needs (the `DispatchPlan`); opaque to the layer."""


class Dispatcher(abc.ABC):
    """Moves rows to expert owners (dispatch) and back (combine) over the EP group."""

    needs_padding: bool = False
    """True when every expert must get the same number of rows from every rank (capacity-padded)."""

    def __init__(self, group, num_experts: int, *, layer: int | None = None):
        self.group = group
        self.group_size = comm.group_size(group)
        assert num_experts % self.group_size == 0, (num_experts, self.group_size)
        self.num_local_experts = num_experts // self.group_size
        self.layer = layer
        """The MoE layer's number, named in its collectives' records (timers, watchdog)."""
        self.backward_overlap: comm.BackwardOverlap | None = None
        """Work to run under the backward all-to-alls (Lancet's weight-gradient queue, `megatron_moe.overlap`)."""

    def agree_capacity(self, capacity_1: torch.Tensor) -> torch.Tensor:
        """One capacity for the whole EP group when the layout needs it (the group maximum); long [1], on the
        device."""
        if not self.needs_padding:
            return capacity_1
        return comm.agree_capacity(capacity_1, self.group, layer=self.layer)

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor | None:
        """Start what planning needs from the other ranks, given the rows this rank sends each expert (long [E],
        on the device). Returns a device tensor for the layer to read, or None when there is nothing to learn."""
        return None

    def _send(self, rows_RH: torch.Tensor, plan: DispatchPlan, regroup) -> comm.CommHandle:
        """The dispatch all-to-all of `plan`; `regroup` lays out the received rows on wait()."""
        return comm.dispatch_all_to_all(
            rows_RH,
            plan.recv_splits,
            plan.send_splits,
            self.group,
            layer=self.layer,
            then=regroup,
            overlap=self.backward_overlap,
        )

    def _send_back(self, rows_RH: torch.Tensor, plan: DispatchPlan) -> comm.CommHandle:
        """The combine all-to-all of `plan`: rows back to the ranks they came from."""
        return comm.combine_all_to_all(
            rows_RH, plan.send_splits, plan.recv_splits, self.group, layer=self.layer, overlap=self.backward_overlap
        )

    @abc.abstractmethod
    def plan_dispatch(
        self, counts: list[int], received_D: torch.Tensor | None, received: list[int] | None
    ) -> DispatchPlan:
        """The `DispatchPlan` for rows with `counts[e]` rows per expert; `received_D` / `received`: what
        `exchange_counts` returned, on the device / read on the host."""

    @abc.abstractmethod
    def dispatch(self, rows_RH: torch.Tensor, plan: DispatchPlan) -> comm.CommHandle:
        """Start sending; `wait()` returns a `Dispatched`."""

    @abc.abstractmethod
    def combine(self, rows_RH: torch.Tensor, dispatched: Dispatched) -> comm.CommHandle:
        """Start sending expert outputs back; `wait()` returns rows in the pre-dispatch layout."""


class PaddedAllToAll(Dispatcher):
    """Equal splits: C rows per expert from every rank (Tutel's flexible all-to-all layout)."""

    needs_padding = True

    def plan_dispatch(self, counts, received_D=None, received=None):
        capacity = counts[0]
        assert all(c == capacity for c in counts), "the padded all-to-all needs equal counts"
        g, l = self.group_size, self.num_local_experts
        splits = [l * capacity] * g
        return DispatchPlan(splits, splits, [capacity * g] * l, capacity=capacity)

    def dispatch(self, rows_RH, plan):
        if self.group_size == 1:
            return comm.CommHandle(Dispatched(rows_RH, plan.local_counts, plan))
        g, l, h, capacity = self.group_size, self.num_local_experts, rows_RH.shape[1], plan.capacity

        def regroup(received):
            # 1. received [G(source), L, C, H]; 2. each local expert's rows from all sources together.
            rows = received.view(g, l, capacity, h).transpose(0, 1).reshape(-1, h)
            return Dispatched(rows, plan.local_counts, plan)

        return self._send(rows_RH, plan, regroup)

    def combine(self, rows_RH, dispatched):
        if self.group_size == 1:
            return comm.CommHandle(rows_RH)
        plan: DispatchPlan = dispatched.state
        g, l, h = self.group_size, self.num_local_experts, rows_RH.shape[1]
        # 1. [L, G, C, H] -> [G(destination), L, C, H]; 2. all-to-all back to the sources.
        rows = rows_RH.view(l, g, plan.capacity, h).transpose(0, 1).reshape(-1, h)
        return self._send_back(rows, plan)


def _chunk_permutation(sizes_GL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row permutation taking chunks in (source, expert) order to (expert, source) order, and back.

    `num_rows` (= sizes_GL.sum(), known on the host) sizes the output, so nothing waits for the device.
    """
    g, l = sizes_GL.shape
    sizes = sizes_GL.reshape(-1)
    starts_in = torch.cumsum(sizes, 0) - sizes
    chunk_ids = torch.arange(g * l, device=sizes.device).view(g, l).t().reshape(-1)
    sizes_out = sizes.index_select(0, chunk_ids)
    starts_out = torch.cumsum(sizes_out, 0) - sizes_out
    shift = torch.repeat_interleave(starts_in.index_select(0, chunk_ids) - starts_out, sizes_out, output_size=num_rows)
    to_expert = shift + torch.arange(num_rows, device=sizes.device)
    to_source = torch.empty_like(to_expert).scatter_(0, to_expert, torch.arange(num_rows, device=sizes.device))
    return to_expert, to_source


class AllToAllV(Dispatcher):
    """Irregular all-to-all: exchange per-expert counts in planning, then send exactly the routed rows."""

    def exchange_counts(self, counts_E):
        if self.group_size == 1:
            return None
        # Rank r learns how many rows each source sends to each of its experts.
        counts_GL = counts_E.view(self.group_size, self.num_local_experts)
        return comm.exchange_counts(counts_GL, self.group, layer=self.layer)

    def plan_dispatch(self, counts, received_D, received):
        if self.group_size == 1:
            return DispatchPlan([sum(counts)], [sum(counts)], list(counts))
        g, l = self.group_size, self.num_local_experts
        recv_GL = [received[i * l : (i + 1) * l] for i in range(g)]
        send_splits = [sum(counts[i * l : (i + 1) * l]) for i in range(g)]
        recv_splits = [sum(row) for row in recv_GL]
        to_expert, to_source = (None, None) if l == 1 else _chunk_permutation(received_D, sum(recv_splits))
        local_counts = [sum(column) for column in zip(*recv_GL)]
        return DispatchPlan(send_splits, recv_splits, local_counts, to_expert=to_expert, to_source=to_source)

    def dispatch(self, rows_RH, plan):
        if self.group_size == 1:
            return comm.CommHandle(Dispatched(rows_RH, plan.local_counts, plan))

        def regroup(received):
            # The exact rows arrive in (source, expert) chunks: regroup them into (expert, source).
            rows = received if plan.to_expert is None else received.index_select(0, plan.to_expert)
            return Dispatched(rows, plan.local_counts, plan)

        return self._send(rows_RH, plan, regroup)

    def combine(self, rows_RH, dispatched):
        if self.group_size == 1:
            return comm.CommHandle(rows_RH)
        plan: DispatchPlan = dispatched.state
        rows = rows_RH if plan.to_source is None else rows_RH.index_select(0, plan.to_source)
        return self._send_back(rows, plan)


def build_dispatcher(name: str, group, num_experts: int, *, layer: int | None = None) -> Dispatcher:
    return {"alltoall": PaddedAllToAll, "alltoallv": AllToAllV}[name](group, num_experts, layer=layer)
