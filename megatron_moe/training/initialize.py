"""Process start-up: platform, torch.distributed, megatron-core parallel state, seeds."""

from __future__ import annotations

import datetime
import gc
import logging
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_moe import comm
from megatron_moe.comm.hierarchy import NotHierarchical, node_layout, ranks_per_node
from megatron_moe.comm.megatron_core import tap_megatron_core
from megatron_moe.comm.watchdog import HeartbeatStore, Watchdog, job_prefix
from megatron_moe.config import RunConfig, placement
from megatron_moe.config.fields import require
from megatron_moe.config.moe_layer import AUTO
from megatron_moe.model.builder import params_dtype
from megatron_moe.moe.grouped_gemm import kernel_name
from megatron_moe.overlap import a2a_cost
from megatron_moe.overlap.degrees import layer_sizes
from megatron_moe.platform import Platform, init_platform, kernels_in_use
from megatron_moe.platform.process import default_to_single_process
from megatron_moe.platform.rng import seed_model_parallel

log = logging.getLogger("megatron_moe")


def freeze_imported_objects() -> None:
    """Set every object alive now aside from the garbage collector (`gc.freeze`): the ~430k of the imported
    modules (torch, megatron-core) then cost nothing in a full collection, `shutdown`'s included (0.4 s a
    collection on one core of the CI machine before; milliseconds after), nor in Python's automatic ones during
    the run. A collection first, so that only live objects are set aside; the run's own objects, made after
    this, are collected as before. In a process that runs several runs (the tests), each start sets aside
    what the runs before it left alive."""
    gc.collect()
    gc.freeze()


def initialize(cfg: RunConfig) -> Platform:
    """Bring up this rank: validate `cfg` against the world size, build the groups, seed.

    Validation happens before any process group exists beyond the default one,
    so a bad flag fails on every rank with the same message.
    """
    platform = init_platform()
    freeze_imported_objects()
    tap_megatron_core()
    store = default_to_single_process()
    if not dist.is_initialized():
        rendezvous = {} if store is None else {"store": store, "rank": 0, "world_size": 1}
        dist.init_process_group(backend=platform.backend, timeout=process_group_timeout(cfg), **rendezvous)
    cfg.validate(dist.get_world_size())
    dims = cfg.dims(dist.get_world_size())
    per_node = ranks_per_node(dims.world)
    expert_placement, placement_line = placement.resolve(cfg, dims.world, per_node)
    parallel_state.initialize_model_parallel(
        distributed_timeout_minutes=process_group_timeout(cfg) / datetime.timedelta(minutes=1),
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.esp,
        order=placement.rank_order(expert_placement, cfg.parallel.use_tp_pp_dp_mapping),
        num_distributed_optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
    )
    if cfg.moe.is_moe and cfg.moe.own_layer:  # the MoE layers' planning beside their all-to-alls
        comm.make_planning_groups(parallel_state.get_expert_model_parallel_group(), process_group_timeout(cfg))
        make_a2a_groups(cfg)
    set_seed(cfg.training.seed)
    if dist.get_rank() == 0:
        log.info("platform: device=%s backend=%s", platform.device, platform.backend)
        kernels = kernels_in_use() | {"expert_gemm": kernel_name(platform.device.type, params_dtype(cfg))}
        log.info("kernels: %s", ", ".join(f"{k}={v}" for k, v in kernels.items()))
        if cfg.moe.is_moe and dims.ep > 1 and (per_node < dims.world or cfg.parallel.expert_placement != "e+d"):
            log.info("%s", placement_line)  # on one node the layout line says it, unless asked for otherwise
        log.info("layout: %s", describe_layout(cfg, expert_placement))
    return platform


def make_a2a_groups(cfg: RunConfig) -> None:
    """--moe-a2a-algorithm 2dh or auto: `choose_a2a`, then the EP group's 2DH groups (comm/hierarchy.py) where 2DH
    runs. Before the model is built; every rank decides from the same figures (its EP group's layout, the same on
    every EP group, and the flags), so every rank makes the groups or none does."""
    algorithm, dims = cfg.moe.moe_a2a_algorithm, cfg.dims(dist.get_world_size())
    if algorithm == "linear" or dims.ep == 1:
        return
    group = parallel_state.get_expert_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    chosen, why = choose_a2a(algorithm, ranks, ranks_per_node(), dims.esp, lambda: layer_sizes(cfg).n_a2a)
    if dist.get_rank() == 0:
        log.info("all-to-all: %s runs %s: %s", algorithm, chosen, why)
    if chosen == "2dh":
        comm.make_hierarchy_groups(group, process_group_timeout(cfg))


def choose_a2a(algorithm: str, ranks: list[int], per_node: int, esp: int, n_a2a) -> tuple[str, str]:
    """(linear or 2dh, why) for --moe-a2a-algorithm `algorithm` on an EP group of global `ranks` with `per_node`
    ranks per node (LOCAL_WORLD_SIZE) and ESP `esp`; `n_a2a()`: bytes one rank sends per all-to-all (auto's cost
    model, overlap/a2a_cost.py). 2dh where it cannot run is refused, naming the flag: an EP group in one node (2DH
    would change nothing), not node-major with the same ranks on each node, or expert-sharded experts; auto runs
    linear there."""
    try:
        layout = node_layout(ranks, per_node, ranks[0])
        blocker = None if layout.nodes > 1 else f"the EP group {ranks} lies in one node: 2DH would change nothing"
    except NotHierarchical as error:
        layout, blocker = None, str(error)
    if esp > 1:
        blocker = f"expert-sharded experts (--expert-tensor-parallel-size={esp}) run the linear all-to-all"
    if blocker is not None:
        require(algorithm == AUTO, "--moe-a2a-algorithm", algorithm, f"linear or auto: {blocker}")
        return "linear", blocker
    if algorithm == AUTO:
        return a2a_cost.choose(n_a2a(), layout.nodes, layout.per_node)
    return "2dh", f"{layout.nodes} nodes x {layout.per_node} ranks"


def process_group_timeout(cfg: RunConfig) -> datetime.timedelta:
    """Every process group's timeout: --distributed-timeout-minutes plus a minute, so the watchdog's report
    (which names the collective and the missing peers) ends the job before gloo's or NCCL's timeout does."""
    return datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes + 1)


def start_watchdog(cfg: RunConfig, end_job) -> Watchdog | None:
    """The watchdog of this rank's collectives (None for a single process: nothing to wait for)."""
    if dist.get_world_size() == 1:
        return None
    p = cfg.parallel
    return Watchdog(
        stall_s=p.stall_report_seconds,
        deadline_s=60 * p.distributed_timeout_minutes,
        dead_s=p.dead_peer_seconds,
        end_job=end_job,
        store=HeartbeatStore(job_prefix(), timeout_s=min(5.0, max(1.0, p.stall_report_seconds / 4))),
        rank=dist.get_rank(),
    ).start()


def describe_layout(cfg: RunConfig, expert_placement: str = "e+d") -> str:
    world = dist.get_world_size()
    dims = cfg.dims(world)
    per_node, pp_before_dp = ranks_per_node(world), cfg.parallel.use_tp_pp_dp_mapping
    where = f" {placement.describe(dims, expert_placement, per_node, pp_before_dp)}" if dims.ep > 1 else ""
    return (
        f"world={world} TP={dims.tp} PP={dims.pp} "
        f"{f'VPP={dims.vpp} ' if dims.vpp else ''}"
        f"CP={dims.cp} EP={dims.ep} "
        f"DP={dims.dp} SP={dims.sequence_parallel} "
        f"microbatches={cfg.num_microbatches(world)}{f' order={placement.PP_BEFORE_DP}' if pp_before_dp else ''}{where}"
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
        comm.barrier("shutdown")
        parallel_state.destroy_model_parallel()
        comm.forget_planning_groups()
        comm.forget_hierarchies()
        forget_rotary_caches()
        if destroy_process_group:
            dist.destroy_process_group()
        else:
            comm.destroy_groups_but_world()  # with their transport threads: the next run creates its own


def forget_rotary_caches() -> None:
    """megatron-core's rotary embeddings keep `forward` in an lru_cache keyed by the module (32 entries): each
    run's embedding, with its context-parallel group and that group's transport threads, outlived the run (a
    gloo group and 3 threads a run, in a process that runs many: the tests' shared jobs)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    for embedding in (RotaryEmbedding, YarnRotaryEmbedding):
        embedding.forward.cache_clear()
