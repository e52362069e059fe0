"""A run's set-up: the overlap runtime, the model chunks in megatron-core DDP, the optimizer and LR scheduler, and
the overlap planners' choices applied to the built model (pipeline degrees, operator partition, gradient partition,
shadow costs).

Inputs: the `RunConfig`, the transformer config and, for the planners, the cluster's fits. Outputs: the objects
`training/__init__.py` wires together. Invariant: the `OverlapRuntime` is attached to the model once
(`build_ddp_model`); later steps fill in its pieces (`install_grad_reduce_plan`'s launcher) and never touch the
model's dispatchers again.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

from megatron_moe import comm
from megatron_moe.config import RunConfig
from megatron_moe.config.moe_layer import AUTO
from megatron_moe.config.rules import parse_pieces, parse_ranges, partition_blocker
from megatron_moe.model.builder import build_model_chunks
from megatron_moe.model.partition import install_partition
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.metrics import moe_layer_modules
from megatron_moe.moe.shadow import ShadowCosts
from megatron_moe.overlap.cost_model import (
    FIT_KINDS,
    MIN_GAIN,
    ClusterFits,
    LayerSizes,
    LinearFit,
    Schedule,
    fit_linear,
)
from megatron_moe.overlap.degrees import experts_defer_wgrad, layer_sizes, olp_dense_ms, plan_degrees
from megatron_moe.overlap.grad_partition import GradPartition, t_ar_ms
from megatron_moe.overlap.grad_partition import partition as grad_partition
from megatron_moe.overlap.grad_reduce import (
    GradReduceLauncher,
    assign_layers,
    generalized_layers,
    reduced_params,
    regroup,
    unwrap,
)
from megatron_moe.overlap.op_partition import plan_partition, stage_model
from megatron_moe.overlap.profiler import (
    DenseWork,
    ProfileGroups,
    ProfileSettings,
    comm_calls,
    layer_profile_settings,
    timed_ms,
)
from megatron_moe.overlap.runtime import OverlapRuntime
from megatron_moe.overlap.wgrad_queue import WgradQueue
from megatron_moe.platform import current_platform
from megatron_moe.training.optimizer import build_optimizer  # noqa: F401 (one of set-up's entry points)

log = logging.getLogger(__name__)


def build_wgrad_queue(cfg: RunConfig) -> WgradQueue | None:
    """Lancet's weight-gradient queue as --overlap-wgrad says (None: off, or nothing to hide under)."""
    policy = cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size)
    if policy == "off":
        return None
    max_mb = cfg.moe.overlap_wgrad_max_mb or None
    return WgradQueue(policy, max_mb=max_mb, num_layers=cfg.model.layer_count, report=cfg.moe.overlap_wgrad_report)


def build_overlap_runtime(cfg: RunConfig) -> OverlapRuntime:
    """The run's overlap runtime, built once before the model: Lancet's queue as --overlap-wgrad says; the
    gradient-reduce launcher, plans and fits are filled in on it later in the set-up."""
    return OverlapRuntime(wgrad_queue=build_wgrad_queue(cfg))


def build_ddp_model(
    cfg: RunConfig, config: TransformerConfig, vocab_size: int, overlap: OverlapRuntime | None = None
) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per virtual pipeline stage, else the one stage), each in its own megatron-core
    DDP as Megatron-LM's get_model wraps them (bucketing off from the second chunk on: its reduction overlaps the
    other chunks' compute anyway); `overlap` is attached to them (`OverlapRuntime.attach`): with its queue, their
    deferrable modules' weight gradients go through it (megatron-core's `delay_wgrad_compute` protocol)."""
    modules = build_model_chunks(cfg, config, vocab_size)
    if overlap is not None:
        overlap.attach(modules)
    wgrad_queue = overlap.wgrad_queue if overlap is not None else None
    adaptive = adaptive_grad_reduce(cfg)
    ddp_config = DistributedDataParallelConfig(
        delay_wgrad_compute=wgrad_queue is not None,
        grad_reduce_in_fp32=cfg.training.bf16 or cfg.training.fp16,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce or adaptive,
        bucket_size=1 if adaptive else cfg.parallel.ddp_bucket_size,  # adaptive: one per parameter, regrouped
        use_distributed_optimizer=cfg.sharded_by_ddp,  # Muon's layer-wise optimizer: DDP all-reduces
        num_distributed_optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        # Ours instead (training/divergence.py, off under fp16): it names the iteration, rank and parameter.
        check_for_nan_in_grad=False,
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=module, disable_bucketing=index > 0)
        for index, module in enumerate(modules)
    ]
    for chunk in model:
        comm.broadcast_params(chunk)
    return model


def build_scheduler(cfg: RunConfig, optimizer) -> OptimizerParamScheduler:
    """Warm-up then decay, counted in samples like Megatron-LM (steps x global batch)."""
    t = cfg.training
    spans = t.lr_schedule_samples()
    return OptimizerParamScheduler(
        optimizer,
        init_lr=t.lr_warmup_init if spans["warmup"] else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=spans["warmup"],
        lr_decay_steps=spans["decay"],
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=max(t.train_iters, 1) * t.global_batch_size,
        wd_incr_style="constant",
        wsd_decay_steps=spans["wsd_decay"],
        lr_wsd_decay_style=t.lr_wsd_decay_style if t.lr_decay_style == "WSD" else None,
    )


def wire_model_config(cfg: RunConfig, config: TransformerConfig, model, optimizer) -> None:
    """Hooks megatron-core's schedules call: grad finalisation over every chunk, loss scaling, and, as Megatron-LM
    sets them for a list of chunks, one `no_sync` per chunk and, with --overlap-grad-reduce, each chunk's
    `start_grad_sync` (its align_grad_reduce default: the interleaved schedule starts a chunk's reduction once its
    last micro-batch's backward is done). `param_sync_func` stays unset, as Megatron-LM leaves it without
    --align-param-gather: under --overlap-param-gather each chunk's forward pre-hooks gather its parameters."""
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if len(model) == 1:
        config.no_sync_func = model[0].no_sync
        return
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if cfg.parallel.overlap_grad_reduce:
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]


def unwire_model_config(config: TransformerConfig, model) -> None:
    """A finished run's teardown: undo `wire_model_config` and drop the autograd graphs its modules kept.

    Both held the run's model, optimizer, DDP and process groups past the run, through edges the garbage collector
    cannot see. megatron-core's distributed optimizer shards an fp32 parameter as a view of it (`param.view(-1)[a:b]`,
    no detach), so the shard's autograd graph reaches the parameter's AccumulateGrad node, whose hook holds the DDP;
    megatron-core's token dispatcher keeps its last `probs`, graph and all. With `config.grad_scale_func` naming the
    optimizer, that made a cycle through C++ (config -> optimizer -> shard -> node -> hook -> DDP -> model -> config):
    a process running many runs (the tests' shared jobs) kept each one, 5-6 gloo groups and 15-17 threads a rank.
    """
    config.finalize_model_grads_func = config.grad_scale_func = None
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    for module in (module for chunk in model for module in chunk.modules()):
        helpers = [value for value in vars(module).values() if hasattr(value, "__dict__") and not callable(value)]
        for holder in (module, *helpers):  # a module, and what it keeps that is not a module (the dispatcher)
            for name, value in list(vars(holder).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(holder, name, None)


# ---------------------------------------------------------------------------------------------- pipeline degrees


def adaptive_grad_reduce(cfg: RunConfig) -> bool:
    """--grad-reduce-schedule adaptive in force: our MoE layer with all-to-alls to launch from (EP > 1) and a
    gradient reduction across data-parallel ranks (dense over DP, experts over expert-DP)."""
    moe, par = cfg.moe, cfg.parallel
    if par.grad_reduce_schedule != "adaptive" or not (moe.is_moe and moe.own_layer) or adaptive_refused(cfg):
        return False
    dp = parallel_state.get_data_parallel_world_size()
    expert_dp = parallel_state.get_expert_data_parallel_world_size()
    return par.expert_model_parallel_size > 1 and max(dp, expert_dp) > 1


def adaptive_refused(cfg: RunConfig) -> str | None:
    """Why the default --grad-reduce-schedule adaptive falls back to megatron-core's buckets under the interleaved
    pipeline or several distributed-optimizer instances (None where it does not); a typed `--grad-reduce-schedule
    adaptive` there is refused at parsing."""
    par = cfg.parallel
    chunks = par.virtual_pipeline_size(cfg.model.num_layers)
    if par.grad_reduce_schedule != "adaptive" or not cfg.moe.own_layer:
        return None
    if par.num_distributed_optimizer_instances > 1:
        return (
            f"{par.num_distributed_optimizer_instances} distributed-optimizer instances: megatron-core reduces "
            "within each instance and then across them, bucket by bucket, in its own step"
        )
    if chunks is None:
        return None
    return (
        f"the interleaved pipeline, {chunks} model chunks per pipeline rank: megatron-core's interleaved schedule "
        "starts each chunk's reduction after that chunk's last micro-batch, and chunks after the first have one "
        "bucket, so there is no per-MoE-layer bucket plan to launch"
    )


def partition_planned(cfg: RunConfig) -> bool:
    """Whether Lancet's DP picks the operator partition (--moe-partition-pieces or --moe-partition-range auto where
    the micro-batch could split): the cost model then needs its attention / dense lines."""
    moe, b = cfg.moe, cfg.training.micro_batch_size
    if not (moe.is_moe and moe.own_layer) or b == 1 or partition_blocker(cfg) is not None:
        return False
    pieces = parse_pieces(moe.moe_partition_pieces, b)
    ranges = parse_ranges(moe.moe_partition_range, cfg.model.num_layers)
    return pieces is None or (pieces > 1 and ranges is None)


def install_operator_partition(
    cfg: RunConfig, model, fits: ClusterFits | None, source: str = "", schedules: dict[int, Schedule] | None = None
) -> list[dict]:
    """Lancet's operator partition on each model chunk's block: the flags' pieces and ranges, or where either is
    auto Lancet's DP on `fits` (`op_partition.plan_partition`, with the solved pipeline `schedules`). Every rank
    plans from the same agreed profile and flags, so every rank of a stage runs the same pieces. Returns, per model
    chunk that runs pieces or was planned, {"layers", "ranges": [[first, last, pieces]], and with a plan "predicted_ms",
    "a2a_ms", "hidden_ms" (partitioned / unpartitioned, one micro-batch forward + backward)}; logged by the first
    rank of each pipeline stage."""
    moe, b = cfg.moe, cfg.training.micro_batch_size
    if not (moe.is_moe and moe.own_layer):
        return []
    pieces = parse_pieces(moe.moe_partition_pieces, b)
    ranges = parse_ranges(moe.moe_partition_range, cfg.model.num_layers)
    if pieces == 1 or (pieces is None and b == 1) or (pieces is None and partition_blocker(cfg) is not None):
        return []
    report = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    figures = []
    for chunk in model:
        decoder = unwrap(chunk).decoder
        layers = [layer.layer_number for layer in decoder.layers]
        if not layers:
            continue
        entry: dict = {"layers": [layers[0], layers[-1]]}
        if not partition_planned(cfg):  # N pieces over the given ranges (or all layers): no planner
            plan_ranges = [(first, last, pieces) for first, last in ranges or [(layers[0], layers[-1])]]
            if AUTO in (moe.moe_pipeline_degree, moe.moe_bp_pipeline_degree):
                _unchunk(decoder, [(first, last) for first, last, _ in plan_ranges])
        elif fits is None or fits.missing_dense():
            why = source if fits is None else f"the profile has no {', '.join(fits.missing_dense())} lines"
            if report:
                log.info("operator partition: auto is off (%s)", why)
            continue
        else:
            plan = plan_partition(fits, stage_model(cfg, layers, schedules), pieces=pieces, ranges=ranges)
            plan_ranges = plan.as_tuples()
            _unchunk(decoder, [(span.first, span.last) for span in plan.ranges if span.unchunked])
            entry |= {"predicted_ms": plan.predicted_ms, "a2a_ms": plan.a2a_ms, "hidden_ms": plan.hidden_ms}
            if report:
                log.info("operator partition, layers %d-%d (Lancet's DP, profile %s):\n%s", layers[0], layers[-1],
                         source, plan.report())  # fmt: skip
        installed = install_partition(decoder, plan_ranges)
        entry["ranges"] = [[layers[r.start], layers[r.stop - 1], r.pieces] for r in installed]
        figures.append(entry)
        if report and installed:
            spans = ", ".join(f"{first}-{last} in {k} pieces" for first, last, k in entry["ranges"])
            log.info("operator partition: layers %s of each micro-batch", spans)
    return figures


def _unchunk(decoder, spans: list[tuple[int, int]]) -> None:
    """The MoE layers in `spans` run their pieces unchunked (where their degrees are auto): the planner predicted
    r = 1 faster in pieces, or pieces were asked for without a plan, and auto's degrees were solved for whole
    micro-batches, where nothing else hides the all-to-alls (tools/bench_step.py measured pieces chunked at 2x1,
    0.5 Gbit/s 13% slower than whole micro-batches chunked, unchunked pieces 3% faster)."""
    for first, last in spans:
        for layer in decoder.layers:
            if first <= layer.layer_number <= last and isinstance(layer.mlp, MoELayer):
                layer.mlp.set_pipeline_degrees(*_degrees(layer.mlp, 1, 1))


LINK_PROBE_BYTES = (256 << 10, 1 << 20)
"""Message sizes per rank of the link probe (`link_fits`): the profile's smallest and largest."""
LINK_PROBE_REPEATS = 3


def link_fits(cfg: RunConfig, fits: ClusterFits | None) -> ClusterFits | None:
    """The lines the communication timers price the crossing bytes with (training/comm_report.py `wire_lines`):
    the cost model's `fits` when this run has them; else, with the timers on, a link probe: the all-to-all over
    the EP group and the all-reduce over the DP group timed alone, between barriers, at `LINK_PROBE_BYTES` (the
    profiler's calls, a second or less even on a slow link), fitted as the profile fits them. A probe because no
    window of the timers can tell the link's rate: a rank's issued -> done span of an all-to-all is short when
    its peer issued first (the bytes had arrived) or when its sends fit the socket buffers. Every rank calls it
    (collective); None with the timers off or no group of more than one rank."""
    if fits is not None or cfg.logging.no_comm_timers:
        return fits
    groups = ProfileGroups.from_parallel_state()
    probed = {"a2a": ("ep", groups.ep), "ar": ("dp", groups.dp)}
    sizes = {name: size for name, size in groups.sizes().items() if name in ("ep", "dp") and size > 1}
    if not sizes:
        return None
    lines = {kind: LinearFit(alpha=0.0, beta=0.0) for kind in FIT_KINDS}
    device = current_platform().device
    for kind, (name, group) in probed.items():
        if name in sizes:
            calls = [comm_calls(kind, group, n, device) for n in LINK_PROBE_BYTES]
            times = timed_ms([call for _, call in calls], LINK_PROBE_REPEATS)
            lines[kind] = fit_linear([(n, ms) for (n, _), ms in zip(calls, times)])
    return ClusterFits(fits=lines, cluster=sizes)


def resolve_pipeline_degrees(
    cfg: RunConfig,
    model,
    fits: ClusterFits | None,
    source: str = "",
    partition: GradPartition | None = None,
    *,
    quiet: bool = False,
) -> dict[int, Schedule] | None:
    """Resolve --moe-pipeline-degree / --moe-bp-pipeline-degree auto (FSMoE) on every MoE layer of
    `model`: the cluster's `fits` (`training.cost_profile.cluster_fits`), each layer's sizes and the gradient
    all-reduce the adaptive `partition` puts in its backward (t_gar), FSMoE's Algorithm 1. Returns MoE layer
    number -> schedule; None when nothing is auto. `quiet`: the cost model's start-up line says the degrees (the
    per-layer predictions only with --verbose)."""
    moe = cfg.moe
    if not (moe.is_moe and moe.own_layer) or AUTO not in (moe.moe_pipeline_degree, moe.moe_bp_pipeline_degree):
        return None
    layers = list(moe_layer_modules(model))
    if fits is None:
        for layer in layers:
            layer.set_pipeline_degrees(*_degrees(layer, 1, 1))
        if dist.get_rank() == 0 and not quiet:
            log.info("pipeline degrees: auto is 1 (%s)", source)
        return None
    t_gar = {} if partition is None else {layer: t_ar_ms(fits, n) for layer, n in partition.assigned.items()}
    schedules = plan_degrees(cfg, fits, t_gar_ms=t_gar)
    for layer in layers:
        schedule = schedules.get(layer.layer_number) or next(iter(schedules.values()))
        layer.set_pipeline_degrees(*_degrees(layer, schedule.forward, schedule.backward))
    if dist.get_rank() != 0 or (quiet and not cfg.logging.verbose):  # the same on every rank (agreed profile)
        return schedules
    log.info(
        "pipeline degrees (FSMoE cost model, profile %s), forward / backward and predicted ms (case): %s",
        source,
        "; ".join(
            f"L{n} {s.forward}/{s.backward}, {s.predicted_ms['forward']:.2f} ({s.case['forward']}) / "
            f"{s.predicted_ms['backward']:.2f} ({s.case['backward']})"
            for n, s in schedules.items()
        ),
    )
    return schedules


def install_shadow_costs(cfg: RunConfig, model, fits: ClusterFits | None, source: str = "") -> None:
    """--moe-shadow-experts auto (FasterMoE's policy, moe/shadow.py): each MoE layer gets the cluster's `fits`
    and its sizes; without fits (EP = 1, no profile) auto shadows nothing, said once."""
    if not (cfg.moe.is_moe and cfg.moe.own_layer) or cfg.moe.moe_shadow_experts != AUTO:
        return
    layers = [layer for layer in moe_layer_modules(model) if layer.shadow.active]
    if fits is None or not layers:
        if dist.get_rank() == 0:
            log.info("shadow experts: auto shadows nothing (%s)", source if fits is None else "no layer can shadow")
        return
    for layer in layers:
        w1, w2 = layer.experts.weight1, layer.experts.weight2
        size = w1.element_size()
        layer.set_shadow_costs(
            ShadowCosts(
                fits=fits,
                macs_per_row=w1.shape[2] * w2.shape[2] * (3 if layer.cfg.gated else 2),
                row_bytes=w1.shape[2] * size,
                weight_bytes=(w1[0].numel() + w2[0].numel()) * size,
            )
        )
    if dist.get_rank() == 0:
        log.info("shadow experts: auto, FasterMoE's greedy policy on the cost model (profile %s)", source)


def install_grad_reduce_plan(cfg: RunConfig, model, fits: ClusterFits | None) -> GradReduceLauncher | None:
    """--grad-reduce-schedule adaptive (FSMoE's gradient partition): the plan from `fits` and this
    stage's MoE layers, realised in the model chunk's DDP bucket groups: the launcher (its `partition`, the plan),
    which the caller puts on the run's `OverlapRuntime` (the MoE layers' backward all-to-alls release its groups
    through it, `megatron_moe.overlap.grad_reduce`). None where megatron-core's buckets stay."""
    why = adaptive_refused(cfg)
    if why and dist.get_rank() == 0:
        log.info("gradient reduction: megatron-core's buckets, not the adaptive partition (%s)", why)
    if not adaptive_grad_reduce(cfg) or fits is None:
        return None
    ddp = model[0]  # the first stage's only chunk (no virtual pipeline here)
    # The decoder's MoE layers: the MTP layers' gradients complete with the output layer's (grad_reduce.py
    # `completion_order`), so their all-to-alls launch no planned share.
    layers = [layer.layer_number for layer in moe_layer_modules(model) if layer.layer_number <= cfg.model.num_layers]
    if parallel_state.get_pipeline_model_parallel_rank() > 0 or not layers:
        # megatron-core turns bucketing off after the first stage: one bucket, reduced when it is ready
        return None
    generalized, tail = generalized_layers(ddp, layers, cfg.model.num_layers, layer_sizes(cfg))
    dense = olp_dense_ms(cfg, fits)
    generalized = [dataclasses.replace(g, t_olp_dense_ms=dense[g.layer]) for g in generalized]
    partition = grad_partition(fits, generalized, tail, dw_in_backward=not experts_defer_wgrad(cfg))
    predicted = partition.predicted_ms
    if cfg.moe.moe_overlap_choice == AUTO and not partition.pays(MIN_GAIN):
        if dist.get_rank() == 0:  # the choice leaves off what it predicts to lose (the same plan on every rank)
            log.info(
                "gradient reduction: megatron-core's buckets (overlap choice: the adaptive partition's backward "
                "predicted %.2f ms against %.2f, under %.0f%% saved)",
                predicted["total"], predicted["megatron"], 100 * MIN_GAIN,
            )  # fmt: skip
        return None
    launch = assign_layers(ddp, partition, cfg.model.num_layers, reduced_params(ddp))
    launcher = GradReduceLauncher(partition=partition)
    groups = regroup(ddp, launch, launcher, cfg.model.num_layers)["groups"]
    if dist.get_rank() == 0:
        shares = ", ".join(f"L{g.layer} {partition.assigned[g.layer] / 2**20:.2f}" for g in generalized)
        log.info(
            "gradient reduction (FSMoE adaptive partition): MiB launched in each MoE layer's backward: %s; "
            "%.2f MiB after backward (started when ready); predicted backward ms %.2f "
            "(megatron-core's after-backward reduction: %.2f); "
            "bucket groups (layer, family, params, bytes): %s",
            shares,
            partition.tail_bytes / 2**20,
            partition.predicted_ms["total"],
            partition.predicted_ms["megatron"],
            groups,
        )
    return launcher


def _degrees(layer: MoELayer, forward: int, backward: int) -> tuple[int, int]:
    """The solver's degrees where the layer's flag says auto, the flag's integer elsewhere."""
    configured = (layer.cfg.pipeline_degree, layer.cfg.bp_pipeline_degree)
    return tuple(solved if flag == AUTO else flag for flag, solved in zip(configured, (forward, backward)))


def profile_settings(sizes: LayerSizes, cfg: RunConfig, *, dense: bool = False) -> ProfileSettings:
    """`megatron_moe.overlap.profiler.layer_profile_settings` at this run's MoE layer widths; `dense`: with the
    attention / dense MLP / router lines the partition planner needs, at this run's model widths."""
    layer, m = cfg.moe.layer_config(cfg.model), cfg.model
    work = None
    if dense:
        work = DenseWork(
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_width,
            gated=m.swiglu,
            normalization=m.normalization,
            seq_length=m.seq_length,
            batches=tuple(sorted({1, max(1, cfg.training.micro_batch_size // 2), cfg.training.micro_batch_size})),
            sequence_parallel=cfg.parallel.sequence_parallel,
            num_experts=layer.num_experts,
            topk=layer.topk,
        )
    return layer_profile_settings(
        sizes,
        hidden_size=layer.hidden_size,
        ffn_hidden_size=layer.ffn_hidden_size,
        num_experts=layer.num_experts,
        gated=layer.expert_type == "swiglu",
        dense=work,
    )
