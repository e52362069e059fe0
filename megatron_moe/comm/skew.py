"""Skew: the part of a collective's exposed time spent waiting for the last rank of its group to arrive (to issue
it), measured from every rank's arrival stamp; the rest of the exposed time is transfer.

`split_exposed` splits one collective's blocked spans at its last arrival. `Arrivals` stamps this rank's arrival
at every collective of `SKEW_KINDS` (each issued by every rank of its group in one order), and
`Arrivals.exchange` all-gathers the stamps once a step, after the step's last device read, over each group that
holds the logging rank, in sorted group order. `estimate_clock_offset` gives a rank on another kernel its
`ClockOffset` from rank 0's at start-up. Invariants: which groups and how many stamps are exchanged are agreed
figures, never one rank's timing; nothing waits inside the step.
What the split cannot see, the clocks' error bounds and the accelerator's event stamps: docs/internals/comm.md.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, HostRead, host_read, is_distributed, issue, nbytes
from megatron_moe.platform.device import current_platform
from megatron_moe.platform.timing import Stamps

SKEW_KINDS = ("a2a_dispatch", "a2a_combine", "esp_ag", "esp_rs", "shadow")
"""Collective kinds (`core.KINDS`, forward and backward) whose skew is measured: comm/moe.py and moe/shadow.py
issue them on explicit groups, every rank of the group the same ones in one order. The others (megatron-core's gradient
reduction, TP, pipeline send/recv, `other`) are not split: their exposed time counts as transfer."""

GroupKey = tuple[tuple[int, ...], str]
"""(the group's global ranks, its name): the same on every rank of it; sorted, the exchange's order."""

PeerArrivals = dict[GroupKey, list[list[float]]]
"""Group -> per rank of it (group order) its arrivals at the group's collectives of the window, in issue order
(seconds on the common clock)."""


def split_exposed(spans_ms: Sequence[tuple[float, float]], wait_ms: float) -> tuple[float, float]:
    """(skew, transfer) ms of one collective: `spans_ms` are its blocked spans (start, end) in ms since this rank
    issued it, `wait_ms` when the last rank of its group issued it, in ms since the same point (at least 0).
    Skew is the blocked time before the last arrival, transfer the blocked time after it."""
    wait_ms = max(0.0, wait_ms)
    skew = sum(max(0.0, min(end, wait_ms) - max(start, 0.0)) for start, end in spans_ms)
    exposed = sum(end - start for start, end in spans_ms)
    return skew, exposed - skew


def last_arrival_wait_ms(peers: PeerArrivals, arrival: tuple[GroupKey, int] | None, rank: int) -> float | None:
    """Ms from global rank `rank`'s arrival at a collective (`Arrivals.record`'s (group, index)) to the last
    arrival of its group's ranks (0 when `rank` was last, or alone); None when not known: a kind whose skew is not
    measured, or a group not in `peers` (no exchange)."""
    if arrival is None:
        return None
    key, index = arrival
    ranks = key[0]
    if len(ranks) == 1:
        return 0.0
    table = peers.get(key)
    if table is None:
        return None
    arrivals = [row[index] for row in table]
    return 1000.0 * (max(arrivals) - arrivals[ranks.index(rank)])


@dataclasses.dataclass(frozen=True)
class ClockOffset:
    """This rank's host clock less the reference's (rank 0's), in seconds."""

    seconds: float = 0.0
    error_s: float = 0.0
    """The estimate's spread over its rounds (largest distance from the median); 0 for a shared clock."""
    shared: bool = True
    """On rank 0's kernel: the same clock, offset exactly 0."""


def _boot_id() -> str:
    """The kernel's boot id: equal for processes that share CLOCK_REALTIME (one host, any namespaces)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""  # not Linux: estimated as another host's


def estimate_clock_offset(rounds: int = 8) -> ClockOffset:
    """Collective on the world, at start-up: this rank's `ClockOffset` (docs/internals/comm.md). One process: 0."""
    if not is_distributed() or dist.get_world_size() == 1:
        return ClockOffset()
    boot_ids: list = [None] * dist.get_world_size()
    mine = _boot_id()
    issue(Collective("other", "clock/boot_ids"), lambda: dist.all_gather_object(boot_ids, mine))
    if mine and all(b == boot_ids[0] for b in boot_ids):  # agreed: every rank sees the same list
        return ClockOffset()
    stamps = []  # every rank takes part, those on rank 0's kernel too (a collective)
    for _ in range(rounds):
        issue(Collective("other", "barrier/clock_offset"), lambda: dist.barrier())
        stamps.append(time.time())
    with host_read("clock offset"):
        reference = _all_gather(stamps, None, dist.get_world_size(), "clock/offset_stamps")[0]
    if mine and mine == boot_ids[0]:
        return ClockOffset()
    differences = [t - r for t, r in zip(stamps, reference)]
    offset = statistics.median(differences)
    return ClockOffset(offset, max(abs(d - offset) for d in differences), shared=False)


class Arrivals:
    """This rank's arrival stamps at the window's collectives of `SKEW_KINDS`, per group in issue order. A
    `Monitor` on its own (on the ranks the timers do not run on) or fed by `CommTimers`; `reset` at each step."""

    def __init__(self, stamps: Stamps, offset: ClockOffset | None = None):
        self.stamps = stamps
        self.offset = offset or ClockOffset()
        self.rank = dist.get_rank() if is_distributed() else 0  # global: its row in a group's `PeerArrivals`
        self._lock = threading.Lock()  # autograd's threads may issue too
        self._keys: dict[Any, GroupKey] = {}
        self._groups: dict[GroupKey, Any] = {}
        self._seen: list[tuple[GroupKey, Any]] = []
        self._counts: dict[GroupKey, int] = {}

    def reset(self) -> None:
        with self._lock:
            self._seen, self._counts = [], {}

    def record(self, collective: Collective, stamp) -> tuple[GroupKey, int] | None:
        """Note this rank's arrival (`stamp`) at `collective`; (its group, its index there), None for a kind
        whose skew is not measured."""
        if collective.kind not in SKEW_KINDS:
            return None
        with self._lock:
            key = self._key(collective.group)
            index = self._counts.get(key, 0)
            self._counts[key] = index + 1
            self._seen.append((key, stamp))
        return key, index

    def _key(self, group) -> GroupKey:
        key = self._keys.get(group)
        if key is None:
            if not is_distributed():
                key = ((self.rank,), "")
            else:
                pg = group if group is not None else dist.group.WORLD
                key = (tuple(dist.get_process_group_ranks(pg)), pg.group_name)
                self._groups[key] = pg
            self._keys[group] = key
        return key

    def exchange(self, reader: int) -> PeerArrivals:
        """Collective over each group of the window that holds global rank `reader`, in sorted order: every
        rank of those groups calls it (or `CommTimers.summary(reader=...)`) at the same point of the step. Returns
        every such group's `PeerArrivals` table. Reads the device (GPU: the stamps, the gathered table): run it
        where the step has synchronized anyway."""
        with self._lock:
            seen = [(key, stamp) for key, stamp in self._seen if reader in key[0] and len(key[0]) > 1]
        if not seen:  # no group with the reader (another pipeline stage's), or only groups of one rank
            return {}
        self.stamps.settle(seen[-1][1])
        seconds = self.stamps.host_seconds([stamp for _, stamp in seen])
        mine: dict[GroupKey, list[float]] = {}
        for (key, _), t in zip(seen, seconds):
            mine.setdefault(key, []).append(t - self.offset.seconds)
        tables = {}
        with host_read("comm timers: arrivals"):
            for key in sorted(mine):  # one order on every rank
                tables[key] = _all_gather(mine[key], self._groups[key], len(key[0]), "skew/arrivals")
        return tables

    # -- the Monitor protocol, on its own -----------------------------------------------------------------------

    def issued(self, collective: Collective) -> None:
        if collective.kind in SKEW_KINDS:
            self.record(collective, self.stamps.stamp())

    def handle(self, token, work) -> None:
        pass

    def blocked(self, token) -> None:
        pass

    def unblocked(self, token, *, completed: bool) -> None:
        pass

    def read_started(self, read: HostRead) -> None:
        pass

    def read_ended(self, token) -> None:
        pass


def _all_gather(values: list[float], group, size: int, purpose: str) -> list[list[float]]:
    """Every rank's `values` (as many on each) over `group` (None: the world), in group order. Reads the device:
    called inside a `host_read`."""
    mine_N = torch.tensor(values, dtype=torch.float64, device=current_platform().device)
    parts = [torch.empty_like(mine_N) for _ in range(size)]
    issue(
        Collective("other", purpose, group, nbytes=nbytes(mine_N)),
        lambda: dist.all_gather(parts, mine_N, group=group),
    )
    return [part.tolist() for part in parts]
