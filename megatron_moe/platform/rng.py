"""Model-parallel RNG streams, named without their CUDA history.

megatron-core calls its model-parallel RNG tracker "cuda" for historical
reasons; on CPU the CPU compatibility layer routes it to the CPU generator.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from megatron.core.tensor_parallel import random as _mc_random


def seed_model_parallel(seed: int) -> None:
    """Seed the tracker's streams (TP-region, expert-parallel, data-parallel) from `seed`."""
    _mc_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def rng_tracker():
    """megatron-core's tracker of named RNG streams (fork() one for dropout in a region)."""
    return _mc_random.get_cuda_rng_tracker()


def expert_parallel_stream() -> str:
    """Name of the stream that differs between expert-parallel ranks."""
    return _mc_random.get_expert_parallel_rng_tracker_name()


def data_parallel_stream() -> str:
    """Name of the stream seeded alike on every rank (megatron-core's data-parallel one)."""
    return _mc_random.get_data_parallel_rng_tracker_name()


def keyed_seed(*keys: int) -> int:
    """A 63-bit seed that depends on `keys` alone (numpy's SeedSequence hash: nearby keys give unrelated seeds)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0]) & (2**63 - 1)


@contextlib.contextmanager
def host_rng_keyed(*keys: int):
    """The host's default generator seeded from `keys` alone for the block, and restored after it.

    What the block draws on the host (tensors on the CPU) is then a function of
    `keys` only: not of the rank, its earlier draws, or the device the model
    trains on. megatron-core's tracker streams cannot give that: on a GPU its
    `fork()` swaps the CUDA generator only, so host-side draws in a fork come
    out the same on every rank whose host generator was seeded alike.
    """
    with torch.random.fork_rng(devices=[]):  # the host generator alone: no device generator is read or touched
        torch.default_generator.manual_seed(keyed_seed(*keys))
        yield


def get_rng_states() -> dict:
    """Every RNG stream a forward may draw from (to replay it in a recompute)."""
    from megatron_moe.platform.device import current_platform

    states = {"cpu": torch.get_rng_state(), "tracker": dict(rng_tracker().get_states())}
    if current_platform().is_accelerator:
        states["device"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    rng_tracker().set_states(dict(states["tracker"]))  # the tracker adopts the dict it is given
    if "device" in states:
        torch.cuda.set_rng_state(states["device"])
