"""Leaving early on purpose: SIGTERM (slurm's warning before the time limit), SIGINT (Ctrl-C) or a time budget.

`StopSignals` (installed by `pretrain` before anything else, on every rank) turns SIGTERM and SIGINT into a flag:
no handler raises, so no KeyboardInterrupt can land inside logging's or a fork's internals (where Python
ignores it) or inside a save. Every rank joins one small all-reduce per step, so all ranks agree to stop at the
same step even when the signal reached only some of them; the loop then saves and exits 0. A second stop signal
more than SAME_REQUEST_S after the first ends the process at once (`exit_now`: lock and partial save removed),
without a collective, even while the main thread is blocked in one (a thread reads the wakeup fd). Why closer
ones count as one request, and how the signal is seen: docs/internals/training.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch

from megatron_moe import comm
from megatron_moe.failure import exit_now
from megatron_moe.platform import current_platform

log = logging.getLogger("megatron_moe")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Stop signals this soon after the first SIGTERM are the same request reaching the rank by another route.
SAME_REQUEST_S = 3.0


def _forget_wakeup_fd() -> None:
    """In a forked child (a data-loader worker, a checkpoint writer): its signals are not this process's, so
    they must not reach the watcher's pipe, which the child shares."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread of the child: nothing to forget there
        pass


os.register_at_fork(after_in_child=_forget_wakeup_fd)


class _SignalWatcher:
    """Counts SIGTERM/SIGINT as they arrive: the first sets `signalled` (and `signum`); either one more than
    SAME_REQUEST_S after it exits."""

    def __init__(self, rank: int | None):
        self.signalled = False
        self.signum = 0  # the first stop signal's number
        self._first_at: float | None = None  # time.monotonic() of the first stop signal
        self._rank = rank
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        # A Python handler is what makes the C handler write the fd; it does nothing more (the thread acts). Never
        # raising is the point: a KeyboardInterrupt raised in an at-fork hook or a `finally` is lost or half-done.
        self._previous = {signum: signal.signal(signum, lambda signum, frame: None) for signum in _STOP_SIGNALS}
        threading.Thread(target=self._watch, args=(read_fd,), name="megatron_moe-sigterm", daemon=True).start()

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):  # b"": every write end closed (close() below)
                for signum in data:
                    if signum not in _STOP_SIGNALS:
                        continue
                    if self._first_at is not None and time.monotonic() - self._first_at < SAME_REQUEST_S:
                        continue  # the first one again, by another route (torchrun's forward of slurm's)
                    if self.signalled:
                        name = signal.Signals(signum).name
                        where = f"rank {self._rank}: " if self._rank is not None else ""
                        log.error("%ssecond %s: exiting without saving", where, name)
                        exit_now(128 + signum)
                    self._first_at, self.signum = time.monotonic(), signum
                    self.signalled = True

    def close(self) -> None:
        """Restore the previous handlers and wakeup fd; the thread ends once no process holds the pipe."""
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._write_fd)


class StopSignals:
    """SIGTERM and SIGINT as stop requests for as long as it is open (a context manager); `enabled` False
    (--no-exit-signal-handler): Python's defaults stay."""

    def __init__(self, *, enabled: bool, rank: int | None = None):
        self._watcher = _SignalWatcher(rank) if enabled else None

    @property
    def received(self) -> int:
        """The first stop signal's number on this rank, 0 if none came."""
        return self._watcher.signum if self._watcher is not None else 0

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None


class ExitRequest:
    """Knows whether this run should stop after the current step, and why."""

    def __init__(self, *, exit_duration_in_mins: float | None, signals: StopSignals | None):
        self._deadline = time.monotonic() + 60 * exit_duration_in_mins if exit_duration_in_mins else None
        self._signals = signals
        self.reason: str | None = None

    def requested(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM or SIGINT, or ran out of time."""
        signum = self._signals.received if self._signals is not None else 0
        local = [signum, self._deadline is not None and time.monotonic() > self._deadline]
        flags = torch.tensor(local, dtype=torch.int32, device=current_platform().device)
        comm.agree_exit(flags)  # the max: SIGTERM's number where ranks got different ones
        with comm.host_read("exit flags"):
            signalled_anywhere, out_of_time = flags.tolist()
        if signalled_anywhere:
            self.reason = f"{signal.Signals(signalled_anywhere).name} received"
        elif out_of_time:
            self.reason = "--exit-duration-in-mins reached"
        return self.reason is not None
