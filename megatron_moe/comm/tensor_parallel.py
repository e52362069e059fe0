"""The tensor-parallel collectives of megatron_moe's own copy of megatron-core's linear backward.

`megatron_moe.overlap.linears` runs megatron-core's
`LinearWithGradAccumulationAndAsyncCommunication` arithmetic with the weight
gradient handed to a store; its collectives are the ones megatron-core issues
there (all-gather of the sequence-parallel input, reduce-scatter or all-reduce
of the input gradient), issued here as kind `tp`, asynchronously: each returns
a work handle (or None when it already finished) to `wait()` on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, issue, nbytes


def gather_sequence_shards(out: torch.Tensor, x: torch.Tensor, group):
    """`out` [G * S, ...] <- every TP rank's `x` [S, ...], in rank order (SP: the linear's whole input)."""
    record = Collective("tp", "gather_sequence_shards", group, nbytes=nbytes(x))
    return issue(record, lambda: dist.all_gather_into_tensor(out, x, group=group, async_op=True))


def reduce_scatter_sequence(out: torch.Tensor, x: torch.Tensor, group):
    """`out` [S, ...] <- this rank's shard of the sum over TP ranks of `x` [G * S, ...] (SP input gradient)."""
    record = Collective("tp", "reduce_scatter_sequence", group, nbytes=nbytes(x))
    return issue(record, lambda: dist.reduce_scatter_tensor(out, x, group=group, async_op=True))


def all_reduce_input_grad(x: torch.Tensor, group):
    """`x` <- its sum over the TP ranks, in place (a column-parallel input gradient without SP)."""
    record = Collective("tp", "all_reduce_input_grad", group, nbytes=nbytes(x))
    return issue(record, lambda: dist.all_reduce(x, group=group, async_op=True))
