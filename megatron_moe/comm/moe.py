"""The MoE layer's collectives: dispatch and combine all-to-alls, the expert-sharded (ESP) all-gather and
reduce-scatter, their planning, router statistics under SP.

Legend: G = EP group size, L = local experts, P = ESP group size, R = rows, H = hidden.

The all-to-alls are autograd functions whose backward is the reverse all-to-all (same kind, `backward=True`).
They can start asynchronously: the returned `CommHandle`'s `wait()` yields the received rows, so work placed
between start and wait overlaps the transfer; the backward mirrors it (the reverse starts where the forward
waited, `_Landed`, and is waited where it started, `_AllToAll`), and a `BackwardOverlap` runs its assigned work
before that wait. Invariants: split sizes are Python lists known on the host before the call (gloo rejects
tensors); nothing here waits for the device. More: docs/internals/comm.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, CommHandle, group_size, issue, nbytes, ring_wire_bytes
from megatron_moe.comm.hierarchy import Route
from megatron_moe.comm.transport import all_to_all_single


def _sent(record: Collective, x: torch.Tensor, splits: list[int], group, route: Route | None = None) -> Collective:
    """`record` with the bytes of an all-to-all that sends `splits[g]` rows of `x` to rank g: `nbytes` the whole
    buffer, `wire_bytes` less the block this rank sends itself (it never leaves the rank); with a `route`, the
    messages and bytes that cross nodes (`Collective.inter_node`)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    row_bytes = math.prod(x.shape[1:]) * x.element_size()  # from the shape: 2DH forwards rows where x has none
    own = splits[rank] * row_bytes if rank < len(splits) else 0
    inter = None
    if route is not None:
        messages, rows = route.crossing(splits)
        inter = (messages, rows * row_bytes)
    return dataclasses.replace(record, nbytes=nbytes(x), wire_bytes=nbytes(x) - own, inter_node=inter)


class BackwardOverlap(Protocol):
    def run_under(self, record: Collective, handle: CommHandle) -> torch.Tensor:
        """A backward all-to-all (`record`) has started: run the work that overlaps it, then `handle.wait()`."""
        ...


class _Transfer:
    """One all-to-all's rows, both ways: `send` starts the forward's rows, or (`reverse`) the gradient of its
    received rows sent back, through one `issue`.

    The reverse starts where the forward waited for the rows (`_Landed`'s backward), and the forward all-to-all's
    own backward waits for it: autograd runs the nodes made between the forward's start and wait (the shared
    expert, the other pieces' work under the operator partition) while it is in flight, as the forward ran them
    while the rows were. A call whose rows were not waited for under autograd starts it in that backward instead."""

    def __init__(self, group, out_splits: list[int], in_splits: list[int], record: Collective, route=None):
        self.group, self.out_splits, self.in_splits, self.record = group, out_splits, in_splits, record
        self.route: Route | None = route
        """The forward's route (reversed for the reverse)."""
        self.handle: CommHandle | None = None
        """The started reverse, until `take`."""

    def send(self, x: torch.Tensor, *, reverse: bool, async_op: bool = True) -> CommHandle:
        """Start `x`'s rows this all-to-all's way (`reverse`: back); the handle keeps `x` until wait()."""
        out_splits, in_splits, route, record = self.out_splits, self.in_splits, self.route, self.record
        if reverse:
            out_splits, in_splits = in_splits, out_splits
            route = None if route is None else route.reversed()
            record = dataclasses.replace(record, backward=True)
        record = _sent(record, x, in_splits, self.group, route)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = issue(
            record,
            lambda: all_to_all_single(out, x, out_splits, in_splits, group=self.group, route=route, async_op=async_op),
        )
        return CommHandle(out, work, keepalive=(x,), record=record)

    def take(self, grad: torch.Tensor) -> CommHandle:
        """The started reverse all-to-all (started now from `grad` when nothing started it)."""
        handle = self.send(grad.contiguous(), reverse=True) if self.handle is None else self.handle
        self.handle = None
        return handle


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), ...] -> rows [sum(out_splits), ...] over `group`; `works` (a list) takes the
    asynchronous transfer's handle, None: synchronous."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, record: Collective, works, overlap, transfer: _Transfer | None):
        ctx.transfer = transfer or _Transfer(group, out_splits, in_splits, record)
        ctx.overlap = overlap
        handle = ctx.transfer.send(x, reverse=False, async_op=works is not None)
        if works is None:
            return handle.wait()
        works.append(handle)  # the caller's handle waits for it
        return handle.buffer

    @staticmethod
    def backward(ctx, grad):
        # 1. the reverse all-to-all, started at the forward's wait (`_Landed`) or now; 2. the work assigned to it
        # (Lancet); 3. wait.
        handle = ctx.transfer.take(grad)
        out = handle.wait() if ctx.overlap is None else ctx.overlap.run_under(handle.record, handle)
        return out, None, None, None, None, None, None, None


class _Landed(torch.autograd.Function):
    """Identity on an all-to-all's received rows, applied where the forward waits for them. Its backward starts
    the reverse all-to-all of their gradient (`_Transfer.send`) and hands the all-to-all's node a stand-in that
    costs nothing (a zero expanded): the all-to-all's backward waits for the reverse."""

    @staticmethod
    def forward(ctx, rows, transfer: _Transfer):
        ctx.transfer = transfer
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        ctx.transfer.handle = ctx.transfer.send(grad.contiguous(), reverse=True)
        return grad.new_zeros(()).expand_as(grad), None


def _landing(transfer: _Transfer, then: Callable | None) -> Callable:
    def landed(rows):
        rows = _Landed.apply(rows, transfer)
        return rows if then is None else then(rows)

    return landed


def rows_all_to_all(
    rows_RH: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    *,
    purpose: str,
    layer: int | None = None,
    async_op: bool = True,
    then: Callable | None = None,
    overlap: BackwardOverlap | None = None,
    backward: bool = False,
    route: Route | None = None,
) -> CommHandle:
    """The MoE layer's row all-to-all (`purpose`: "dispatch", rows to the EP ranks that own their experts, or
    "combine", expert outputs back to the ranks their tokens came from): `in_splits[g]` rows to rank g,
    `out_splits[g]` from it; differentiable; `then` post-processes the received rows on wait(); `overlap` runs
    work under the backward's reverse all-to-all. `backward=True`: the call is a hand-written backward
    schedule's (inside an autograd Function's backward, no graph made), recorded as the backward pass's.
    `route`: the EP group's nodes, and 2DH's hierarchy and pairs (comm/hierarchy.py; the backward runs it
    reversed); None: linear."""
    record = Collective(f"a2a_{purpose}", f"{purpose}_all_to_all", group, layer, backward=backward)
    x = rows_RH.contiguous()
    works = [] if async_op else None
    transfer = _Transfer(group, list(out_splits), list(in_splits), record, route)
    out = _AllToAll.apply(x, transfer.out_splits, transfer.in_splits, group, record, works, overlap, transfer)
    if async_op and out.requires_grad:  # the reverse starts where the forward waits for the rows
        then = _landing(transfer, then)
    # The input must outlive an asynchronous send: the handle holds it until wait().
    record = _sent(record, x, transfer.in_splits, group, route)
    return CommHandle(out, works[0] if works else None, keepalive=(x,), then=then, record=record)


def dispatch_all_to_all(rows_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group, **options):
    """`rows_all_to_all` to the expert owners (asynchronous unless `async_op=False`)."""
    return rows_all_to_all(rows_RH, out_splits, in_splits, group, purpose="dispatch", **options)


def combine_all_to_all(rows_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group, **options):
    """`rows_all_to_all` back from the expert owners (synchronous unless `async_op=True`)."""
    options.setdefault("async_op", False)
    return rows_all_to_all(rows_RH, out_splits, in_splits, group, purpose="combine", **options)


def _native_esp(group, sizes: list[int]) -> bool:
    """Use all_gather_into_tensor / reduce_scatter_tensor: equal blocks on a backend that has them (gloo has no
    reduce_scatter and no uneven all_gather: there both go through all_to_all_single)."""
    return len(set(sizes)) == 1 and dist.get_backend(group) != "gloo"


class _NativeGather(torch.autograd.Function):
    """Equal blocks: all-gather forward, reduce-scatter backward (`gather`), or the reverse (not `gather`)."""

    @staticmethod
    def forward(ctx, x, group, record: Collective, works, gather: bool):
        ctx.group, ctx.record, ctx.gather = group, record, gather
        return _native(x, group, record, works, gather)

    @staticmethod
    def backward(ctx, grad):
        reverse = dataclasses.replace(ctx.record, backward=True)
        return _native(grad.contiguous(), ctx.group, reverse, None, not ctx.gather), None, None, None, None


def _native(x, group, record: Collective, works, gather: bool) -> torch.Tensor:
    """all_gather_into_tensor (`gather`) or reduce_scatter_tensor; asynchronous when `works` is a list."""
    p = group_size(group)
    out = x.new_empty((x.shape[0] * p if gather else x.shape[0] // p, *x.shape[1:]))
    # all-gather: this rank's block to each of the P - 1 peers; reduce-scatter: the P - 1 blocks not its own.
    wire = (p - 1) * nbytes(x) if gather else ring_wire_bytes(nbytes(x), p)
    async_op, record = works is not None, dataclasses.replace(record, nbytes=nbytes(x), wire_bytes=wire)
    if gather:
        work = issue(record, lambda: dist.all_gather_into_tensor(out, x, group=group, async_op=async_op))
    else:
        work = issue(record, lambda: dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op))
    if async_op:
        works.append(work)
    return out


def _sum_blocks(parts_RH: torch.Tensor, p: int) -> torch.Tensor:
    """[P x n, H] -> [n, H]: the P blocks added in rank order 0..P-1 (the same bits on every rank)."""
    blocks = parts_RH.view(p, -1, *parts_RH.shape[1:]).unbind(0)
    total = blocks[0]
    for block in blocks[1:]:
        total = total + block
    return total


def esp_all_gather(
    rows_RH: torch.Tensor,
    sizes: list[int],
    group,
    *,
    layer: int | None = None,
    async_op: bool = True,
    backward: bool = False,
) -> CommHandle:
    """Expert-sharded parallelism: rank p of `group` contributes its `sizes[p]` rows; `wait()` gives the
    concatenation over p [sum(sizes), H]. Differentiable: the backward is a reduce-scatter-v (each rank gets
    its own block of the gradient, summed over the group), recorded as `esp_ag` with `backward=True`.
    `backward=True` marks a call made inside a hand-written backward schedule."""
    record = Collective("esp_ag", "esp_all_gather", group, layer, backward=backward)
    rows_RH = rows_RH.contiguous()
    works = [] if async_op else None
    if _native_esp(group, sizes):
        out = _NativeGather.apply(rows_RH, group, record, works, True)
        return CommHandle(out, works[0] if works else None, keepalive=(rows_RH,))
    # all_to_all_single: my rows to every peer (the copies' gradients add up in backward: the reduce part).
    p, rank = group_size(group), dist.get_rank(group)
    sent_RH = rows_RH.repeat(p, *([1] * (rows_RH.dim() - 1)))
    out = _AllToAll.apply(sent_RH, list(sizes), [sizes[rank]] * p, group, record, works, None, None)
    return CommHandle(out, works[0] if works else None, keepalive=(sent_RH,))


def esp_reduce_scatter(
    rows_RH: torch.Tensor,
    sizes: list[int],
    group,
    *,
    layer: int | None = None,
    async_op: bool = True,
    backward: bool = False,
) -> CommHandle:
    """Expert-sharded parallelism: `rows_RH` [sum(sizes), H] holds partial sums on every rank of `group`;
    `wait()` gives this rank's block summed over the group [sizes[rank], H] (blocks added in rank order).
    Differentiable: the backward is an all-gather-v, recorded as `esp_rs` with `backward=True`."""
    record = Collective("esp_rs", "esp_reduce_scatter", group, layer, backward=backward)
    rows_RH = rows_RH.contiguous()
    works = [] if async_op else None
    if _native_esp(group, sizes):
        out = _NativeGather.apply(rows_RH, group, record, works, False)
        return CommHandle(out, works[0] if works else None, keepalive=(rows_RH,))
    # all_to_all_single: block p to rank p; then this rank's P received parts added up on wait().
    p, rank = group_size(group), dist.get_rank(group)
    out = _AllToAll.apply(rows_RH, [sizes[rank]] * p, list(sizes), group, record, works, None, None)
    return CommHandle(
        out, works[0] if works else None, keepalive=(rows_RH,), then=lambda parts_RH: _sum_blocks(parts_RH, p)
    )


def esp_gather_counts(counts_GL: torch.Tensor, group, *, layer: int | None = None) -> torch.Tensor:
    """Dispatch planning under ESP: every ESP peer's [G, L] received counts, [P, G, L] (stays on the device)."""
    counts_GL = counts_GL.contiguous()
    p = group_size(group)
    out = counts_GL.new_empty((p, *counts_GL.shape))
    wire = (p - 1) * nbytes(counts_GL)  # one copy to each peer
    record = Collective("esp_ag", "esp_gather_counts", group, layer, nbytes=nbytes(counts_GL), wire_bytes=wire)
    issue(record, lambda: all_to_all_single(out, counts_GL.expand(p, *counts_GL.shape).contiguous(), group=group))
    return out


_PLANNING: dict = {}
"""EP group -> its planning twin (`make_planning_groups`)."""


def make_planning_groups(group, timeout=None) -> None:
    """For every EP group (this rank's: `group`), a twin of the same ranks that carries the MoE layers' planning
    collectives (the counts exchange, the capacity agreement). On the EP group itself they would queue behind an
    all-to-all in flight (gloo and NCCL run one group's collectives in order), and under Lancet's operator
    partition piece i+1 plans while piece i's dispatch is on the wire: its host read of the counts would then wait
    for piece i's transfer. Collective: every rank calls it, with its own EP group; the twins go with the other
    groups (`destroy_groups_but_world`, `forget_planning_groups`)."""
    if group is None or group_size(group) == 1 or group in _PLANNING:
        return
    everyone = [None] * dist.get_world_size()
    mine = dist.get_process_group_ranks(group)
    issue(Collective("other", "planning_groups"), lambda: dist.all_gather_object(everyone, mine))
    for ranks in sorted({tuple(r) for r in everyone}):  # every rank makes every twin, in one order
        twin = dist.new_group(list(ranks), timeout=timeout, group_desc="EXPERT_MODEL_PARALLEL_PLANNING_GROUP")
        if dist.get_rank() in ranks:
            _PLANNING[group] = twin


def forget_planning_groups() -> None:
    """The run's twins are gone (its groups destroyed)."""
    _PLANNING.clear()


def planning_group(group):
    """The planning twin of `group` (itself when it has none: one rank, or no twins made)."""
    return _PLANNING.get(group, group)


def exchange_counts(counts_GL: torch.Tensor, group, *, layer: int | None = None) -> torch.Tensor:
    """Dispatch planning: row g of [G, L] goes to rank g; returns what each rank sent this one [G, L]. On the EP
    group's planning twin (`make_planning_groups`): not behind an all-to-all in flight.

    Stays on the device: the caller reads the result with its other counts in one transfer.
    """
    group = planning_group(group)
    counts_GL = counts_GL.contiguous()
    out = torch.empty_like(counts_GL)
    issue(
        _sent(Collective("a2a_dispatch", "exchange_counts", group, layer), counts_GL, [1] * len(counts_GL), group),
        lambda: all_to_all_single(out, counts_GL, group=group),
    )
    return out


def gather_counts(counts_E: torch.Tensor, group, *, layer: int | None = None) -> torch.Tensor:
    """Dispatch planning with shadow experts (moe/shadow.py): every rank's rows per expert [G, E], the same on
    every rank (the shadowing decision's agreed figures; a rank's received [G, L] is its block of columns). On
    the planning twin, as `exchange_counts`; stays on the device."""
    group = planning_group(group)
    counts_E = counts_E.contiguous()
    g = group_size(group)
    out = counts_E.new_empty((g, counts_E.numel()))
    wire = (g - 1) * nbytes(counts_E)  # one copy to each peer
    record = Collective("a2a_dispatch", "gather_counts", group, layer, nbytes=g * nbytes(counts_E), wire_bytes=wire)
    issue(record, lambda: all_to_all_single(out, counts_E.expand(g, -1).contiguous(), group=group))
    return out


def shadow_broadcast(flat: torch.Tensor, owner: int, group, *, layer: int | None = None):
    """One shadowed expert's weights (flat) from its owner (a global rank) to every rank of the EP group
    (moe/shadow.py), asynchronously: the returned work's `wait()` lands them in `flat`."""
    crossing = nbytes(flat) if dist.get_rank() == owner else 0  # what leaves this rank (a tree's relays aside)
    record = Collective("shadow", "shadow_broadcast", group, layer, nbytes=crossing, wire_bytes=crossing)
    return issue(record, lambda: dist.broadcast(flat, src=owner, group=group, async_op=True))


def shadow_reduce(flat: torch.Tensor, owner: int, group, *, layer: int | None = None):
    """The shadows' weight gradients of one expert (flat) summed into `flat` on its owner (a global rank),
    asynchronously (moe/shadow.py, backward)."""
    crossing = 0 if dist.get_rank() == owner else nbytes(flat)
    record = Collective("shadow", "shadow_reduce", group, layer, backward=True, nbytes=crossing, wire_bytes=crossing)
    return issue(record, lambda: dist.reduce(flat, dst=owner, group=group, async_op=True))


def agree_capacity(capacity_1: torch.Tensor, group, *, layer: int | None = None) -> torch.Tensor:
    """Dispatch planning: the EP group's largest capacity (long [1], on the device; not read here); on its
    planning twin, as `exchange_counts`."""
    if group_size(group) == 1:
        return capacity_1
    group = planning_group(group)
    capacity_1 = capacity_1.clone()
    issue(
        Collective("a2a_dispatch", "agree_capacity", group, layer, nbytes=nbytes(capacity_1)),
        lambda: dist.all_reduce(capacity_1, op=dist.ReduceOp.MAX, group=group),
    )
    return capacity_1


class _SumAcrossShards(torch.autograd.Function):
    """Forward: sum over `group`. Backward: identity.

    For per-sequence statistics whose tokens are sharded over the group (TP
    ranks under sequence parallelism): every rank then computes the same loss
    from the summed statistic and back-propagates into its own tokens only;
    the gradient reduce over the group adds those parts up exactly once.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        issue(Collective("tp", "sum_across_shards", group, nbytes=nbytes(x)), lambda: dist.all_reduce(x, group=group))
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_across_shards(x: torch.Tensor, group) -> torch.Tensor:
    """Router loss statistics summed over the TP ranks that hold shards of the same sequences."""
    return x if group_size(group) == 1 else _SumAcrossShards.apply(x, group)


def sum_global_batch_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """global_aux_loss's routed choices per expert of one micro-batch summed over `group` (megatron-core's TP x DP x
    CP group: every rank of the pipeline stage), in the training forward of each MoE layer; counts carry no grad."""
    if group_size(group) == 1:
        return counts_E
    counts_E = counts_E.clone()
    record = Collective("other", "sum_global_batch_counts", group, nbytes=nbytes(counts_E))
    issue(record, lambda: dist.all_reduce(counts_E, group=group))
    return counts_E
