"""The one single-process bootstrap (tests, benchmarks, checkpoint conversion): one rank, idempotent."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_moe.platform.process import init_single_process
from megatron_moe.platform.rng import rng_tracker


def test_single_process_bootstrap_is_idempotent(megatron_world1):
    world, tp_group = dist.group.WORLD, parallel_state.get_tensor_model_parallel_group()
    states = {name: state.clone() for name, state in rng_tracker().get_states().items()}
    assert states  # seeded by the first call
    init_single_process(seed=7)  # already up: kept as it is, not reseeded
    assert dist.group.WORLD is world and dist.get_world_size() == 1
    assert parallel_state.get_tensor_model_parallel_group() is tp_group
    assert parallel_state.get_expert_model_parallel_world_size() == 1
    after = rng_tracker().get_states()
    assert after.keys() == states.keys() and all(torch.equal(after[k], states[k]) for k in states)


def test_a_launch_without_torchrun_listens_on_its_rendezvous_port_before_naming_it():
    """`python pretrain_gpt_moe.py` picks its own rendezvous: the store is bound to a port the system chose and
    MASTER_PORT names that port, never a port probed free and bound later (two launches together once collided
    there, EADDRINUSE, in the save lock's test). Run in a fresh process: this one's environment stays as it is."""
    code = (
        "import os, datetime, torch.distributed as dist\n"
        "from megatron_moe.platform.process import default_to_single_process\n"
        "store = default_to_single_process()\n"
        "assert os.environ['MASTER_PORT'] == str(store.port) and os.environ['RANK'] == '0', os.environ\n"
        "client = dist.TCPStore('127.0.0.1', store.port, is_master=False, timeout=datetime.timedelta(seconds=5))\n"
        "client.set('k', 'v'); assert store.get('k') == b'v'\n"
        "assert default_to_single_process() is None  # idempotent: RANK is set now\n"
    )
    _runs_clean(code, timeout=120)


def test_a_run_sets_the_imported_objects_aside_from_the_collector_and_still_collects_its_own():
    """`initialize` freezes what is alive at a run's start (torch's and megatron-core's ~430k objects), so the
    collections at teardown and during the run scan only the run's objects; garbage made after it, cycles
    included, is still collected. In a fresh process: this one's collector stays as it is."""
    code = (
        "import gc, weakref\n"
        "from megatron_moe.config import parse_args\n"
        "from megatron_moe.training.initialize import initialize\n"
        "assert gc.get_freeze_count() == 0\n"
        "alive = len(gc.get_objects())\n"
        "initialize(parse_args('--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 2 --train-iters 1 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128'.split()))\n"
        "assert gc.get_freeze_count() >= 0.9 * alive, (gc.get_freeze_count(), alive)\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.other, b.other = b, a; gone = weakref.ref(a); del a, b\n"
        "assert gone() is not None; gc.collect(); assert gone() is None\n"
    )
    _runs_clean(code, timeout=300)


def _runs_clean(code: str, timeout: int) -> None:
    """`code` in a fresh Python process exits 0."""
    import subprocess
    import sys

    from tests.conftest import shell_env

    out = subprocess.run([sys.executable, "-c", code], env=shell_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
