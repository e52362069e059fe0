"""The communication timers: per kind and per MoE layer, how long each collective took and how much of it
the compute thread (CPU) or compute stream (GPU) spent blocked on it.

A `Monitor` (core.py), installed for the run by the Trainer and reset at each step. Per collective:
comm_ms (issued -> done), exposed_ms (the blocked spans), wire_ms (the bytes that cross at the link's fitted
line, `WireLine`, else the window's fastest of its family, `WIRE_FAMILIES`), skew_ms and transfer_ms
(exposed split by comm/skew.py), hidden_frac (1 - exposed / wire, clamped to [0, 1]). Stamps are the host
clock on CPU and events on the compute stream on an accelerator. Invariants: nothing waits for the device
before `summary()`; `bytes` is this rank's send buffers, `wire_bytes` what left it (only that is link time).
How `done` is stamped, why issued -> done is no measure of overlap, and the window estimate's bias (it calls
too little hidden, never the reverse): docs/internals/comm.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from megatron_moe.comm.core import KINDS, Collective, HostRead
from megatron_moe.comm.skew import Arrivals, ClockOffset, GroupKey, last_arrival_wait_ms, split_exposed
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
    "shadow",
    "shadow_bwd",
    "dp_grad_reduce",
    "tp",
    "pp_p2p",
    "other",
)
"""The kinds a summary reports: `KINDS`, with the backward (`Collective.backward`) of the MoE all-to-alls and
of the expert-sharded all-gather / reduce-scatter apart."""
assert set(KINDS) <= set(SUMMARY_KINDS)


WIRE_FAMILIES = {
    **dict.fromkeys(("a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd"), "a2a"),
    **dict.fromkeys(("esp_ag", "esp_ag_bwd", "esp_rs", "esp_rs_bwd"), "esp"),
    **dict.fromkeys(("shadow", "shadow_bwd"), "shadow"),
    **{kind: kind for kind in ("dp_grad_reduce", "tp", "pp_p2p", "other")},
}
"""Summary kind -> the kinds whose collectives share one link rate in the timers' wire-time estimate (the MoE
all-to-alls forward and backward cross the same links with the same pattern; so do the ESP ones)."""
assert set(WIRE_FAMILIES) == set(SUMMARY_KINDS)


@dataclasses.dataclass(frozen=True)
class WireLine:
    """A kind's time on the link per collective: alpha_ms + ms_per_byte x its crossing bytes."""

    alpha_ms: float
    ms_per_byte: float
    """Per byte that leaves this rank (`Collective.wire_bytes`)."""

    def time_ms(self, wire_bytes: int) -> float:
        return self.alpha_ms + self.ms_per_byte * wire_bytes if wire_bytes > 0 else 0.0


def summary_kind(collective: Collective) -> str:
    """`a2a_dispatch` -> `a2a_dispatch_bwd` for the reverse all-to-all of the backward pass (`esp_ag`,
    `esp_rs` and `shadow` likewise)."""
    backward = collective.backward and collective.kind.startswith(("a2a_", "esp_", "shadow"))
    return f"{collective.kind}_bwd" if backward else collective.kind


@dataclasses.dataclass
class _Timed:
    """One collective's stamps (the monitor's token)."""

    kind: str
    layer: int | None
    nbytes: int
    wire_bytes: int
    issued: Any
    arrival: tuple[GroupKey, int] | None = None
    """(its group, its index among the group's collectives of the window) for a kind whose skew is measured."""
    spans: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    """(blocked, unblocked) stamps: the compute thread/stream waiting for it."""
    since: Any = None
    """The open span's start, while blocked."""
    done: Any = None


@dataclasses.dataclass(kw_only=True)
class CommSummary:
    """A measurement window's communication (one step in training), this rank's view (docs/internals/comm.md: wire
    time, skew, transfer and the hidden share). Every dict has every kind of `SUMMARY_KINDS`."""

    comm_ms: dict[str, float]
    """Kind -> ms from issue to completion, summed over its collectives: raw, waiting for peers included; the
    denominator of no hidden share."""
    exposed_ms: dict[str, float]
    """Kind -> ms the calling thread (CPU) / compute stream (GPU) was blocked on it."""
    bytes: dict[str, int]
    """Kind -> bytes of this rank's send buffers, its own all-to-all blocks included (not what crossed)."""
    wire_bytes: dict[str, int]
    """Kind -> bytes that left this rank (`Collective.wire_bytes`)."""
    wire_ms: dict[str, float]
    """Kind -> ms its crossing bytes need on the link (fitted line, or the timers' estimate)."""
    wire_from: dict[str, str]
    """Kind -> "fit" (a `WireLine`), "timers" (the window's fastest per byte) or "" (no bytes crossed)."""
    skew_ms: dict[str, float]
    """Kind -> the exposed ms spent before the last rank of the group arrived (comm/skew.py), measured."""
    transfer_ms: dict[str, float]
    """Kind -> exposed - skew: the exposed ms once every rank had arrived."""
    skew_from: dict[str, str]
    """Kind -> "arrivals" (split by every rank's arrival stamps) or "" (not split: no collective, a kind outside
    `SKEW_KINDS`, or a window summarized without the exchange: skew 0, all exposed time counted as transfer)."""
    calls: dict[str, int]
    """Kind -> collectives issued."""
    per_layer: dict[int, dict]
    """MoE layer -> {figure: {kind: value}} for comm_ms, exposed_ms, bytes, wire_bytes, wire_ms, skew_ms,
    transfer_ms, calls: the kinds seen on that layer."""
    hidden_frac: float
    """1 - sum(exposed_ms) / sum(wire_ms), clamped to [0, 1]; 0.0 when nothing crossed."""

    @property
    def total_comm_ms(self) -> float:
        return sum(self.comm_ms.values())

    @property
    def total_exposed_ms(self) -> float:
        return sum(self.exposed_ms.values())

    @property
    def total_wire_ms(self) -> float:
        return sum(self.wire_ms.values())

    @property
    def total_skew_ms(self) -> float:
        return sum(self.skew_ms.values())

    @property
    def total_transfer_ms(self) -> float:
        return sum(self.transfer_ms.values())

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def hidden_share(exposed_ms: float, wire_ms: float) -> float:
    """1 - exposed / wire, clamped to [0, 1]; 0.0 when nothing needed the link."""
    return min(1.0, max(0.0, 1.0 - exposed_ms / wire_ms)) if wire_ms > 0 else 0.0


class CommTimers:
    """A `Monitor` that times every collective; `summary()` of the window since `reset()`.

    `clock` is the host clock on CPU (replaceable in tests); `stamps` overrides the platform's choice.
    `wire_lines`: summary kind -> its `WireLine` (training/comm_report.py `wire_lines` from the cost model's fits);
    a kind without one gets the timers' estimate. `clock_offset`: this rank's (comm/skew.py
    `estimate_clock_offset`), for the arrival stamps `arrivals` keeps.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        stamps: Stamps | None = None,
        wire_lines: Mapping[str, WireLine] | None = None,
        clock_offset: ClockOffset | None = None,
    ):
        self.stamps = stamps if stamps is not None else comm_stamps(clock)
        self.wire_lines = dict(wire_lines or {})
        self.arrivals = Arrivals(self.stamps, clock_offset)
        self._timed: list[_Timed] = []
        self._last = None  # the latest stamp the compute thread took (GPU: settled before reading)

    def reset(self) -> None:
        """Start a new window: collectives issued before it are no longer reported."""
        self._timed, self._last = [], None
        self.arrivals.reset()

    # -- the Monitor protocol ---------------------------------------------------------------------------------

    def issued(self, collective: Collective) -> _Timed:
        self._last = self.stamps.stamp()
        kind, layer = summary_kind(collective), collective.layer
        timed = _Timed(kind, layer, collective.nbytes, collective.crossing_bytes, self._last)
        timed.arrival = self.arrivals.record(collective, self._last)
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

    def summary(self, *, reader: int | None = None) -> CommSummary:
        """The window's figures; collectives not yet complete count their blocked time only.

        `reader`: the global rank that reads the figures (the logging rank). Given, this is a collective: the
        window's arrival stamps are exchanged over the groups that hold `reader` (comm/skew.py `Arrivals.exchange`;
        every rank of them calls this or that at the same point) and the skew is measured. Not given: no skew."""
        timed = list(self._timed)  # before the exchange, whose own collective is not the window's
        if self._last is not None:
            self.stamps.settle(self._last)
        peers = self.arrivals.exchange(reader) if reader is not None else {}
        waits = [last_arrival_wait_ms(peers, t.arrival, self.arrivals.rank) for t in timed]
        figures = [self._figures(t, wait_ms) for t, wait_ms in zip(timed, waits)]
        wire = self._wire_ms(timed, figures)
        names = ("comm_ms", "exposed_ms", "bytes", "wire_bytes", "wire_ms", "skew_ms", "transfer_ms", "calls")
        totals = {name: dict.fromkeys(SUMMARY_KINDS, 0.0 if name.endswith("_ms") else 0) for name in names}
        per_layer: dict[int, dict] = {}
        for t, values, wire_ms in zip(timed, figures, wire):
            values = {**values, "wire_ms": wire_ms}
            tables = [totals]
            if t.layer is not None:
                tables.append(per_layer.setdefault(t.layer, {name: {} for name in names}))
            for table in tables:
                for name, value in values.items():
                    table[name][t.kind] = table[name].get(t.kind, 0) + value
        wire_from = {
            kind: ("fit" if kind in self.wire_lines else "timers") if totals["wire_bytes"][kind] > 0 else ""
            for kind in SUMMARY_KINDS
        }
        split = {t.kind for t, wait_ms in zip(timed, waits) if wait_ms is not None}
        skew_from = {kind: "arrivals" if kind in split else "" for kind in SUMMARY_KINDS}
        hidden = hidden_share(sum(totals["exposed_ms"].values()), sum(totals["wire_ms"].values()))
        return CommSummary(**totals, wire_from=wire_from, skew_from=skew_from, per_layer=per_layer, hidden_frac=hidden)

    def _figures(self, t: _Timed, wait_ms: float | None) -> dict:
        """One collective's figures; `wait_ms`: from its arrival to its group's last (None: not known, no skew)."""
        elapsed = self.stamps.elapsed_ms
        spans = [(elapsed(t.issued, start), elapsed(t.issued, end)) for start, end in t.spans if start is not None]
        exposed = sum(end - start for start, end in spans)
        comm = elapsed(t.issued, t.done) if t.done is not None else exposed
        skew, transfer = split_exposed(spans, wait_ms) if wait_ms is not None else (0.0, exposed)
        return {
            "comm_ms": comm,
            "exposed_ms": exposed,
            "bytes": t.nbytes,
            "wire_bytes": t.wire_bytes,
            "skew_ms": skew,
            "transfer_ms": transfer,
            "calls": 1,
        }

    def _wire_ms(self, timed: list[_Timed], figures: list[dict]) -> list[float]:
        """Each collective's wire time: its kind's `WireLine`, else its crossing bytes at the fastest ms per
        crossing byte of a complete collective of its family in the window (docs/internals/comm.md, timers.py)."""
        fastest: dict[str, float] = {}
        for t, values in zip(timed, figures):
            if t.kind not in self.wire_lines and t.done is not None and t.wire_bytes > 0:
                family, per_byte = WIRE_FAMILIES[t.kind], values["comm_ms"] / t.wire_bytes
                fastest[family] = min(fastest.get(family, per_byte), per_byte)
        return [
            self.wire_lines[t.kind].time_ms(t.wire_bytes)
            if t.kind in self.wire_lines
            else t.wire_bytes * fastest.get(WIRE_FAMILIES[t.kind], 0.0)
            for t in timed
        ]
