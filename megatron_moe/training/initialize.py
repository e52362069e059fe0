"""Process start-up: platform, torch.distributed, megatron-core parallel state, seeds."""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_moe.config import RunConfig
from megatron_moe.model.builder import params_dtype
from megatron_moe.moe.grouped_gemm import kernel_name
from megatron_moe.platform import Platform, init_platform, kernels_in_use
from megatron_moe.platform.rng import seed_model_parallel

log = logging.getLogger("megatron_moe")


def initialize(cfg: RunConfig) -> Platform:
    """Bring up this rank: validate `cfg` against the world size, build the groups, seed.

    Validation happens before any process group exists beyond the default one,
    so a bad flag fails on every rank with the same message.
    """
    platform = init_platform()
    _default_to_single_process()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=platform.backend,
            timeout=datetime.timedelta(minutes=int(os.environ.get("MEGATRON_MOE_DIST_TIMEOUT_MIN", "10"))),
        )
    cfg.validate(dist.get_world_size())
    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size or 1,
    )
    set_seed(cfg.training.seed)
    if dist.get_rank() == 0:
        log.info("platform: device=%s backend=%s", platform.device, platform.backend)
        kernels = kernels_in_use() | {"expert_gemm": kernel_name(platform.device.type, params_dtype(cfg))}
        log.info("kernels: %s", ", ".join(f"{k}={v}" for k, v in kernels.items()))
        log.info("layout: %s", describe_layout(cfg))
    return platform


def _default_to_single_process() -> None:
    """Let `python pretrain_gpt_moe.py ...` run as one rank without torchrun."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _free_port() -> int:
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


def describe_layout(cfg: RunConfig) -> str:
    world = dist.get_world_size()
    p = cfg.parallel
    return (
        f"world={world} TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
        f"CP={p.context_parallel_size} EP={p.expert_model_parallel_size} "
        f"DP={cfg.data_parallel_size(world)} SP={p.sequence_parallel} "
        f"microbatches={cfg.num_microbatches(world)}"
    )


def set_seed(seed: int) -> None:
    """Megatron's seeding: a different stream per pipeline stage, TP/EP trackers forked from it."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    seed_model_parallel(seed)


def shutdown(destroy_process_group: bool = True) -> None:
    """Tear down groups so no rank leaves a collective or a helper process behind."""
    if dist.is_initialized():
        dist.barrier()
        parallel_state.destroy_model_parallel()
        if destroy_process_group:
            dist.destroy_process_group()
