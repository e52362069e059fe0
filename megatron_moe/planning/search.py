"""The layouts a run could use on a cluster, the ones that fit in memory, ranked by predicted step time.

Candidates: TP dividing the GPUs of a node, PP dividing the layers, VPP (model chunks per pipeline rank) 1 or a
divisor of the layers per stage up to `MAX_VPP`, EP dividing the experts, ESP dividing a node's GPUs and the
experts' width, DP what is left (CP = 1), the micro-batch a power of two dividing the global batch per DP rank,
then for EP > 1 each placement (d+e only where the expert-DP group has more than one rank) and each all-to-all
algorithm (2dh only where the EP group spans nodes with more than one rank on each), and each activation policy.
A candidate is kept only where the run's own checks accept it (`rules.check_parallel`, and megatron-core's
interleaved schedule's rule on the micro-batches), so every layout printed is one the trainer would start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from megatron_moe.config import RunConfig, rules
from megatron_moe.config.fields import ConfigError
from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.planning.hardware import GIB, Cluster, Compute
from megatron_moe.planning.model import POLICIES, Layout, Shape, memory_per_gpu
from megatron_moe.planning.step import Prediction, groups, predict_step

MAX_VPP = 4
MICRO_BATCHES = (1, 2, 4, 8)


def _divisors(n: int, at_most: int | None = None) -> list[int]:
    return [d for d in range(1, (n if at_most is None else min(n, at_most)) + 1) if n % d == 0]


def parallel_config(cfg: RunConfig, lay: Layout):
    """The run's ParallelConfig with the layout's degrees (the flags `Layout` stands for)."""
    return dataclasses.replace(
        cfg.parallel,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=lay.vpp if lay.vpp > 1 else None,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.esp,
        context_parallel_size=1,
        sequence_parallel=lay.tp > 1,
    )


def check_layout(cfg: RunConfig, shape: Shape, lay: Layout) -> str | None:
    """Why the trainer would refuse `lay` (the first error's text), or None."""
    parallel = parallel_config(cfg, lay)
    dims = ParallelDims.from_config(parallel, lay.world)
    try:
        rules.check_parallel(parallel, dims, cfg.model, cfg.moe)
        rules.check_moe(cfg.moe, cfg.model, parallel)
    except ConfigError as err:
        return str(err)
    per_step = lay.micro_batch * lay.dp
    if shape.global_batch % per_step:
        return f"--global-batch-size={shape.global_batch} is not a multiple of micro-batch x DP = {per_step}"
    if lay.vpp > 1 and (shape.global_batch // per_step) % lay.pp:
        return f"the interleaved pipeline needs micro-batches a multiple of PP={lay.pp}"
    if (lay.micro_batch * shape.seq) % lay.sp:
        return f"micro-batch x seq-length must split over TP={lay.tp} (sequence parallelism)"
    return None


def degrees(cluster: Cluster, shape: Shape) -> Iterator[Layout]:
    """Every candidate of the module docstring, before the checks."""
    world, g = cluster.world, cluster.gpus_per_node
    for tp in _divisors(g):
        for pp in _divisors(shape.layers):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            per_stage = shape.layers // pp
            vpps = [1] if pp == 1 else _divisors(per_stage, MAX_VPP)
            for vpp in vpps:
                for ep in _divisors(shape.experts):
                    for esp in _divisors(g):
                        if (tp * dp) % (ep * esp):
                            continue
                        for mbs in MICRO_BATCHES:
                            yield Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, esp=esp, dp=dp, micro_batch=mbs)


def variants(lay: Layout, gpus_per_node: int, policies: Iterable[str] = POLICIES) -> Iterator[Layout]:
    """The layout under each placement, all-to-all algorithm and activation policy that changes something."""
    placements = ["e+d"]
    if lay.ep > 1 and lay.expert_dp > 1:
        placements.append("d+e")
    for placement in placements:
        ep = groups(dataclasses.replace(lay, placement=placement), gpus_per_node)["ep"]
        algorithms = ["linear", "2dh"] if ep.crosses_nodes and ep.per_node > 1 else ["linear"]
        for a2a in algorithms:
            for policy in policies:
                yield dataclasses.replace(lay, placement=placement, a2a=a2a, activations=policy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult:
    ranked: list[Prediction]
    """Every layout that fits, fastest first."""
    searched: int
    """Layouts the checks accepted (all variants)."""
    too_big: int
    """Of those, the ones over the memory limit."""
    memory_limit_bytes: float


def search(
    cfg: RunConfig,
    shape: Shape,
    cluster: Cluster,
    compute: Compute,
    flops_per_token: float,
    *,
    memory_fraction: float = 0.9,
    policies: Iterable[str] = POLICIES,
) -> SearchResult:
    """Every valid layout, predicted; those over `memory_fraction` of the GPU's memory dropped
    (the rest is the CUDA context, NCCL's buffers and the allocator's fragmentation)."""
    limit = cluster.gpu.memory_gib * GIB * memory_fraction
    ranked, searched, too_big = [], 0, 0
    for base in degrees(cluster, shape):
        if check_layout(cfg, shape, base) is not None:
            continue
        for lay in variants(base, cluster.gpus_per_node, policies):
            searched += 1
            microbatches = shape.global_batch // (lay.micro_batch * lay.dp)
            memory = memory_per_gpu(shape, lay, microbatches)
            if memory["total"] > limit:
                too_big += 1
                continue
            ranked.append(predict_step(shape, lay, cluster, compute, flops_per_token, memory=memory))
    ranked.sort(key=lambda p: (p.step_ms, p.memory["total"]))
    return SearchResult(ranked=ranked, searched=searched, too_big=too_big, memory_limit_bytes=limit)
