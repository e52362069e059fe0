"""A shared job's parts for test_shared_jobs.py: one that reports what it was given, one that fails on one rank, one
that sleeps (until the job is stopped)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_moe.comm.moe import make_planning_groups
from tests.distributed.launcher import BACKGROUND

ARGS = sys.argv[1:]


def settled_thread_count(quiet_s: float = 1.0, limit_s: float = 15.0) -> int:
    """This process's threads once none has ended for `quiet_s`: a destroyed gloo group's threads end
    asynchronously, so a count taken at once can include one still on its way out (11 for 10 in a CI run)."""
    count, since, deadline = len(os.listdir("/proc/self/task")), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(os.listdir("/proc/self/task"))
        if now != count:
            count, since = now, time.monotonic()
    return count


def report() -> dict:
    """The arguments this part was imported with, the world, and the groups it found (the job's tidying)."""
    from torch.distributed import distributed_c10d

    found = {
        "groups_found": len(distributed_c10d._world.pg_map),
        "threads_found": settled_thread_count(),
        "aux_loss_scale_found": MoEAuxLossAutoScaler.main_loss_backward_scale is not None,
        "niceness": os.nice(0),
        "autogroup": open("/proc/self/autogroup").read() if os.path.exists("/proc/self/autogroup") else None,
        "background_job": os.environ.get(BACKGROUND),
    }
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([0.5]))  # as a training run's schedule leaves it
    parallel_state.initialize_model_parallel()  # left up: the runner tears it down
    make_planning_groups(dist.new_group(list(range(dist.get_world_size()))))  # likewise, and a twin comm keeps
    return {"args": ARGS, "world": dist.get_world_size(), "pid": os.getpid(), **found}


def fail() -> dict:
    if dist.get_rank() == dist.get_world_size() - 1:
        raise RuntimeError(f"part failed on purpose with {ARGS}")
    dist.barrier()
    return {}


def sleep() -> dict:
    time.sleep(float(ARGS[1]))
    return {}
