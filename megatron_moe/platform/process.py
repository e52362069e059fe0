"""This process's place in torch.distributed: the single-process default, and a world of one rank."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import socket
import sys
import tempfile

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_moe.platform.device import Platform, init_platform
from megatron_moe.platform.rng import seed_model_parallel

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent ends (Linux's parent-death signal); False elsewhere.

    `parent_pid` is the parent as recorded earlier (default: a multiprocessing child's parent, else the current
    one): a parent that ended before this call can no longer send the signal, so the process exits at once.
    The signal is not inherited: a forked or spawned child calls this itself.
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


def default_to_single_process() -> None:
    """Let `python pretrain_gpt_moe.py ...` (or a tool) run as one rank without torchrun."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(seed: int = 0, backend: str | None = None) -> Platform:
    """This process as a world of one rank, for models run in-process (tests, benchmarks, checkpoint conversion).

    torch.distributed with one rank (`backend`, else the platform's), megatron-core's parallel state with every
    size 1, and the model-parallel RNG streams seeded from `seed`. The rendezvous is a fresh file store: no port to
    collide with another process's. Idempotent: what is already up stays as it is (and is not reseeded).
    """
    platform = init_platform()
    if not dist.is_initialized():
        fd, store = tempfile.mkstemp(prefix="megatron_moe_rendezvous_")  # the store removes it when done
        os.close(fd)
        dist.init_process_group(backend or platform.backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        seed_model_parallel(seed)
    return platform
