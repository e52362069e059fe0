"""How long our processes live: each one ends with the process that started it.

Killing a launcher (bash + torchrun) or a rank must not leave workers training, nor checkpoint-writer
processes holding memory. Linux's parent-death signal does that: the kernel SIGKILLs a process whose
parent ended. It is not inherited, so each process that must not outlive its parent asks for it itself:
a torchrun worker at start (pretrain_gpt_moe.py), each process dist_checkpointing starts (a Platform
patch, megatron_moe/platform/upstream_fixes.py).

Standard library only (no torch): a worker calls it before its heavy imports, and a spawned helper
process that unpickles `writer_process_start` imports nothing more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent ends; False where that is not available (not Linux).

    `parent_pid` is the parent as recorded earlier (default: a multiprocessing child's parent as its parent
    recorded it, else the current parent): a parent that ended before this call can no longer send the
    signal, so the process then exits at once.
    """
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else os.getppid()
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:  # the parent died before the prctl: nobody is left to signal us
        os._exit(128 + signal.SIGKILL)
    return True


def writer_process_start(parent_pid: int | None = None) -> None:
    """First thing in a checkpoint-writer process: die with its rank, and leave stop signals to the rank.

    torchrun stops a worker by signalling its whole process group, writers included: they finish their write
    (the rank decides whether the save completes, megatron_moe.training.preemption) or die with the rank. A
    forked writer inherits the rank's signal wakeup fd: cleared, so its signals are not counted as the rank's.
    """
    die_with_parent(parent_pid)
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
