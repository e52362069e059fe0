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
