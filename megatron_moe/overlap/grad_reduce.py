"""The adaptive gradient partition at run time (FSMoE section 5): megatron-core DDP's gradient buckets regrouped
so that each MoE layer's backward launches the share of the data-parallel reduction the plan gives it.

Inputs: megatron-core's DDP built with one bucket per parameter (`bucket_size=1`, `overlap_grad_reduce`) and a
`GradPartition`. `regroup` replaces its bucket groups by `PlannedBucketGroup`s, one per (MoE layer, family) and
one per (completion point, family) for the rest; `GradReduceLauncher.release_layer` (from the run's
`OverlapRuntime.run_under`) releases MoE layer L's groups when L's backward all-to-all starts.
Invariants: a planned group starts its reduction when its gradients are ready *and* it is released; the rest
start when ready; `finish_grad_sync` starts whatever is still held; what is reduced, over which group, and the
scaling stay megatron-core's. The assignment and why: docs/internals/overlap.md ("... at run time").
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable

import torch
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from megatron_moe.overlap.cost_model import LayerSizes
from megatron_moe.overlap.grad_partition import GeneralizedLayer, GradPartition
from megatron_moe.platform.cpu_compat import Patch, source

log = logging.getLogger(__name__)


class PlannedBucketGroup(_ParamAndGradBucketGroup):
    """megatron-core's bucket group whose reduction also waits for its MoE layer's release (`layer`; None:
    released always, megatron-core's behaviour)."""

    def __init__(self, buckets, ddp_config, collective_group, collective_group_size, *, layer: int | None):
        super().__init__(buckets, ddp_config, collective_group, collective_group_size)
        self.layer = layer
        self.released = layer is None

    def _ready(self) -> bool:
        return self.per_param_grad_ready_counts == self.golden_per_param_grad_ready_counts

    def _start_if_due(self, force_all_reduce) -> None:
        if not self.is_first_batch and self.released and self.grad_reduce_handle is None and self._ready():
            self.start_grad_sync(force_all_reduce=force_all_reduce)

    def register_grad_ready(self, param: torch.nn.Parameter, force_all_reduce=False):
        """megatron-core's count of the last micro-batch's ready gradients; the reduction starts once every one is
        ready and the group is released."""
        assert self.ddp_config.overlap_grad_reduce, "planned buckets need overlap_grad_reduce"
        if not self.is_last_microbatch:
            return
        assert param in self.param_to_bucket, "Param is not in the bucket group"
        self.per_param_grad_ready_counts[param] = self.per_param_grad_ready_counts.get(param, 0) + 1
        self._start_if_due(force_all_reduce)

    def release(self, force_all_reduce=False) -> None:
        """Its MoE layer's backward has begun (the last micro-batch's only: earlier ones reduce nothing)."""
        if self.is_last_microbatch:
            self.released = True
            self._start_if_due(force_all_reduce)

    def finish_grad_sync(self, force_all_reduce=False):
        if self.ddp_config.overlap_grad_reduce and not self.is_first_batch and self.grad_reduce_handle is None:
            self.released = True  # not released (no all-to-all in this backward): start now, as megatron-core would
            self._start_if_due(force_all_reduce)
        super().finish_grad_sync(force_all_reduce=force_all_reduce)

    def reset(self):
        super().reset()
        self.released = self.layer is None


class GradReduceLauncher:
    """Releases MoE layer L's planned bucket groups when L's backward all-to-all starts (`release_layer`, called by
    the run's `OverlapRuntime.run_under`, before the work under that all-to-all runs)."""

    def __init__(self, partition: GradPartition | None = None):
        self.partition = partition
        self.groups: dict[int, list[PlannedBucketGroup]] = {}
        self.releases = 0
        """Planned groups released by an all-to-all since the last `stats()`."""

    def stats(self) -> dict:
        """Since the last call: planned groups released by their MoE layer's all-to-all, and how many there are;
        the plan's floor (`GradPartition.predicted_ms`, ms: the reduction no launch order hides)."""
        figures = {"released": self.releases, "planned": sum(len(g) for g in self.groups.values())}
        if self.partition is not None:
            figures["floor_ms"] = self.partition.predicted_ms["floor"]
        self.releases = 0
        return figures

    def release_layer(self, layer: int | None) -> None:
        """A backward all-to-all of MoE layer `layer` has started: its planned groups may start their reduction."""
        for group in self.groups.get(layer, ()):
            if not group.released and group.is_last_microbatch:
                group.release()
                self.releases += 1


def completion_order(module: torch.nn.Module, num_layers: int) -> list[tuple[torch.nn.Parameter, int]]:
    """(parameter, b) in the order their gradients complete in backward (docs/internals/overlap.md), where b says when:
    before the backward of every MoE layer numbered below b (b = its transformer layer's number; the final norm and
    output layer num_layers + 1; the embedding 0, after everything). Within a layer: megatron-core's buffer order
    (registration reversed)."""
    decoder = getattr(unwrap(module), "decoder", None)
    numbers = {str(local): layer.layer_number for local, layer in enumerate(getattr(decoder, "layers", ()))}
    located = []
    for position, (name, param) in enumerate(module.named_parameters()):
        if not param.requires_grad:
            continue
        if "decoder.layers." in name:
            before = numbers[name.split("decoder.layers.", 1)[1].split(".", 1)[0]]
        elif "embedding" in name:
            before = 0
        else:
            before = num_layers + 1
        located.append((-before, -position, param))
    return [(param, -negative) for negative, _, param in sorted(located, key=lambda x: x[:2])]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside its wrappers (megatron-core DDP, Float16Module)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def reduced_params(ddp) -> list[torch.nn.Parameter]:
    """The parameters whose reduction crosses ranks: dense ones over a DP group of > 1 rank, expert ones over an
    expert-DP group of > 1 (with every expert on one DP rank they are not reduced at all)."""
    out = []
    for attr in ("bucket_groups", "expert_parallel_bucket_groups"):
        for group in getattr(ddp, attr):
            if _collective(ddp, group).size() > 1:
                out += [p for bucket in group.buckets for p in bucket.params_list]
    return out


def generalized_layers(
    ddp, moe_layers: list[int], num_layers: int, sizes: LayerSizes
) -> tuple[list[GeneralizedLayer], float]:
    """The plan's input for this model chunk: per MoE layer in backward order, the bytes of reduced gradients
    that complete before its backward and after the previous MoE layer's began; and the bytes after the first
    MoE layer's (docs/internals/overlap.md)."""
    reduced = {id(p) for p in reduced_params(ddp)}
    order = [(p, before) for p, before in completion_order(ddp.module, num_layers) if id(p) in reduced]
    layers, above = [], float("inf")
    for layer in sorted(moe_layers, reverse=True):
        n = sum(p.numel() * _grad_bytes(ddp, p) for p, before in order if layer < before <= above)
        layers.append(GeneralizedLayer(layer=layer, sizes=sizes, grad_bytes=float(n)))
        above = layer
    tail = sum(p.numel() * _grad_bytes(ddp, p) for p, before in order if before <= above)
    return layers, float(tail)


def assign_layers(
    ddp, partition: GradPartition, num_layers: int, reduced: Iterable[torch.nn.Parameter]
) -> dict[torch.nn.Parameter, int | None]:
    """Parameter -> the MoE layer whose backward launches its reduction (None: when ready), by the plan's bytes
    (docs/internals/overlap.md). `reduced`: the parameters whose reduction crosses ranks (the others cost nothing)."""
    reduced = {id(p) for p in reduced}
    order = completion_order(ddp.module, num_layers)
    params = [(p, before) for p, before in order if id(p) in reduced]
    launch: dict[torch.nn.Parameter, int | None] = {p: None for p, _ in order}
    taken = 0
    for layer in sorted(partition.assigned, reverse=True):  # backward order
        share, got = partition.assigned[layer], 0.0
        while taken < len(params) and params[taken][1] > layer:
            p, _ = params[taken]
            size = p.numel() * _grad_bytes(ddp, p)
            if got + size / 2 > share:  # rounded to the nearest whole parameter
                break
            launch[p] = layer
            got += size
            taken += 1
    return launch


def _grad_bytes(ddp, param) -> int:
    return 4 if ddp.ddp_config.grad_reduce_in_fp32 else param.element_size()


def regroup(ddp, launch: dict[torch.nn.Parameter, int | None], launcher: GradReduceLauncher, num_layers: int) -> dict:
    """Replace `ddp`'s bucket groups by planned ones (docs/internals/overlap.md); returns {"groups": [(launch, family,
    params, bytes)]} for the log, launch "L<i>" (MoE layer i's backward) or "ready@<b>" (when ready, completion
    point b of `completion_order`). A bucket holding parameters of several launch layers goes with the one latest
    in backward (the smallest number; the rest latest of all, at its latest completion point)."""
    ready_at = {id(p): before for p, before in completion_order(ddp.module, num_layers)}
    summary = []
    ddp.param_to_bucket_group = {}
    for family, attr in (("dense", "bucket_groups"), ("expert", "expert_parallel_bucket_groups")):
        old = getattr(ddp, attr)
        if not old:
            continue
        collective = _collective(ddp, old[0])
        by_key: dict[tuple[int | None, int | None], list] = {}
        for group in old:
            for bucket in group.buckets:
                layers = [launch.get(p) for p in bucket.params_list]
                if None in layers:
                    key = (None, min(ready_at.get(id(p), 0) for p in bucket.params_list))
                else:
                    key = (min(layers), None)
                by_key.setdefault(key, []).append(bucket)
        new = []
        for layer, point in _backward_order(by_key):
            buckets = by_key[layer, point]
            group = PlannedBucketGroup(buckets, ddp.ddp_config, collective, collective.size(), layer=layer)
            new.append(group)
            if layer is not None:
                launcher.groups.setdefault(layer, []).append(group)
            for bucket in buckets:
                for p in bucket.params_list:
                    ddp.param_to_bucket_group[p] = group
            nbytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buckets)
            when = f"ready@{point}" if layer is None else f"L{layer}"
            summary.append((when, family, sum(len(b.params_list) for b in buckets), nbytes))
        if ddp.ddp_config.use_distributed_optimizer and ddp.ddp_config.overlap_param_gather:
            # --overlap-param-gather: forward gathers in the reverse of backward's order, each group
            # prefetching the next (megatron-core's chain, rebuilt for the new groups)
            for later, earlier in zip(new[1:], new[:-1]):
                later.next_param_gather_bucket_group = earlier
        setattr(ddp, attr, new)
    return {"groups": summary}


def _collective(ddp, group):
    if ddp.ddp_config.use_distributed_optimizer:
        return group.intra_distributed_optimizer_instance_group
    return group.data_parallel_group


def _backward_order(by_key: dict) -> list:
    """(layer, None) planned groups and (None, b) when-ready ones in the order backward reaches them: MoE layer
    L's backward (its groups' launch) comes before its transformer layer's attention completes (point L)."""
    return sorted(by_key, key=lambda key: -(key[0] + 0.5 if key[0] is not None else key[1]))


_BUCKET_GROUP_READS = (
    "self.per_param_grad_ready_counts",
    "self.golden_per_param_grad_ready_counts",
    "self.is_first_batch",
    "self.is_last_microbatch",
    "self.grad_reduce_handle",
    "self.param_to_bucket",
    "self.next_param_gather_bucket_group",
    "self.intra_distributed_optimizer_instance_group",
    "self.data_parallel_group",
    "def start_grad_sync(",
    "def finish_grad_sync(",
    "def register_grad_ready(",
    "def reset(self)",
)
_DDP_READS = ("self.bucket_groups", "self.expert_parallel_bucket_groups", "self.param_to_bucket_group")
_BUCKET_READS = ("self.params_list", "self.grad_data")


def _bucket_groups_fit() -> bool:
    """megatron-core's bucket group, bucket and DDP still have what PlannedBucketGroup and `regroup` read, call
    and override, and the bucket group's constructor takes what `regroup` passes."""
    buffers = "megatron.core.distributed.param_and_grad_buffer"
    group, bucket = source(buffers, "_ParamAndGradBucketGroup"), source(buffers, "_ParamAndGradBucket")
    ddp = source("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel")
    init = list(inspect.signature(_ParamAndGradBucketGroup.__init__).parameters)
    return (
        init[:5] == ["self", "buckets", "ddp_config", "collective_group", "collective_group_size"]
        and all(name in group for name in _BUCKET_GROUP_READS)
        and all(name in bucket for name in _BUCKET_READS)
        and all(name in ddp for name in _DDP_READS)
    )


PROBES: tuple[Patch, ...] = (
    Patch(
        "planned_bucket_groups",
        "overlap/grad_reduce.py: the adaptive --grad-reduce-schedule subclasses megatron-core's private "
        "_ParamAndGradBucketGroup and replaces DDP's bucket group lists with planned groups.",
        None,
        _bucket_groups_fit,
    ),
)
