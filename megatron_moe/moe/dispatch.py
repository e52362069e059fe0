"""Dispatch and Combine: move expert-major rows to the EP rank that owns each expert and back.

Legend: G = EP group size, E = experts (global), L = local experts (E / G),
P = expert-sharded (ESP) group size, C = capacity, R = rows, H = hidden.

A dispatcher sees rows grouped by global expert with `counts[e]` rows for
expert e (expert e lives on EP rank e // L). Planning and moving are apart, so
that the layer waits for the device once per forward (`MoELayer.arrange`):

1. in arranging, on the device: `agree_capacity` (one C for the EP group when
   the layout needs it) and `exchange_counts` (what the other ranks send this
   one, and under ESP what every ESP peer received, when the layout needs it;
   under 2DH, --moe-a2a-algorithm, every rank's counts [G, E]: the transport
   needs every pair's rows); neither reads anything on the host;
2. the layer reads their results with its own counts in ONE device->host copy,
   and `make_splits` turns those host values into a `DispatchSplits` (split
   sizes, row permutations);
3. `dispatch(rows, splits)` returns a handle whose `wait()` gives a
   `Dispatched`: the rows of this rank's L experts grouped by local expert and
   their counts; `combine` sends the expert outputs back. Neither reads the
   device. Both start their all-to-all asynchronously; the layer does
   independent work (the shared expert, other pieces' under the operator
   partition) before waiting.

Expert-sharded parallelism (ESP, megatron-core's expert tensor parallelism): the
P ranks of an ESP group (inside a node) hold the same experts, each a 1/P slice
of every expert's FFN width. Dispatch is then
1. the EP all-to-all between ESP groups: this rank receives (source g, local expert l) blocks;
2. the ESP all-gather of those blocks unchanged: (p, g, l) blocks, every peer's in turn;
3. ONE permutation (p, g, l) -> (l, p, g): each local expert's rows together for the grouped GEMM;
and combine the reverse: the inverse permutation, the ESP reduce-scatter (the
experts' outputs are partial sums over the F slices), the all-to-all back.
Every collective goes through `megatron_moe.comm`.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from megatron_moe import comm
from megatron_moe.config.fields import require


@dataclasses.dataclass(frozen=True)
class DispatchSplits:
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
    """Received row permutation ((ESP peer,) source, expert) -> (expert, (ESP peer,) source); None when not
    needed."""
    to_source: torch.Tensor | None = None
    send_GL: list[list[int]] = dataclasses.field(default_factory=list)
    """Rows this rank sends to each (destination g, its local expert l) [G][L]."""
    received_GL: list[list[int]] = dataclasses.field(default_factory=list)
    """Rows this rank receives from each (source g, local expert l) [G][L] (padded: all C)."""
    esp_received_PGL: list[list[list[int]]] | None = None
    """Every ESP peer's `received_GL` [P][G][L]; None without ESP."""
    shadow: object = None
    """moe/shadow.py `ShadowSplit` when the layer shadows experts in this forward (their rows are not in these
    splits: computed on this rank); None otherwise."""
    sent_GE: list[list[int]] | None = None
    """Every EP rank's rows to each global expert [G][E] (row g: rank g's `send_GL`, flattened), when the transport
    needs every pair's rows (2DH, comm/hierarchy.py); None otherwise."""

    def pairs_GG(self, num_local_experts: int) -> tuple[tuple[int, ...], ...]:
        """Rows from each EP rank to each EP rank [G][G] (from `sent_GE`)."""
        l = num_local_experts
        return tuple(tuple(sum(row[d * l : (d + 1) * l]) for d in range(len(row) // l)) for row in self.sent_GE)

    @property
    def esp_splits(self) -> list[int]:
        """Rows each ESP peer contributes to the all-gather [P] (its received rows)."""
        return [sum(map(sum, received_GL)) for received_GL in self.esp_received_PGL]


@dataclasses.dataclass
class Dispatched:
    rows_RH: torch.Tensor
    """Rows for this rank's local experts, grouped by local expert."""
    counts: list[int]
    """Rows per local expert."""
    state: object = None
    """What `combine` needs (the `DispatchSplits`); opaque to the layer."""


class Dispatcher(abc.ABC):
    """Moves rows to expert owners (dispatch) and back (combine) over the EP group, and under ESP over the ESP
    group."""

    needs_padding: bool = False
    """True when every expert must get the same number of rows from every rank (capacity-padded)."""

    def __init__(self, group, num_experts: int, *, layer: int | None = None, esp_group=None, a2a: str = "linear"):
        self.group = group
        self.group_size = comm.group_size(group)
        assert num_experts % self.group_size == 0, (num_experts, self.group_size)
        self.num_local_experts = num_experts // self.group_size
        self.esp_group = esp_group
        self.esp_size = comm.group_size(esp_group)
        self.esp_rank = 0 if self.esp_size == 1 else torch.distributed.get_rank(esp_group)
        self.layer = layer
        """The MoE layer's number, named in its collectives' records (timers, watchdog)."""
        self.backward_overlap: comm.BackwardOverlap | None = None
        """Work to run under the backward all-to-alls: the run's `overlap.OverlapRuntime`, set once at set-up."""
        self.layout = comm.layout_of(group) if self.group_size > 1 else None
        """The EP group on the nodes (the all-to-alls' records count what crosses them); None: not known."""
        self.hierarchy = self._hierarchy(a2a)
        """2DH's groups (`--moe-a2a-algorithm`, comm/hierarchy.py); None: the linear all-to-all."""

    def _hierarchy(self, a2a: str) -> comm.Hierarchy | None:
        """2dh: the EP group's hierarchy, made at start-up (`comm.make_hierarchy_groups`), else an error naming the
        flag; auto: the hierarchy where start-up chose 2DH (it made the groups), else linear."""
        if a2a == "linear" or self.group_size == 1:
            return None
        hierarchy = comm.hierarchy_of(self.group)
        if a2a == "2dh":
            require(
                hierarchy is not None,
                "--moe-a2a-algorithm",
                a2a,
                "linear or auto: this EP group has no 2DH groups (made at start-up where the EP group spans several "
                "nodes with the same number of ranks on each: comm.make_hierarchy_groups)",
            )
            require(self.esp_size == 1, "--moe-a2a-algorithm", a2a, "linear: 2DH does not run under ESP (> 1)")
        return hierarchy if self.esp_size == 1 else None

    def route(self) -> comm.Route | None:
        """The all-to-alls' route without pairs (`comm.Route`): linear with the node layout, or 2DH's hierarchy;
        None: the layout is not known."""
        if self.hierarchy is not None:
            return comm.Route(self.hierarchy.layout, self.hierarchy)
        return None if self.layout is None else comm.Route(self.layout)

    def _route(self, splits: DispatchSplits) -> comm.Route | None:
        """The dispatch's route: with 2DH, the pairs of `splits`."""
        route = self.route()
        if route is None or not route.two_level:
            return route
        return dataclasses.replace(route, pairs=splits.pairs_GG(self.num_local_experts))

    @property
    def moves_rows(self) -> bool:
        """False in a single process: no EP and no ESP, the rows stay where they are."""
        return self.group_size > 1 or self.esp_size > 1

    def agree_capacity(self, capacity_1: torch.Tensor) -> torch.Tensor:
        """One capacity for the whole EP group, and under ESP for every EP group of the ESP peers too (their
        received blocks are gathered as one [P, G, L, C] layout), when the layout needs it (the maximum); long
        [1], on the device."""
        if not self.needs_padding:
            return capacity_1
        capacity_1 = comm.agree_capacity(capacity_1, self.group, layer=self.layer)
        return comm.agree_capacity(capacity_1, self.esp_group, layer=self.layer)

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor | None:
        """Start what `MoELayer.arrange` needs from the other ranks, given the rows this rank sends each expert
        (long [E], on the device). Returns a device tensor for the layer to read, or None when there is nothing to
        learn."""
        return None

    def _send(self, rows_RH: torch.Tensor, splits: DispatchSplits, regroup) -> comm.CommHandle:
        """The dispatch of `splits`; `regroup` lays out this rank's received rows in (ESP peer, source, expert)
        order on wait().

        1. the EP all-to-all (none when G = 1);
        2. under ESP, the all-gather of the received rows over the ESP group (on wait: it needs them);
        3. `regroup`.
        """

        def gathered(received_RH):
            if self.esp_size == 1:
                return regroup(received_RH)
            handle = comm.esp_all_gather(received_RH, splits.esp_splits, self.esp_group, layer=self.layer)
            return regroup(handle.wait())

        if self.group_size == 1:  # ESP only: the all-gather starts now, under the layer's independent work
            handle = comm.esp_all_gather(rows_RH, splits.esp_splits, self.esp_group, layer=self.layer)
            return comm.CommHandle(handle, then=lambda h: regroup(h.wait()))
        return comm.dispatch_all_to_all(
            rows_RH,
            splits.recv_splits,
            splits.send_splits,
            self.group,
            layer=self.layer,
            then=gathered,
            overlap=self.backward_overlap,
            route=self._route(splits),
        )

    def _send_back(self, rows_RH: torch.Tensor, splits: DispatchSplits) -> comm.CommHandle:
        """The combine of `splits`, given rows in (ESP peer, source, expert) order: under ESP the reduce-scatter of
        the partial sums over the ESP group, then the all-to-all back to the ranks they came from."""
        if self.esp_size > 1:
            rows_RH = comm.esp_reduce_scatter(rows_RH, splits.esp_splits, self.esp_group, layer=self.layer).wait()
        if self.group_size == 1:
            return comm.CommHandle(rows_RH)
        route = self._route(splits)
        return comm.combine_all_to_all(
            rows_RH,
            splits.send_splits,
            splits.recv_splits,
            self.group,
            layer=self.layer,
            async_op=True,
            overlap=self.backward_overlap,
            route=None if route is None else route.reversed(),
        )

    @abc.abstractmethod
    def make_splits(
        self, counts: list[int], received_dev: torch.Tensor | None, received: list[int] | None
    ) -> DispatchSplits:
        """The `DispatchSplits` for rows with `counts[e]` rows per expert; `received_dev` / `received`: what
        `exchange_counts` returned, on the device / read on the host."""

    @abc.abstractmethod
    def dispatch(self, rows_RH: torch.Tensor, splits: DispatchSplits) -> comm.CommHandle:
        """Start sending; `wait()` returns a `Dispatched`."""

    @abc.abstractmethod
    def combine(self, rows_RH: torch.Tensor, dispatched: Dispatched) -> comm.CommHandle:
        """Start sending expert outputs back; `wait()` returns rows in the pre-dispatch layout."""


class PaddedAllToAll(Dispatcher):
    """Equal splits: C rows per expert from every rank (Tutel's flexible all-to-all layout)."""

    needs_padding = True

    def make_splits(self, counts, received_dev=None, received=None):
        capacity = counts[0]
        assert all(c == capacity for c in counts), "the padded all-to-all needs equal counts"
        g, l, p = self.group_size, self.num_local_experts, self.esp_size
        per_rank = [l * capacity] * g
        blocks_GL = [[capacity] * l for _ in range(g)]
        return DispatchSplits(
            per_rank,
            per_rank,
            [capacity * g * p] * l,
            capacity=capacity,
            send_GL=blocks_GL,
            received_GL=blocks_GL,
            esp_received_PGL=[blocks_GL] * p if p > 1 else None,
            sent_GE=[[capacity] * (g * l)] * g if self.hierarchy is not None else None,
        )

    def dispatch(self, rows_RH, splits):
        if not self.moves_rows:
            return comm.CommHandle(Dispatched(rows_RH, splits.local_counts, splits))
        x, l, h, capacity = self.group_size * self.esp_size, self.num_local_experts, rows_RH.shape[1], splits.capacity

        def regroup(received):
            # 1. received [X = (ESP peer, source), L, C, H]; 2. each local expert's rows from all of X together.
            rows = received.view(x, l, capacity, h).transpose(0, 1).reshape(-1, h)
            return Dispatched(rows, splits.local_counts, splits)

        return self._send(rows_RH, splits, regroup)

    def combine(self, rows_RH, dispatched):
        if not self.moves_rows:
            return comm.CommHandle(rows_RH)
        splits: DispatchSplits = dispatched.state
        x, l, h = self.group_size * self.esp_size, self.num_local_experts, rows_RH.shape[1]
        # 1. [L, X, C, H] -> [X = (ESP peer, destination), L, C, H]; 2. reduce-scatter and all-to-all back.
        rows = rows_RH.view(l, x, splits.capacity, h).transpose(0, 1).reshape(-1, h)
        return self._send_back(rows, splits)


def _chunk_permutation(sizes_XL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row permutation taking chunks in (x, expert) order to (expert, x) order, and back; x = source, or under
    ESP (ESP peer, source) (X = P x G).

    `num_rows` (= sizes_XL.sum(), known on the host) sizes the output, so nothing waits for the device.
    """
    g, l = sizes_XL.shape
    sizes = sizes_XL.reshape(-1)
    starts_in = torch.cumsum(sizes, 0) - sizes
    chunk_ids = torch.arange(g * l, device=sizes.device).view(g, l).t().reshape(-1)
    sizes_out = sizes.index_select(0, chunk_ids)
    starts_out = torch.cumsum(sizes_out, 0) - sizes_out
    shift = torch.repeat_interleave(starts_in.index_select(0, chunk_ids) - starts_out, sizes_out, output_size=num_rows)
    to_expert = shift + torch.arange(num_rows, device=sizes.device)
    to_source = torch.empty_like(to_expert).scatter_(0, to_expert, torch.arange(num_rows, device=sizes.device))
    return to_expert, to_source


class AllToAllV(Dispatcher):
    """Irregular all-to-all: exchange per-expert counts in `MoELayer.arrange`, then send exactly the routed rows."""

    def exchange_counts(self, counts_E):
        if not self.moves_rows:
            return None
        # 1. rank r learns how many rows each source sends to each of its experts [G, L];
        # 2. under ESP, every ESP peer's [G, L] as well [P, G, L] (the all-gather's and the permutation's sizes).
        if self.hierarchy is not None:  # 2DH: every rank's rows per expert [G, E] (a rank's received: its columns)
            return comm.gather_counts(counts_E, self.group, layer=self.layer)
        counts_GL = counts_E.view(self.group_size, self.num_local_experts)
        if self.group_size > 1:
            counts_GL = comm.exchange_counts(counts_GL, self.group, layer=self.layer)
        if self.esp_size == 1:
            return counts_GL
        return comm.esp_gather_counts(counts_GL, self.esp_group, layer=self.layer)

    def make_splits(self, counts, received_dev, received):
        g, l, p = self.group_size, self.num_local_experts, self.esp_size
        send_GL = [counts[i * l : (i + 1) * l] for i in range(g)]
        if not self.moves_rows:
            return DispatchSplits([sum(counts)], [sum(counts)], list(counts), send_GL=send_GL, received_GL=send_GL)
        sent_GE = None
        if self.hierarchy is not None:  # `exchange_counts` gathered [G, E]: this rank's columns are its received
            e, mine = g * l, slice(self.hierarchy.layout.rank * l, (self.hierarchy.layout.rank + 1) * l)
            sent_GE = [received[i * e : (i + 1) * e] for i in range(g)]
            received = [c for row in sent_GE for c in row[mine]]
            received_dev = received_dev.view(g, e)[:, mine]
        blocks = [received[i * l : (i + 1) * l] for i in range(p * g)]  # [(ESP peer,) source] x [L]
        esp_received_PGL = [blocks[q * g : (q + 1) * g] for q in range(p)] if p > 1 else None
        received_GL = blocks if p == 1 else esp_received_PGL[self.esp_rank]
        local_counts = [sum(column) for column in zip(*blocks)]
        to_expert, to_source = (
            (None, None) if l == 1 else _chunk_permutation(received_dev.reshape(-1, l), sum(local_counts))
        )
        return DispatchSplits(
            [sum(row) for row in send_GL],
            [sum(row) for row in received_GL],
            local_counts,
            to_expert=to_expert,
            to_source=to_source,
            send_GL=send_GL,
            received_GL=received_GL,
            esp_received_PGL=esp_received_PGL,
            sent_GE=sent_GE,
        )

    def dispatch(self, rows_RH, splits):
        if not self.moves_rows:
            return comm.CommHandle(Dispatched(rows_RH, splits.local_counts, splits))

        def regroup(received):
            # The exact rows arrive in ((ESP peer,) source, expert) chunks: regroup them into (expert, ...).
            rows = received if splits.to_expert is None else received.index_select(0, splits.to_expert)
            return Dispatched(rows, splits.local_counts, splits)

        return self._send(rows_RH, splits, regroup)

    def combine(self, rows_RH, dispatched):
        if not self.moves_rows:
            return comm.CommHandle(rows_RH)
        splits: DispatchSplits = dispatched.state
        rows = rows_RH if splits.to_source is None else rows_RH.index_select(0, splits.to_source)
        return self._send_back(rows, splits)


def build_dispatcher(
    name: str, group, num_experts: int, *, layer: int | None = None, esp_group=None, a2a: str = "linear"
) -> Dispatcher:
    """`name`: `padded_alltoall` (C rows per expert from every rank, --moe-pad-expert-input-to-capacity) or
    `alltoallv` (exact rows); Megatron-LM's `--moe-token-dispatcher-type alltoall` is either one
    (`MoELayerConfig.dispatcher` picks). `a2a`: --moe-a2a-algorithm (linear, 2dh, auto)."""
    dispatcher = {"padded_alltoall": PaddedAllToAll, "alltoallv": AllToAllV}[name]
    return dispatcher(group, num_experts, layer=layer, esp_group=esp_group, a2a=a2a)
