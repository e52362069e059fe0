"""This process's place in torch.distributed: the single-process default, and a world of one rank."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_moe.platform.device import Platform, init_platform
from megatron_moe.platform.rng import seed_model_parallel


def default_to_single_process() -> dist.TCPStore | None:
    """Let `python pretrain_gpt_moe.py ...` (or a tool) run as one rank without torchrun.

    Returns the rendezvous store for init_process_group, already listening on a port the system chose (MASTER_PORT
    then names it, for the watchdog's client), or None under torchrun or with MASTER_PORT set. A port probed free
    and then bound later by the process group could be taken in between: two single-process jobs started together
    once met there (EADDRINUSE).
    """
    if "RANK" in os.environ:
        return None
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world_size=1, is_master=True, wait_for_workers=False)
    os.environ["MASTER_PORT"] = str(store.port)
    return store


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
