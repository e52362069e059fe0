"""Collectives in the form each backend runs best, under `issue` (called only inside a `start` lambda).

`all_to_all_single` is torch.distributed's on NCCL. On gloo it is point-to-point messages with every receive
posted before any send: gloo's own all_to_all_single runs the two directions of a TCP pair one after the other
about every other call once a peer's message passes ~1 MiB (measured on the emulated cluster, 2 nodes at
0.5 Gbit/s, 4 MiB per rank: 32-35 ms or 63-66 ms, alternating; the same bytes as irecv-then-isend: 34.5-35.1 ms
in every call, and an asynchronous one overlaps a GEMM as fully). A sender whose peer has not posted its
receive waits for it, so each rank posts all of its receives first; then the sends, starting from the next
rank so that no rank is every rank's first destination; then its own block, copied locally.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from megatron_moe.comm.hierarchy import transpose_blocks


def _offsets(splits: list[int]) -> list[int]:
    out, total = [], 0
    for s in splits:
        out.append(total)
        total += s
    return out


def all_to_all_single(out, inp, out_splits=None, in_splits=None, *, group=None, route=None, async_op: bool = False):
    """`torch.distributed.all_to_all_single` along dim 0 (splits in rows; None: equal blocks). With a `route` (a
    `hierarchy.Route` or None) that has a hierarchy: `all_to_all_2dh` (the dispatch/combine's 2DH; the same rows
    land in the same places)."""
    if route is not None and route.two_level:
        route.check(out_splits, in_splits)
        return all_to_all_2dh(out, inp, route, async_op=async_op)
    if dist.get_backend(group) != "gloo":
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    out_splits = list(out_splits) if out_splits else [out.shape[0] // size] * size
    in_splits = list(in_splits) if in_splits else [inp.shape[0] // size] * size
    out_at, in_at = _offsets(out_splits), _offsets(in_splits)
    peers = [(rank + i) % size for i in range(1, size)]
    works = [
        dist.irecv(out[out_at[p] : out_at[p] + out_splits[p]], group=group, group_src=p) for p in peers if out_splits[p]
    ]
    works += [
        dist.isend(inp[in_at[p] : in_at[p] + in_splits[p]], group=group, group_dst=p) for p in peers if in_splits[p]
    ]
    out[out_at[rank] : out_at[rank] + out_splits[rank]].copy_(inp[in_at[rank] : in_at[rank] + in_splits[rank]])
    handle = PointToPointWork(works)
    if async_op:
        return handle
    handle.wait()
    return None


def all_to_all_2dh(out, inp, route, *, async_op: bool = False):
    """`all_to_all_single(out, inp, out_splits, in_splits)` over the EP group of `route` (a `hierarchy.Route` with
    its hierarchy and pairs), as Tutel's 2DH all-to-all (phases in comm/hierarchy.py): the same rows land in the
    same places. Phase 2 is waited inside the call (on NCCL a stream wait); phase 4 is returned (`async_op`)."""
    plan, hierarchy = route.plan, route.hierarchy
    staged = inp
    if hierarchy.layout.per_node > 1:
        staged = transpose_blocks(inp, plan.out_NL)  # 1.
        mid = inp.new_empty((sum(plan.intra_recv), *inp.shape[1:]))
        all_to_all_single(mid, staged, plan.intra_recv, plan.intra_send, group=hierarchy.intra)  # 2.
        staged = transpose_blocks(mid, plan.mid_LN)  # 3.
    return all_to_all_single(out, staged, plan.inter_recv, plan.inter_send, group=hierarchy.inter, async_op=async_op)


class PointToPointWork:
    """The messages of one collective as one work handle: `wait()` waits for all of them, once.

    `get_future()` (what the communication timers read for the completion time on CPU; gloo's send and receive
    works have none) starts a thread that waits for the messages and completes the future; `wait()` then waits
    for that future (a gloo work waited from two threads never returns)."""

    def __init__(self, works: list):
        self._works = works
        self._future: torch.futures.Future | None = None
        self._done = not works

    def _wait_works(self) -> None:
        for work in self._works:
            work.wait()

    def wait(self, timeout=None) -> bool:
        if not self._done:
            if self._future is not None:
                self._future.wait()
            else:
                self._wait_works()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self._future is not None and self._future.done())

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            future = self._future = torch.futures.Future()
            if self._done:
                future.set_result(None)
            else:

                def finish():
                    try:
                        self._wait_works()
                        future.set_result(None)
                    except Exception as error:  # noqa: BLE001 -- handed to whoever waits
                        future.set_exception(error)

                threading.Thread(target=finish, name="p2p-wait", daemon=True).start()
        return self._future
