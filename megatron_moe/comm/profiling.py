"""The cost-model profiler's collectives (megatron_moe/overlap/profiler.py): the traffic it times, and its
agreement on the result.

All are kind `other` and purpose `profile/...`: issued at start-up, between barriers, never overlapped.
Synchronous: the caller times each call between two host clock reads (after the device synchronized).

The ESP all-gather and reduce-scatter are timed in the form `comm.esp_all_gather` / `esp_reduce_scatter` take
on gloo: one `all_to_all_single` moving the same bytes, plus, for the reduce-scatter, the local sum over the P
blocks, under kind `other` so start-up measurements stay out of the MoE kinds. On NCCL those two use
all_gather_into_tensor / reduce_scatter_tensor for equal blocks, which `esp_traffic` does not time yet (its fit
is then the all-to-all form's: pessimistic).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, group_size, issue, nbytes
from megatron_moe.comm.transport import all_to_all_single


def profile_all_to_all(send: torch.Tensor, recv: torch.Tensor, group) -> None:
    """All-to-all of equal splits over `group` (the EP group): `send.numel()` elements, this rank's share."""
    record = Collective("other", "profile/all_to_all", group, nbytes=nbytes(send))
    issue(record, lambda: all_to_all_single(recv, send, group=group))


def esp_traffic(kind: str, buffer: torch.Tensor, scratch: torch.Tensor, group) -> torch.Tensor:
    """The ESP group's traffic of one all-gather ("ag": `buffer` is the gathered output, P blocks, this rank's
    block sent to every peer) or reduce-scatter ("rs": `buffer` is the input, P blocks of partial sums, block p
    sent to rank p, then summed in rank order). `scratch`: like `buffer`. Returns the result (ag: P blocks; rs:
    this rank's block)."""
    assert kind in ("ag", "rs"), kind
    p = group_size(group)
    blocks = buffer.view(p, -1)
    if kind == "ag":
        own = blocks[dist.get_rank(group)]
        send = own.expand(p, -1).contiguous()  # the gloo form sends this rank's block to every peer
        record = Collective("other", "profile/esp_all_gather", group, nbytes=nbytes(own))
        issue(record, lambda: all_to_all_single(scratch, send.view(-1), group=group))
        return scratch
    record = Collective("other", "profile/esp_reduce_scatter", group, nbytes=nbytes(buffer))
    issue(record, lambda: all_to_all_single(scratch, buffer, group=group))
    return scratch.view(p, -1).sum(dim=0)


def profile_all_reduce(buffer: torch.Tensor, group) -> None:
    """Sum `buffer` over `group` (the data-parallel group), as the gradient all-reduce does."""
    record = Collective("other", "profile/all_reduce", group, nbytes=nbytes(buffer))
    issue(record, lambda: dist.all_reduce(buffer, group=group))


def profile_barrier(group=None) -> None:
    """Every rank of `group` (None: the world) is here: a timed call starts together on all of them."""
    issue(Collective("other", "profile/barrier", group), lambda: dist.barrier(group=group))


def agree_profile(table: torch.Tensor, group=None) -> torch.Tensor:
    """In place: a fixed-shape table of measured times, the max over `group` (None: the world), so every rank
    fits the same lines. Also agrees a flag: 1 on every rank when any rank set it (a rank without the saved
    profile makes every rank measure)."""
    record = Collective("other", "profile/agree", group, nbytes=nbytes(table))
    issue(record, lambda: dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group))
    return table


def gather_rank_facts(facts: dict, group=None) -> list[dict]:
    """Every rank's `facts` (host name, node rank, device, link: picklable), in rank order of `group` (None: the
    world)."""
    everyone: list = [None] * dist.get_world_size(group)
    record = Collective("other", "profile/rank_facts", group, nbytes=len(repr(facts)))
    issue(record, lambda: dist.all_gather_object(everyone, facts, group=group))
    return everyone


def share_profile_decision(decision):
    """Rank 0's decision on the saved profile ((its fits as JSON or None, why); other ranks pass None), on every
    rank: rank 0 alone reads the file, so a profile on one disk serves every node, and every rank then takes the
    same branch (reuse, or measure)."""
    box = [decision]
    issue(Collective("other", "profile/decision"), lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def gather_group_ranks(group) -> list[list[int]]:
    """Every group of the kind of `group` (each rank gives its own, e.g. its EP group), as sorted lists of global
    ranks, sorted: the same answer on every rank. None (no such group): []."""
    mine = [] if group is None else sorted(dist.get_process_group_ranks(group))
    everyone: list = [None] * dist.get_world_size()
    record = Collective("other", "profile/group_ranks", None, nbytes=8 * len(mine))
    issue(record, lambda: dist.all_gather_object(everyone, mine))
    return [list(ranks) for ranks in sorted({tuple(ranks) for ranks in everyone if ranks})]
