"""Timing for the benchmarks under tools/: interleaved rounds, warm-up until the heap is settled.

On a CPU machine a step that touches fresh pages pays a page fault per 4 KiB
(the first steps, while the heap grows to its high-water mark), and the
machine's speed drifts between rounds when it is shared. So the contenders
of one case run back to back in each round, warm-up goes on until a round
without page faults, and the faults left in the timed rounds are reported.
"""

from __future__ import annotations

import ctypes
import resource
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(step, sync=None) -> tuple[float, int]:
    """(milliseconds, page faults) of one call; `sync` waits for queued device work."""
    sync = sync or (lambda: None)
    sync()
    faults = _page_faults()
    t0 = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - t0) * 1000.0, _page_faults() - faults


def median_ratio(num: list[float], den: list[float]) -> float:
    return round(statistics.median(a / b for a, b in zip(num, den)), 3)


def measure_rounds(
    steps: dict, *, warmup: int, max_warmup: int, repeats: int, after_round=None, sync=None
) -> tuple[dict, int, dict]:
    """Interleave the steps round by round: warm up until a fault-free round, then time `repeats` rounds.

    Returns ({name: [ms per timed round]}, warm-up rounds run, {name: page faults in the timed rounds}).
    """
    warm = 0
    while warm < max_warmup:
        faults = 0
        for step in steps.values():
            faults += timed(step, sync)[1]
        if after_round:
            after_round()
        warm += 1
        if warm >= warmup and faults == 0:
            break
    times, faults = {name: [] for name in steps}, dict.fromkeys(steps, 0)
    for _ in range(repeats):
        for name, step in steps.items():
            ms, f = timed(step, sync)
            times[name].append(ms)
            faults[name] += f
        if after_round:
            after_round()
    return times, warm, faults


class _MallocInfo(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _host_bytes_in_use():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallocInfo

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def peak_bytes(step, platform) -> int:
    """Peak bytes in use above the starting level during one call of `step`.

    On an accelerator, its peak-allocated counter. On CPU, glibc's bytes in
    use (mallinfo2), read after every torch op of the step.
    """
    if platform.is_accelerator:
        torch.accelerator.synchronize()
        torch.accelerator.memory.reset_peak_memory_stats()
        base = torch.accelerator.memory.memory_allocated()
        step()
        torch.accelerator.synchronize()
        return torch.accelerator.memory.max_memory_allocated() - base

    in_use = _host_bytes_in_use()
    base = in_use()
    peak = [base]

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            peak[0] = max(peak[0], in_use())
            return out

    with Track():
        step()
    return peak[0] - base
