"""The MoE layer's collectives, and nothing else: every collective call lives here.

All-to-alls are autograd functions (backward is the reverse all-to-all) that
can be started asynchronously: `all_to_all(..., async_op=True)` returns a
`CommHandle` whose `wait()` yields the received tensor, so work placed
between start and wait (the shared expert today, chunked experts later)
overlaps with the transfer. Split sizes are Python lists: gloo rejects tensors.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class CommHandle:
    """A started collective; `wait()` finishes it and returns its (post-processed) result."""

    def __init__(self, result, work=None, keepalive=(), then: Callable | None = None):
        self._result, self._work, self._keepalive, self._then = result, work, keepalive, then

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work, self._keepalive = None, ()
        if self._then is not None:
            self._result, self._then = self._then(self._result), None
        return self._result


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), ...] -> rows [sum(out_splits), ...] over `group`."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, works):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=works is not None)
        if works is not None:
            works.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, *,
               async_op: bool = False, then: Callable | None = None) -> CommHandle:  # fmt: skip
    """Differentiable all-to-all of rows; `then` post-processes the received rows on wait()."""
    x = x.contiguous()
    works = [] if async_op else None
    out = _AllToAll.apply(x, list(out_splits), list(in_splits), group, works)
    # The input must outlive an asynchronous send: the handle holds it until wait().
    return CommHandle(out, works[0] if works else None, keepalive=(x,), then=then)


def exchange_counts(counts_GE: torch.Tensor, group) -> torch.Tensor:
    """Each rank sends row g of [G, E_local] to rank g; returns what each rank sent it [G, E_local]."""
    out = torch.empty_like(counts_GE)
    dist.all_to_all_single(out, counts_GE.contiguous(), group=group)
    return out


def all_reduce_max(value: int, group, device) -> int:
    if group_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_reduce_sum_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over `group` (the world when None); a no-op without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor


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
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_across_shards(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _SumAcrossShards.apply(x, group)
