"""Time stamps for the communication timers: the host clock on CPU, CUDA events on an accelerator.

A stamp is taken where the compute thread (CPU) or compute stream (GPU) is at a given moment; two stamps
give the milliseconds between them. On an accelerator a stamp is an event recorded on the current stream:
taking one never waits for the device, and `settle` (once, at the end of a step that has synchronized
anyway) is the only wait. A synchronize inside the step would serialize the overlap being measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatron_moe.platform.device import current_platform


class Stamps(Protocol):
    """Where the compute thread/stream is now, and the time between two such points."""

    completes_on_host: bool
    """True: a collective's completion can be stamped by its work's future (a host callback); False: only
    where the compute stream waits for it."""

    def stamp(self) -> Any:
        """A point in time on the compute thread (CPU) or stream (GPU); never waits."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds from `start` to `end` (stamps of this object, both settled)."""

    def settle(self, last: Any) -> None:
        """Make every stamp up to `last` readable (GPU: wait for that event; CPU: nothing)."""

    def host_seconds(self, stamps: list) -> list[float]:
        """Host wall-clock seconds (`time.time()`'s scale) of each settled stamp: the communication timers'
        arrival stamps, compared across ranks (comm/skew.py)."""


class HostStamps:
    """The host clock (seconds), e.g. `time.perf_counter`; a fake clock in tests. `wall`: the wall clock its
    stamps convert to (`host_seconds`), read beside `clock` at conversion; a fake clock passes itself."""

    completes_on_host = True

    def __init__(self, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time):
        self.clock, self.wall = clock, wall

    def stamp(self) -> float:
        return self.clock()

    def elapsed_ms(self, start: float, end: float) -> float:
        return 1000.0 * (end - start)

    def settle(self, last: float) -> None:
        pass

    def host_seconds(self, stamps: list[float]) -> list[float]:
        """`clock`'s stamps moved to `wall`'s scale by their difference now (microseconds of drift a step)."""
        offset = self.wall() - self.clock()
        return [stamp + offset for stamp in stamps]


class DeviceStamps:
    """CUDA events recorded on the current (compute) stream."""

    completes_on_host = False

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def settle(self, last: torch.cuda.Event) -> None:
        last.synchronize()

    def host_seconds(self, stamps: list[torch.cuda.Event]) -> list[float]:
        """One event recorded now and waited for (the stream has reached it: the step synchronized before), the
        host clock read at once; each stamp is placed before it by `elapsed_time`. Error: the wait's latency."""
        anchor = self.stamp()
        anchor.synchronize()
        now = time.time()
        return [now - stamp.elapsed_time(anchor) / 1000.0 for stamp in stamps]


def comm_stamps(clock: Callable[[], float] = time.perf_counter) -> Stamps:
    """The stamps the timers use on this platform (`clock` on CPU)."""
    return DeviceStamps() if current_platform().is_accelerator else HostStamps(clock)
