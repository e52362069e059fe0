"""Dispatch and combine: move expert-major rows to the EP rank that owns each expert and back.

Legend: G = EP group size, E = experts (global), L = local experts (E / G),
P = expert-sharded (ESP) group size, C = capacity, R = rows, H = hidden.

In: rows grouped by global expert, `counts[e]` rows for expert e (owned by EP rank e // L). Planning and moving
are apart, so the layer waits for the device once per forward (`MoELayer.arrange`): `agree_capacity` and
`exchange_counts` start on the device, the layer reads them in one host read, `make_splits` turns the host
values into a `DispatchSplits`. `dispatch(rows, splits)` -> handle, `wait()` -> `Dispatched` (this rank's L
experts' rows grouped by local expert); `combine` sends the outputs back. Neither reads the device; both start
asynchronously. `chunk_transport()` gives the same moves per chunk (moe/pipeline.py). Under ESP the received
blocks are all-gathered over the ESP group and the outputs (partial sums) reduce-scattered. `Shadowing` is the
splits' transform for shadowed experts (identity here; moe/shadow.py). Every collective goes through
`megatron_moe.comm`. The phases: docs/internals/moe.md.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from megatron_moe import comm
from megatron_moe.config.fields import require


class Shadowing:
    """How one forward's rows go around dispatch -> experts -> combine when some experts are shadowed (their
    weights come to the rows: moe/shadow.py `ShadowPlan`). This base is the identity: nothing shadowed, every
    row dispatched, the experts' store as it is. The layer calls, in order: `sent_counts`, `split` (before the
    dispatch), `start` (after it started), `experts_options` or `owner_store` (the experts' stage, unpipelined or
    pipelined), `compute` (while the combine is in flight), `merge` (after it)."""

    shadowed: tuple[int, ...] = ()
    """The global experts shadowed (ascending); none here."""

    def sent_counts(self, counts: list[int]) -> list[int]:
        """The dispatch's rows per global expert [E], given the send buffer's."""
        return counts

    def split(self, rows_RH: torch.Tensor) -> torch.Tensor:
        """The rows to dispatch (the rest stay on this rank)."""
        return rows_RH

    def start(self) -> None:
        """Start what the kept rows need (issued after the dispatch's all-to-all)."""

    def owner_store(self, store):
        """The `WeightGradStore` this forward's experts' node hands its dW closure to."""
        return store

    def experts_options(self) -> dict:
        """The keyword arguments of the experts' call on the dispatched rows (here none)."""
        return {}

    def compute(self) -> None:
        """Compute the kept rows (after the experts' node: see moe/shadow.py)."""

    def merge(self, rows_RH: torch.Tensor) -> torch.Tensor:
        """The combined rows with the kept rows' results, in the send buffer's order."""
        return rows_RH


NO_SHADOWING = Shadowing()


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
    shadow: Shadowing = dataclasses.field(default_factory=lambda: NO_SHADOWING)
    """The experts this forward shadows (moe/shadow.py `ShadowPlan`: their rows are not in these splits, they are
    computed on this rank); `NO_SHADOWING`: none."""
    sent_GE: list[list[int]] | None = None
    """Every EP rank's rows to each global expert [G][E] (row g: rank g's `send_GL`, flattened), when the transport
    needs every pair's rows (2DH, comm/hierarchy.py); None otherwise."""

    @property
    def pairs(self) -> tuple[tuple[int, ...], ...] | None:
        """Rows from each EP rank to each EP rank [G][G] (from `sent_GE`); None without it."""
        if self.sent_GE is None:
            return None
        l = len(self.sent_GE[0]) // len(self.sent_GE)
        return tuple(tuple(sum(row[d * l : (d + 1) * l]) for d in range(len(row) // l)) for row in self.sent_GE)

    @property
    def esp_sizes(self) -> list[int]:
        """Rows each ESP peer contributes to the all-gather [P] (its received rows)."""
        return [sum(map(sum, received_GL)) for received_GL in self.esp_received_PGL]


class ChunkTransport:
    """A dispatcher's per-chunk moves of rows, for callers that split a dispatch into chunks (moe/pipeline.py):
    the EP all-to-alls of a chunk's rows to the expert owners and back, and with P > 1 the ESP all-gather and
    reduce-scatter, forward or inside a backward (every one through `megatron_moe.comm`). A chunk is any object
    with `send_splits`, `recv_splits` [G], `esp_sizes` [P], `to_expert` / `to_source` (row permutations or None)
    and `pairs` (2DH's [G][G] or None). Made by `Dispatcher.chunk_transport`; `ChunkTransport(None, None, None,
    None)` moves nothing (one process)."""

    def __init__(self, ep_group, esp_group, layer: int | None, overlap: comm.BackwardOverlap | None, route=None):
        self.ep_group, self.esp_group, self.layer, self.overlap = ep_group, esp_group, layer, overlap
        self.ep_size, self.esp_size = comm.group_size(ep_group), comm.group_size(esp_group)
        self.route: comm.Route | None = route
        """The dispatcher's route without pairs (`Dispatcher.route`); each chunk adds its own pairs (2DH)."""

    def _route(self, chunk, *, reverse: bool) -> comm.Route | None:
        """The route of the chunk's all-to-all to the expert owners, or back (`reverse`)."""
        route = self.route
        if route is None:
            return None
        if route.two_level:
            route = dataclasses.replace(route, pairs=chunk.pairs)
        return route.reversed() if reverse else route

    def way(self, chunk, *, to_experts: bool, backward: bool) -> tuple[list[int], list[int], dict]:
        """The chunk's all-to-all to the expert owners (`to_experts`) or back, in forward or inside a backward:
        (out_splits, in_splits, the other arguments of `comm.rows_all_to_all`). A backward one is the reverse of
        the other way's (the dispatch's way back is the combine's reverse); in forward, its own reverse runs
        `overlap`'s work."""
        splits = (chunk.recv_splits, chunk.send_splits) if to_experts else (chunk.send_splits, chunk.recv_splits)
        options = dict(
            purpose="dispatch" if to_experts != backward else "combine",
            layer=self.layer,
            async_op=True,
            backward=backward,
            route=self._route(chunk, reverse=not to_experts),
            overlap=None if backward else self.overlap,
        )
        return *splits, options

    def to_experts(self, rows_RH: torch.Tensor, chunk, *, backward: bool, then=None) -> comm.CommHandle:
        """Start the chunk's rows (forward: tokens; backward: the output gradient) to the expert owners; `then`
        post-processes the received rows on wait()."""
        if self.ep_size == 1:
            return comm.CommHandle(rows_RH, then=then)
        out_splits, in_splits, options = self.way(chunk, to_experts=True, backward=backward)
        return comm.rows_all_to_all(rows_RH, out_splits, in_splits, self.ep_group, then=then, **options)

    def from_experts(self, rows_RH: torch.Tensor, chunk, *, backward: bool) -> comm.CommHandle:
        """Start the chunk's expert results (forward: outputs; backward: dX) back to the ranks of their tokens."""
        if self.ep_size == 1:
            return comm.CommHandle(rows_RH)
        out_splits, in_splits, options = self.way(chunk, to_experts=False, backward=backward)
        return comm.rows_all_to_all(rows_RH, out_splits, in_splits, self.ep_group, **options)

    def wait(self, handle: comm.CommHandle, *, backward: bool) -> torch.Tensor:
        """A backward all-to-all is waited under the work the overlap puts there (Lancet's planned dW)."""
        if backward and self.overlap is not None and handle.record is not None:
            return self.overlap.run_under(handle.record, handle)
        return handle.wait()

    def gather(self, rows: torch.Tensor, chunk, *, backward: bool) -> torch.Tensor:
        """Received rows in (g, l) order -> [ESP all-gather: (p, g, l)] -> each local expert's rows together."""
        if self.esp_size > 1:
            gather = comm.esp_all_gather  # the ESP branch's collective; only reached with an ESP group
            rows = gather(rows, chunk.esp_sizes, self.esp_group, layer=self.layer, backward=backward).wait()
        return rows if chunk.to_expert is None else rows.index_select(0, chunk.to_expert)

    def scatter(self, rows: torch.Tensor, chunk, *, backward: bool) -> torch.Tensor:
        """`gather`'s reverse: (l, x) -> (x, l) order [-> ESP reduce-scatter of the partial sums]."""
        rows = rows if chunk.to_source is None else rows.index_select(0, chunk.to_source)
        if self.esp_size > 1:
            scatter = comm.esp_reduce_scatter
            rows = scatter(rows, chunk.esp_sizes, self.esp_group, layer=self.layer, backward=backward).wait()
        return rows


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

    def chunk_transport(self) -> ChunkTransport:
        """This dispatcher's groups, route and backward overlap as a per-chunk transport (moe/pipeline.py)."""
        return ChunkTransport(self.group, self.esp_group, self.layer, self.backward_overlap, route=self.route())

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

    def dispatch(self, rows_RH: torch.Tensor, splits: DispatchSplits) -> comm.CommHandle:
        """Start sending; `wait()` returns a `Dispatched`.

        1. the EP all-to-all (none when G = 1);
        2. under ESP, the all-gather of the received rows over the ESP group (on wait: it needs them);
        3. `regroup`: the rows, in ((ESP peer,) source, expert) order, grouped by local expert.
        """
        if not self.moves_rows:
            return comm.CommHandle(Dispatched(rows_RH, splits.local_counts, splits))

        def grouped(received_RH):  # 3.
            return Dispatched(self.regroup(received_RH, splits), splits.local_counts, splits)

        def landed(received_RH):  # 2., 3.
            if self.esp_size > 1:
                handle = comm.esp_all_gather(received_RH, splits.esp_sizes, self.esp_group, layer=self.layer)
                received_RH = handle.wait()
            return grouped(received_RH)

        if self.group_size == 1:  # ESP only: the all-gather starts now, under the layer's independent work
            handle = comm.esp_all_gather(rows_RH, splits.esp_sizes, self.esp_group, layer=self.layer)
            return comm.CommHandle(handle, then=lambda started: grouped(started.wait()))
        # 1. (the whole send as one chunk, the way the pipeline's chunks go: `ChunkTransport.way`)
        out_splits, in_splits, options = self.chunk_transport().way(splits, to_experts=True, backward=False)
        return comm.rows_all_to_all(rows_RH, out_splits, in_splits, self.group, then=landed, **options)

    def combine(self, rows_RH: torch.Tensor, dispatched: Dispatched) -> comm.CommHandle:
        """Start sending expert outputs back; `wait()` returns rows in the pre-dispatch layout.

        1. `ungroup`: (local expert, ...) -> ((ESP peer,) destination, expert) order;
        2. under ESP, the reduce-scatter of the partial sums over the ESP group;
        3. the EP all-to-all back to the ranks the rows came from (none when G = 1).
        """
        if not self.moves_rows:
            return comm.CommHandle(rows_RH)
        splits: DispatchSplits = dispatched.state
        rows_RH = self.ungroup(rows_RH, splits)
        if self.esp_size > 1:
            rows_RH = comm.esp_reduce_scatter(rows_RH, splits.esp_sizes, self.esp_group, layer=self.layer).wait()
        if self.group_size == 1:  # ESP only
            return comm.CommHandle(rows_RH)
        out_splits, in_splits, options = self.chunk_transport().way(splits, to_experts=False, backward=False)  # 3.
        return comm.rows_all_to_all(rows_RH, out_splits, in_splits, self.group, **options)

    @abc.abstractmethod
    def make_splits(
        self, counts: list[int], received_dev: torch.Tensor | None, received: list[int] | None
    ) -> DispatchSplits:
        """The `DispatchSplits` for rows with `counts[e]` rows per expert; `received_dev` / `received`: what
        `exchange_counts` returned, on the device / read on the host."""

    @abc.abstractmethod
    def regroup(self, received_RH: torch.Tensor, splits: DispatchSplits) -> torch.Tensor:
        """The received rows, in ((ESP peer,) source, expert) order, grouped by local expert."""

    @abc.abstractmethod
    def ungroup(self, rows_RH: torch.Tensor, splits: DispatchSplits) -> torch.Tensor:
        """`regroup`'s reverse, on the experts' outputs."""


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

    def regroup(self, received_RH, splits):
        # [X = (ESP peer, source), L, C, H] -> each local expert's rows from all of X together [L, X, C, H].
        x, l, h = self.group_size * self.esp_size, self.num_local_experts, received_RH.shape[1]
        return received_RH.view(x, l, splits.capacity, h).transpose(0, 1).reshape(-1, h)

    def ungroup(self, rows_RH, splits):
        # [L, X, C, H] -> [X = (ESP peer, destination), L, C, H].
        x, l, h = self.group_size * self.esp_size, self.num_local_experts, rows_RH.shape[1]
        return rows_RH.view(l, x, splits.capacity, h).transpose(0, 1).reshape(-1, h)


def chunk_permutation(sizes_XL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
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
            (None, None) if l == 1 else chunk_permutation(received_dev.reshape(-1, l), sum(local_counts))
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

    def regroup(self, received_RH, splits):
        # The exact rows arrive in ((ESP peer,) source, expert) chunks: regroup them into (expert, ...).
        return received_RH if splits.to_expert is None else received_RH.index_select(0, splits.to_expert)

    def ungroup(self, rows_RH, splits):
        return rows_RH if splits.to_source is None else rows_RH.index_select(0, splits.to_source)


def build_dispatcher(
    name: str, group, num_experts: int, *, layer: int | None = None, esp_group=None, a2a: str = "linear"
) -> Dispatcher:
    """`name`: `padded_alltoall` (C rows per expert from every rank, --moe-pad-expert-input-to-capacity) or
    `alltoallv` (exact rows); Megatron-LM's `--moe-token-dispatcher-type alltoall` is either one
    (`MoELayerConfig.dispatcher` picks). `a2a`: --moe-a2a-algorithm (linear, 2dh, auto)."""
    dispatcher = {"padded_alltoall": PaddedAllToAll, "alltoallv": AllToAllV}[name]
    return dispatcher(group, num_experts, layer=layer, esp_group=esp_group, a2a=a2a)
