"""torchrun entry of a shared job: the parts of many test modules, one after another in one set of ranks.

    torchrun --nproc-per-node N job_runner.py SPEC_JSON

SPEC_JSON lists parts as {"name", "worker", "entry", "args"}. Each part imports tests/distributed/WORKER.py afresh
with sys.argv[1:] = args (the workers read their arguments at import) and calls ENTRY(), which returns the part's
{case: result}. After each part every rank drops what it left (megatron-core's parallel state, its process groups
but the default one), and rank 0 rewrites $RESULTS with {part: result} so far: a part that raises ends the job
(its rank exits, torchrun stops the others), and the parts before it keep their results (`shared_jobs.py` runs
the rest in a new job). A torchrun job costs 10-20 s to start here; one job for 16 parts saves most of that.
"""

import contextlib
import datetime
import importlib
import json
import os
import sys
import time

import torch.distributed as dist

from tests.distributed.launcher import BACKGROUND, reset_megatron_core_aux_loss_scale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "tests.distributed."
RUN_TIMEOUT = datetime.timedelta(minutes=10 + 1)
"""The default group's timeout: a training run's own (--distributed-timeout-minutes 10, plus the watchdog's minute),
as if the job's first part were a training run (test_training.py reads it)."""


def fresh(worker: str, args: list[str]):
    """tests/distributed/WORKER.py imported anew with sys.argv[1:] = `args`, as are the workers it imports."""
    for name in [name for name in sys.modules if name.startswith(PACKAGE) and name.endswith("_worker")]:
        del sys.modules[name]
    sys.argv = [os.path.join(ROOT, "tests", "distributed", f"{worker}.py"), *args]
    return importlib.import_module(PACKAGE + worker)


def tidy() -> int:
    """What a part left, dropped as a run's teardown drops it (megatron-core's parallel state, our planning and
    hierarchy groups, every process group but the default one, with their threads), and megatron-core's aux-loss
    scale (a training part's would scale a layer part's aux-loss gradient); this rank's threads after."""
    from megatron_moe import comm
    from megatron_moe.training.initialize import shutdown

    shutdown(destroy_process_group=False)
    comm.join_reaper()
    reset_megatron_core_aux_loss_scale()
    return len(os.listdir("/proc/self/task"))  # native threads (gloo's too)


def write(results: dict) -> None:
    path = os.environ["RESULTS"]
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def yield_the_cores() -> None:
    """A background job's rank (`shared_jobs.py` `start`: niced) niced against the other sessions too: torchrun
    starts each rank in a session of its own, and with the kernel's autogroups (/proc/sys/kernel/
    sched_autogroup_enabled) the cores are shared between sessions by their group's niceness, not a process's
    (measured: the foreground's launches ran half as fast beside a niced job)."""
    if os.environ.get(BACKGROUND):
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
            f.write(str(os.nice(0)))


def main() -> None:
    from megatron_moe.platform import init_platform

    yield_the_cores()

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    platform = init_platform()
    dist.init_process_group(platform.backend, timeout=RUN_TIMEOUT)
    rank, results = dist.get_rank(), {}
    for part in spec:
        start = time.perf_counter()
        results[part["name"]] = getattr(fresh(part["worker"], part["args"]), part["entry"])()
        threads = tidy()
        if rank == 0:
            write(results)
            took = time.perf_counter() - start
            print(f"[job] {part['name']}: {took:.1f} s, {threads} threads after", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
