"""Leaving early on purpose: SIGTERM (slurm's warning before the time limit) or a time budget.

Every rank joins one small all-reduce per step, so all ranks agree to stop at
the same step even when the signal reached only some of them; the loop then
saves a checkpoint and exits cleanly, and the next start resumes from it.
"""

from __future__ import annotations

import signal
import time

import torch

from megatron_moe import comm
from megatron_moe.platform import current_platform


class ExitRequest:
    """Knows whether this run should stop after the current step, and why."""

    def __init__(self, *, exit_duration_in_mins: float | None, handle_sigterm: bool):
        self._deadline = time.monotonic() + 60 * exit_duration_in_mins if exit_duration_in_mins else None
        self._signalled = False
        self.reason: str | None = None
        if handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def requested(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM or ran out of time."""
        local = [self._signalled, self._deadline is not None and time.monotonic() > self._deadline]
        flags = torch.tensor(local, dtype=torch.int32, device=current_platform().device)
        comm.agree_exit(flags)
        if flags[0]:
            self.reason = "SIGTERM received"
        elif flags[1]:
            self.reason = "--exit-duration-in-mins reached"
        return self.reason is not None

    def restore_default_handler(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
