"""A run's teardown that keeps torch.distributed up (many runs in one job, as the distributed tests do) ends the
run's process groups and their transport threads: megatron-core's destroy_model_parallel only drops its
references, and a 4-rank job of 34 runs had gathered 1,664 threads per rank (about 400 runnable at once)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_moe import comm


def gloo_threads() -> int:
    """This process's gloo transport threads (Linux: the thread names in /proc)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile (ESRCH once it is reaped)
            pass
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def settled_gloo_threads() -> int:
    """`gloo_threads` once the count holds for 0.2 s (5 s at most): a group's threads start, and take their names,
    asynchronously after it is made (a world counted at once after init_process_group read 0 threads, then 3)."""
    count, since, deadline = gloo_threads(), time.monotonic(), time.monotonic() + 5
    while time.monotonic() - since < 0.2 and time.monotonic() < deadline:
        time.sleep(0.02)
        if (now := gloo_threads()) != count:
            count, since = now, time.monotonic()
    return count


@pytest.fixture
def gloo_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_teardown_destroys_every_group_but_the_world_and_their_threads(gloo_world):
    assert hasattr(distributed_c10d, "_world") and isinstance(distributed_c10d._world.pg_map, dict)  # what it reads
    alone = settled_gloo_threads()  # the world's, and any an earlier test's groups left for the garbage collector
    for _ in range(4):
        dist.all_reduce(torch.ones(1), group=dist.new_group([0]))  # held by torch's registry only, as after a run
    with_groups = gloo_threads()
    assert with_groups > alone  # each group runs threads of its own
    assert comm.destroy_groups_but_world() == 4
    assert list(distributed_c10d._world.pg_map) == [distributed_c10d._get_default_group()]
    reaper = comm.core._REAPER  # frees the groups while the caller goes on
    assert reaper is not None and reaper.name == "process-group-reaper" and not reaper.daemon  # exit waits for it
    comm.join_reaper()
    assert comm.core._REAPER is None
    deadline = time.monotonic() + 5
    while gloo_threads() > alone and time.monotonic() < deadline:  # a thread's exit is asynchronous
        time.sleep(0.05)
    assert gloo_threads() <= alone < with_groups
    assert comm.destroy_groups_but_world() == 0
    dist.barrier()  # the world still works


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_teardown_frees_the_group_megatron_cores_rotary_cache_held(gloo_world):
    """megatron-core's RotaryEmbedding.forward is an lru_cache keyed by the module, which holds its context-parallel
    group: each run's group (and its threads) outlived the run, 1,099 threads a rank by a shared job's 15th part."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_moe.platform import init_platform
    from megatron_moe.training.initialize import forget_rotary_caches

    init_platform()  # megatron-core's embedding on the CPU
    alone = settled_gloo_threads()
    embedding = RotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True, cp_group=dist.new_group([0])
    )
    embedding(16)  # cached, with the module
    del embedding
    forget_rotary_caches()
    assert comm.destroy_groups_but_world() == 1
    comm.join_reaper()
    deadline = time.monotonic() + 5
    while gloo_threads() > alone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gloo_threads() <= alone


_RUN_THEN_COUNT = """
import gc, sys
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron_moe.config import parse_args
from megatron_moe.platform.process import default_to_single_process
from megatron_moe.training import pretrain
store = default_to_single_process()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
         "--global-batch-size 2 --train-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
         "--num-experts 4 --moe-router-topk 2 --eval-iters 0").split() + sys.argv[1:]
pretrain(parse_args(flags), keep_process_group=True)
gc.collect()
print(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
"""


@pytest.mark.parametrize(
    "flags",
    [["--use-distributed-optimizer"], ["--moe-layer-impl", "mcore", "--disable-bias-linear"]],
    ids=["distributed_optimizer", "megatron_cores_layer"],
)
def test_a_finished_run_leaves_no_model_behind(flags):
    """A run's model, DDP and optimizer (and the process groups they hold) are freed when `pretrain` returns.
    megatron-core's fp32 parameter shards (views with a graph) and its dispatcher's last `probs` made a cycle
    through autograd nodes the garbage collector cannot see; `unwire_model_config` breaks it at the run's end."""
    import subprocess
    import sys

    from tests.conftest import shell_env

    out = subprocess.run(
        [sys.executable, "-c", _RUN_THEN_COUNT, *flags], env=shell_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "0", out.stdout[-2000:]
