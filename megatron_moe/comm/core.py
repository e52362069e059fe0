"""The choke points: each collective is described by a `Collective` record and started by `issue`; each read
of device values by the host runs inside `host_read`.

Inputs: a `Collective` and a `start` callable that issues it. Output: what `start` returned (a work handle, or
None when already finished).
Invariants: `issue` is the only function in megatron_moe from which a torch.distributed collective starts
(tests/unit/test_comm_choke_point.py); every host read of device values in the training step runs inside
`host_read(purpose, layer=...)` (tests/unit/test_host_read_spans.py). A `Monitor` installed with
`monitoring(...)` sees each collective issued and the calling thread's time blocked on it (in a synchronous
call, or in `wait()` of the returned handle) and each host-read span.
Why the host-read spans matter on NCCL (where a stuck peer shows): docs/internals/comm.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

KINDS = ("a2a_dispatch", "a2a_combine", "esp_ag", "esp_rs", "shadow", "dp_grad_reduce", "tp", "pp_p2p", "other")
"""What a collective is for, as the timers group them. MoE dispatch/combine, the expert-sharded all-gather
(`esp_ag`) / reduce-scatter (`esp_rs`) and the shadow experts' weight broadcast / gradient reduce (`shadow`,
moe/shadow.py) are counted forward and backward separately (`Collective.backward`);
`dp_grad_reduce` and `pp_p2p` are issued by megatron-core (README.md in this folder)."""


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
    """Bytes of this rank's send buffer, its own block included (an all-to-all's rows for itself stay here)."""
    wire_bytes: int | None = None
    """Bytes that leave this rank: `nbytes` less what it keeps for itself (an all-to-all's own block; the ring's
    share for an all-gather / reduce-scatter / all-reduce: `ring_wire_bytes`). None: all of `nbytes` leaves."""

    inter_node: tuple[int, int] | None = None
    """(messages, bytes) this rank sends to other nodes, for an all-to-all whose EP group's node layout is known
    (comm/hierarchy.py: linear sends one message per remote rank, 2DH one per remote node); None: not known."""

    @property
    def crossing_bytes(self) -> int:
        return self.nbytes if self.wire_bytes is None else self.wire_bytes


@dataclasses.dataclass(frozen=True)
class HostRead:
    """A read of device values by the host, as the watchdog names it (`host_read`)."""

    purpose: str
    """What is read (`moe plan counts`, `lm loss`, `optimizer step`, ...)."""
    layer: int | None = None
    """MoE layer number for a read of the MoE layer, else None."""


class Monitor(Protocol):
    """Sees every collective `issue` starts, each time the calling thread blocks on one, and each read of
    device values by the host (`host_read`).

    Called on the thread that issues or waits (the main thread; autograd's threads on GPU): implementations
    keep each call short and thread-safe. A synchronous collective is `issued`, `blocked`, then `unblocked`
    with `completed=True`; an asynchronous one is `issued`, `handle`d (its work handle, once started),
    `unblocked(completed=False)`, then `blocked`/`unblocked(completed=True)` around its `wait()`.
    """

    def issued(self, collective: Collective) -> Any:
        """A collective starts; returns the token the two calls below receive."""

    def handle(self, token: Any, work: Any) -> None:
        """An asynchronous collective started: `work` is torch.distributed's handle (e.g. its `get_future()`
        tells when the transfer finished). Called before `unblocked`; the monitor must not wait on it."""

    def blocked(self, token: Any) -> None:
        """The calling thread starts waiting for it."""

    def unblocked(self, token: Any, *, completed: bool) -> None:
        """The calling thread stops waiting; `completed`: the collective is finished (or failed)."""

    def read_started(self, read: HostRead) -> Any:
        """The calling thread starts a read of device values (it waits for the work queued before it on the
        device, collectives included); returns the token `read_ended` receives. Collectives may be issued and
        waited for inside it (megatron-core's optimizer step): their calls nest within the read's."""

    def read_ended(self, token: Any) -> None:
        """The read is over (the values are on the host, or it failed)."""


class _Tap:
    """The process state of the choke point: the installed monitors (process-wide, set only by `monitoring`) and,
    per thread, whether `issue` is running, so that collectives nested in one (megatron-core's bucket
    all-reduces inside its grad sync, tapped as one) are started directly, not issued twice."""

    def __init__(self):
        self.monitor: Monitor | None = None
        self.local = threading.local()

    def nested(self) -> bool:
        return getattr(self.local, "depth", 0) > 0

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        self.local.depth = getattr(self.local, "depth", 0) + 1
        try:
            yield
        finally:
            self.local.depth -= 1


_TAP = _Tap()


@contextlib.contextmanager
def monitoring(monitor: Monitor) -> Iterator[Monitor]:
    """Let `monitor` see every collective issued until the block ends, beside those already installed
    (the watchdog for the run, timers for a step)."""
    before = _TAP.monitor
    _TAP.monitor = monitor if before is None else _Both(before, monitor)
    try:
        yield monitor
    finally:
        _TAP.monitor = before


class _Both:
    """Two monitors as one: each sees every call, with its own token."""

    def __init__(self, first: Monitor, second: Monitor):
        self.first, self.second = first, second

    def issued(self, collective: Collective):
        return self.first.issued(collective), self.second.issued(collective)

    def handle(self, token, work) -> None:
        self.first.handle(token[0], work)
        self.second.handle(token[1], work)

    def blocked(self, token) -> None:
        self.first.blocked(token[0])
        self.second.blocked(token[1])

    def unblocked(self, token, *, completed: bool) -> None:
        self.first.unblocked(token[0], completed=completed)
        self.second.unblocked(token[1], completed=completed)

    def read_started(self, read: HostRead):
        return self.first.read_started(read), self.second.read_started(read)

    def read_ended(self, token) -> None:
        self.first.read_ended(token[0])
        self.second.read_ended(token[1])


def issue(collective: Collective, start: Callable[[], Any]):
    """Start `collective`: `start()` issues the torch.distributed call and returns its work handle
    (async_op=True) or None (already finished). Returns what `start` returned (a handle whose `wait()` the
    monitor sees, when one is installed)."""
    assert collective.kind in KINDS, f"unknown collective kind {collective.kind!r}; one of {KINDS}"
    monitor = _TAP.monitor
    if monitor is None or _TAP.nested():
        return start()
    token = monitor.issued(collective)
    monitor.blocked(token)
    work, completed = None, True
    try:
        with _TAP.issuing():
            work = start()
        completed = work is None
        if not completed:
            monitor.handle(token, work)
    finally:
        monitor.unblocked(token, completed=completed)
    return work if completed else MonitoredWork(work, monitor, token)


@contextlib.contextmanager
def host_read(purpose: str, *, layer: int | None = None) -> Iterator[None]:
    """The block reads device values into the host (`.item()`, `.tolist()`, `to_host`, a call into megatron-core
    that does): the installed monitor sees it as one span named `purpose` (and `layer`, in an MoE layer), so the
    watchdog can name a host blocked there by an unfinished collective (docs/internals/comm.md, core.py)."""
    monitor = _TAP.monitor
    if monitor is None:
        yield
        return
    token = monitor.read_started(HostRead(purpose, layer))
    try:
        yield
    finally:
        monitor.read_ended(token)


def is_issuing() -> bool:
    """True inside `issue` on this thread: a collective started now belongs to the one being issued."""
    return _TAP.nested()


class MonitoredWork:
    """A torch.distributed work handle whose `wait()` the monitor sees; everything else is the handle's.

    Waited once: later `wait()` calls return the first one's result (a gloo send/recv waited twice blocks).
    """

    def __init__(self, work, monitor: Monitor, token):
        self._work, self._monitor, self._token = work, monitor, token
        self._waited, self._result = False, None

    def wait(self, *args, **kwargs):
        if self._waited:
            return self._result
        self._monitor.blocked(self._token)
        try:
            self._result = self._work.wait(*args, **kwargs)
            self._waited = True
            return self._result
        finally:
            self._monitor.unblocked(self._token, completed=True)

    def __getattr__(self, name):
        return getattr(self._work, name)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_wire_bytes(n: int, p: int, *, all_reduce: bool = False) -> int:
    """Bytes that leave each rank in a bandwidth-optimal all-gather or reduce-scatter of `n` bytes (the whole
    buffer: P blocks) over `p` ranks: (p - 1) / p x n, its P - 1 foreign blocks; an all-reduce is both, twice that.
    What a ring sends; gloo and NCCL pick other algorithms at some sizes, none sends less."""
    share = n * (p - 1) // p if p > 1 else 0
    return 2 * share if all_reduce else share


def group_size(group) -> int:
    """Ranks in `group`; 1 for None (a single process: no group was given)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in `group`; 0 for None (a single process)."""
    return 0 if group is None else dist.get_rank(group)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_REAPER: threading.Thread | None = None
"""The thread freeing the last run's groups (`destroy_groups_but_world`), until it ends."""


def destroy_groups_but_world() -> int:
    """Destroy every process group this process holds but the default one; how many there were.

    The teardown of a run that leaves torch.distributed up (the tests run many runs in one job): megatron-core's
    `destroy_model_parallel` only drops its references, and each group keeps its transport's threads (gloo: a
    TCP loop and a run loop per group and device). A 4-rank job of 34 runs held 1,664 threads per rank, about
    400 of them runnable at once. Local to this process (no collective): call it on every rank after a barrier.
    torch lists the groups only in the private `_world.pg_map` (tests/unit/test_comm_groups.py asserts it is
    there, so a torch that drops it fails that test, not the teardown).

    The groups' objects are freed on a thread of their own (`join_reaper`; not a daemon: the interpreter's exit
    waits for it): they are held in cycles, and gloo's destructor waits for each TCP pair's event loop to tick
    (~10 ms a pair, the GIL released), 0.2-0.3 s a run at 4 ranks on 2 cores that the next run need not wait."""
    global _REAPER
    from torch.distributed import distributed_c10d

    join_reaper()
    world = distributed_c10d._get_default_group()
    groups = [group for group in distributed_c10d._world.pg_map if group is not world]
    count = len(groups)
    while groups:  # popped: this frame keeps no reference for the reaper to miss
        dist.destroy_process_group(groups.pop())
    _REAPER = threading.Thread(target=gc.collect, name="process-group-reaper")
    _REAPER.start()
    return count


def join_reaper() -> None:
    """Wait until the groups `destroy_groups_but_world` let go of are freed (with their threads)."""
    global _REAPER
    if _REAPER is not None:
        _REAPER.join()
        _REAPER = None


class CommHandle:
    """A started collective; `wait()` finishes it and returns its (post-processed) result."""

    def __init__(self, result, work=None, keepalive=(), then: Callable | None = None, record=None):
        self._result, self._work, self._keepalive, self._then = result, work, keepalive, then
        self.record: Collective | None = record
        """The collective it finishes, when its caller says (what `BackwardOverlap.run_under` is given)."""

    @property
    def buffer(self):
        """The result before `then`: while the collective is in flight, the buffer it lands in."""
        return self._result

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work, self._keepalive = None, ()
        if self._then is not None:
            self._result, self._then = self._then(self._result), None
        return self._result
