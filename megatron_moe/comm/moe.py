"""The MoE layer's collectives: dispatch and combine all-to-alls, their planning, router statistics under SP.

Legend: G = EP group size, L = local experts, R = rows, H = hidden.

The all-to-alls are autograd functions whose backward is the reverse
all-to-all, recorded under the same kind with `backward=True`. They can start
asynchronously: the returned `CommHandle`'s `wait()` yields the received rows,
so work placed between start and wait (the shared expert today, chunked
experts later) overlaps with the transfer. The backward always starts the
reverse asynchronously; with a `BackwardOverlap` (Lancet's weight-gradient
queue, `megatron_moe.overlap`) the work it assigns to this all-to-all runs
before the wait. Split sizes are Python lists (gloo
rejects tensors) and are known on the host before the call: nothing here waits
for the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, CommHandle, group_size, issue, nbytes


class BackwardOverlap(Protocol):
    def run_under(self, record: Collective, handle: CommHandle) -> torch.Tensor:
        """A backward all-to-all (`record`) has started: run the work that overlaps it, then `handle.wait()`."""
        ...


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), ...] -> rows [sum(out_splits), ...] over `group`."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, record: Collective, works, overlap: BackwardOverlap | None):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.record = group, out_splits, in_splits, record
        ctx.overlap = overlap
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        async_op = works is not None
        work = issue(
            dataclasses.replace(record, nbytes=nbytes(x)),
            lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op),
        )
        if async_op:
            works.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        reverse = dataclasses.replace(ctx.record, backward=True, nbytes=nbytes(grad))
        # 1. start the reverse all-to-all; 2. the work assigned to it (Lancet); 3. wait.
        work = issue(
            reverse,
            lambda: dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group, async_op=True),
        )
        handle = CommHandle(out, work, keepalive=(grad,))
        out = handle.wait() if ctx.overlap is None else ctx.overlap.run_under(reverse, handle)
        return out, None, None, None, None, None, None


def _all_to_all(x, out_splits, in_splits, group, record: Collective, async_op: bool, then, overlap) -> CommHandle:
    x = x.contiguous()
    works = [] if async_op else None
    out = _AllToAll.apply(x, list(out_splits), list(in_splits), group, record, works, overlap)
    # The input must outlive an asynchronous send: the handle holds it until wait().
    return CommHandle(out, works[0] if works else None, keepalive=(x,), then=then)


def dispatch_all_to_all(
    rows_RH: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    *,
    layer: int | None = None,
    async_op: bool = True,
    then: Callable | None = None,
    overlap: BackwardOverlap | None = None,
) -> CommHandle:
    """Send rows to the EP ranks that own their experts (`in_splits[g]` rows to rank g, `out_splits[g]`
    from it); differentiable; `then` post-processes the received rows on wait(); `overlap` runs work under
    the backward's reverse all-to-all."""
    record = Collective("a2a_dispatch", "dispatch_all_to_all", group, layer)
    return _all_to_all(rows_RH, out_splits, in_splits, group, record, async_op, then, overlap)


def combine_all_to_all(
    rows_RH: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    *,
    layer: int | None = None,
    async_op: bool = False,
    then: Callable | None = None,
    overlap: BackwardOverlap | None = None,
) -> CommHandle:
    """Send expert outputs back to the ranks their tokens came from; differentiable."""
    record = Collective("a2a_combine", "combine_all_to_all", group, layer)
    return _all_to_all(rows_RH, out_splits, in_splits, group, record, async_op, then, overlap)


def exchange_counts(counts_GL: torch.Tensor, group, *, layer: int | None = None) -> torch.Tensor:
    """Dispatch planning: row g of [G, L] goes to rank g; returns what each rank sent this one [G, L].

    Stays on the device: the caller reads the result with its other counts in one transfer.
    """
    counts_GL = counts_GL.contiguous()
    out = torch.empty_like(counts_GL)
    issue(
        Collective("a2a_dispatch", "exchange_counts", group, layer, nbytes=nbytes(counts_GL)),
        lambda: dist.all_to_all_single(out, counts_GL, group=group),
    )
    return out


def agree_capacity(capacity_1: torch.Tensor, group, *, layer: int | None = None) -> torch.Tensor:
    """Dispatch planning: the EP group's largest capacity (long [1], on the device; not read here)."""
    if group_size(group) == 1:
        return capacity_1
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
