"""The choke point: each collective is described by a `Collective` record and started by `issue`.

`issue` is the only function in megatron_moe from which a torch.distributed
collective starts (tests/unit/test_comm_choke_point.py checks it: anywhere else
in the package, or outside a `start` passed to `issue`, a collective fails the
test). Today it just starts the call; the per-kind timers (issue 13) and the
watchdog (issue 12) wrap `start` and the returned work handle there, so no
caller changes when they arrive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("a2a_dispatch", "a2a_combine", "dp_grad_reduce", "tp", "pp_p2p", "other")
"""What a collective is for, as the timers group them. MoE dispatch/combine are counted forward and
backward separately (`Collective.backward`); `dp_grad_reduce` and `pp_p2p` are issued by megatron-core
(README.md in this folder)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as the timers (kind, layer, bytes) and the watchdog (purpose, group, peers) see it."""

    kind: str
    """One of `KINDS`."""
    purpose: str
    """The purpose-named call that issued it (`dispatch_all_to_all`, `barrier/checkpoint_saved`, ...)."""
    group: Any = None
    """Process group; None is the world. Its peers: `torch.distributed.get_process_group_ranks(group)`."""
    layer: int | None = None
    """MoE layer number for the MoE collectives (dispatch, combine, their planning), else None."""
    backward: bool = False
    """True for the reverse collective a differentiable call issues in the backward pass."""
    nbytes: int = 0
    """Bytes this rank contributes (sends)."""


def issue(collective: Collective, start: Callable[[], Any]):
    """Start `collective`: `start()` issues the torch.distributed call and returns its work handle
    (async_op=True) or None (already finished). Returns what `start` returned."""
    assert collective.kind in KINDS, f"unknown collective kind {collective.kind!r}; one of {KINDS}"
    return start()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_size(group) -> int:
    """Ranks in `group`; 1 for None (a single process: no group was given)."""
    return 1 if group is None else dist.get_world_size(group)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


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
