"""The communication timers: per kind and per MoE layer, how long each collective took and how much of it
the compute thread (CPU) or compute stream (GPU) spent blocked on it.

A `Monitor` (core.py), installed for the run by the Trainer and reset at each step. For every collective:

    issued ------------------------------------------------------ done        comm_ms: issued -> done
      [blocked .. unblocked]   (compute)   [blocked .. unblocked]             exposed_ms: the blocked spans
       starting it                          waiting for it

On CPU the stamps are the host clock; `done` is stamped by the work's future (a callback when gloo
finishes the transfer), or by the end of the wait that saw it complete, whichever comes first. On an
accelerator the stamps are CUDA events on the compute stream (platform/timing.py): a blocked span is how
long the stream waited for the collective, `done` is where the stream had it (an upper bound when the
wait found it finished), and nothing waits for the device before `summary()`, which the Trainer calls
once the step's loss has been read anyway. Bytes are what this rank sent.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from megatron_moe.comm.core import KINDS, Collective, HostRead
from megatron_moe.platform.timing import Stamps, comm_stamps

SUMMARY_KINDS = (
    "a2a_dispatch",
    "a2a_dispatch_bwd",
    "a2a_combine",
    "a2a_combine_bwd",
    "esp_ag",
    "esp_ag_bwd",
    "esp_rs",
    "esp_rs_bwd",
    "dp_grad_reduce",
    "tp",
    "pp_p2p",
    "other",
)
"""The kinds a summary reports: `KINDS`, with the backward (`Collective.backward`) of the MoE all-to-alls and
of the expert-sharded all-gather / reduce-scatter apart."""
assert set(KINDS) <= set(SUMMARY_KINDS)


def summary_kind(collective: Collective) -> str:
    """`a2a_dispatch` -> `a2a_dispatch_bwd` for the reverse all-to-all of the backward pass (`esp_ag`,
    `esp_rs` likewise)."""
    backward = collective.backward and collective.kind.startswith(("a2a_", "esp_"))
    return f"{collective.kind}_bwd" if backward else collective.kind


@dataclasses.dataclass
class _Timed:
    """One collective's stamps (the monitor's token)."""

    kind: str
    layer: int | None
    nbytes: int
    issued: Any
    spans: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    """(blocked, unblocked) stamps: the compute thread/stream waiting for it."""
    since: Any = None
    """The open span's start, while blocked."""
    done: Any = None


@dataclasses.dataclass(kw_only=True)
class CommSummary:
    """A measurement window's communication (one step in training), this rank's view."""

    comm_ms: dict[str, float]
    """Kind -> ms from issue to completion, summed over its collectives (every kind of `SUMMARY_KINDS`)."""
    exposed_ms: dict[str, float]
    """Kind -> ms the calling thread (CPU) / compute stream (GPU) was blocked on it."""
    bytes: dict[str, int]
    """Kind -> bytes this rank sent."""
    calls: dict[str, int]
    """Kind -> collectives issued."""
    per_layer: dict[int, dict]
    """MoE layer -> {"comm_ms": {kind: ms}, "exposed_ms": {...}, "bytes": {...}, "calls": {...}}, kinds seen
    on that layer."""
    hidden_frac: float
    """1 - sum(exposed_ms) / sum(comm_ms), at least 0; 0.0 when there was no communication."""

    @property
    def total_comm_ms(self) -> float:
        return sum(self.comm_ms.values())

    @property
    def total_exposed_ms(self) -> float:
        return sum(self.exposed_ms.values())

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class CommTimers:
    """A `Monitor` that times every collective; `summary()` of the window since `reset()`.

    `clock` is the host clock on CPU (replaceable in tests); `stamps` overrides the platform's choice.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, stamps: Stamps | None = None):
        self.stamps = stamps if stamps is not None else comm_stamps(clock)
        self._timed: list[_Timed] = []
        self._last = None  # the latest stamp the compute thread took (GPU: settled before reading)

    def reset(self) -> None:
        """Start a new window: collectives issued before it are no longer reported."""
        self._timed, self._last = [], None

    # -- the Monitor protocol ---------------------------------------------------------------------------------

    def issued(self, collective: Collective) -> _Timed:
        self._last = self.stamps.stamp()
        timed = _Timed(summary_kind(collective), collective.layer, collective.nbytes, self._last)
        self._timed.append(timed)  # list.append: atomic, autograd's threads may issue too
        return timed

    def handle(self, token: _Timed, work) -> None:
        """An asynchronous collective's work: on CPU its future stamps the completion."""
        if not self.stamps.completes_on_host:
            return
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError):  # a handle without a future: the wait stamps it
            return
        future.add_done_callback(lambda _: self._complete(token, self.stamps.stamp()))

    def blocked(self, token: _Timed) -> None:
        token.since = self._last = self.stamps.stamp()

    def unblocked(self, token: _Timed, *, completed: bool) -> None:
        now = self._last = self.stamps.stamp()
        token.spans.append((token.since, now))
        token.since = None
        if completed:
            self._complete(token, now)

    def read_started(self, read: HostRead) -> None:
        """Host reads are not communication: the timers leave them to the watchdog."""

    def read_ended(self, token: None) -> None:
        pass

    @staticmethod
    def _complete(token: _Timed, now) -> None:
        if token.done is None:  # the future's callback or the wait: the first one to see it finished
            token.done = now

    # -- the figures ------------------------------------------------------------------------------------------

    def summary(self) -> CommSummary:
        """The window's figures; collectives not yet complete count their blocked time only."""
        timed = list(self._timed)
        zeros = dict.fromkeys(SUMMARY_KINDS, 0.0)
        counts = dict.fromkeys(SUMMARY_KINDS, 0)
        totals = {"comm_ms": dict(zeros), "exposed_ms": dict(zeros), "bytes": dict(counts), "calls": dict(counts)}
        per_layer: dict[int, dict] = {}
        if self._last is not None:
            self.stamps.settle(self._last)
        for t in timed:
            figures = self._figures(t)
            tables = [totals]
            if t.layer is not None:
                empty = {"comm_ms": {}, "exposed_ms": {}, "bytes": {}, "calls": {}}
                tables.append(per_layer.setdefault(t.layer, empty))
            for table in tables:
                for name, value in figures.items():
                    table[name][t.kind] = table[name].get(t.kind, 0) + value
        comm, exposed = sum(totals["comm_ms"].values()), sum(totals["exposed_ms"].values())
        hidden = max(0.0, 1.0 - exposed / comm) if comm > 0 else 0.0
        return CommSummary(**totals, per_layer=per_layer, hidden_frac=hidden)

    def _figures(self, t: _Timed) -> dict:
        elapsed = self.stamps.elapsed_ms
        exposed = sum(elapsed(start, end) for start, end in t.spans if start is not None)
        comm = elapsed(t.issued, t.done) if t.done is not None else exposed
        return {"comm_ms": comm, "exposed_ms": exposed, "bytes": t.nbytes, "calls": 1}
