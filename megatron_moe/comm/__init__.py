"""Every collective megatron_moe issues, called by its purpose and started in one place.

    purpose-named call  ->  core.issue(Collective(kind, purpose, group, layer, ...), start)  ->  torch.distributed

- moe.py: `dispatch_all_to_all`, `combine_all_to_all` (async, differentiable:
  the backward's reverse all-to-all goes through `issue` too, same kind,
  `backward=True`), the expert-sharded `esp_all_gather` / `esp_reduce_scatter`
  (kinds `esp_ag` / `esp_rs`, likewise differentiable), their planning
  `exchange_counts`, `esp_gather_counts` and `agree_capacity`, and
  `sum_across_shards` (router loss statistics under sequence parallelism, kind `tp`).
- training.py: `reduce_lm_loss`, `reduce_moe_metrics`, `sum_expert_loads` (the expert bias's loads), `agree_exit`
  (preemption), `agree_nonfinite` (which ranks' own values went non-finite),
  `agree_startup_refusal` (rank 0's `--save` lock), `agree_save_failure` (a full
  disk on any rank), `barrier(purpose)`
  (checkpoint save and publish, shutdown).
- profiling.py: the cost-model profiler's timed traffic (all-to-all, the ESP
  all-gather / reduce-scatter in their gloo form, all-reduce) and its agreement.

The host's reads of device values in the training step run inside
`core.host_read(purpose, layer=...)`, so that a monitor sees where the host
waits on NCCL, whose `wait()` does not block it (core.py's docstring);
tests/unit/test_host_read_spans.py fails on a read outside one.

`core.issue` is the choke point; tests/unit/test_comm_choke_point.py fails on a
torch.distributed collective anywhere else in megatron_moe. megatron-core's own
collectives (TP layers, DDP buckets, the distributed optimizer, pipeline p2p,
checkpointing) are routed to it by the taps in megatron_core.py (README.md in
this folder lists them). A `Monitor` installed with `monitoring(...)` sees every
one: watchdog.py (stalls and deadlines, named), timers.py (`CommTimers`: per kind and MoE layer, time
from issue to completion, time blocked on it, bytes; its exposed time split into skew and transfer by skew.py's
arrival stamps, which every rank takes).
"""

from megatron_moe.comm.core import (
    KINDS,
    Collective,
    CommHandle,
    HostRead,
    Monitor,
    destroy_groups_but_world,
    group_rank,
    group_size,
    host_read,
    is_distributed,
    issue,
    monitoring,
)
from megatron_moe.comm.hierarchy import (
    Hierarchy,
    NodeLayout,
    NotHierarchical,
    Route,
    forget_hierarchies,
    hierarchy_of,
    layout_of,
    make_hierarchy_groups,
)
from megatron_moe.comm.moe import (
    BackwardOverlap,
    agree_capacity,
    combine_all_to_all,
    dispatch_all_to_all,
    esp_all_gather,
    esp_gather_counts,
    esp_reduce_scatter,
    exchange_counts,
    forget_planning_groups,
    gather_counts,
    make_planning_groups,
    planning_group,
    rows_all_to_all,
    shadow_broadcast,
    shadow_reduce,
    sum_across_shards,
)
from megatron_moe.comm.timers import CommSummary, CommTimers
from megatron_moe.comm.training import (
    agree_exit,
    agree_nonfinite,
    agree_save_failure,
    agree_startup_refusal,
    barrier,
    count_parameters,
    reduce_lm_loss,
    reduce_moe_metrics,
    sum_expert_loads,
)

__all__ = [
    "KINDS",
    "BackwardOverlap",
    "Collective",
    "CommHandle",
    "CommSummary",
    "CommTimers",
    "Hierarchy",
    "HostRead",
    "NodeLayout",
    "NotHierarchical",
    "Route",
    "Monitor",
    "agree_capacity",
    "agree_exit",
    "agree_nonfinite",
    "agree_save_failure",
    "agree_startup_refusal",
    "barrier",
    "combine_all_to_all",
    "count_parameters",
    "destroy_groups_but_world",
    "dispatch_all_to_all",
    "esp_all_gather",
    "esp_gather_counts",
    "esp_reduce_scatter",
    "exchange_counts",
    "gather_counts",
    "forget_hierarchies",
    "forget_planning_groups",
    "hierarchy_of",
    "layout_of",
    "make_hierarchy_groups",
    "group_rank",
    "group_size",
    "host_read",
    "is_distributed",
    "make_planning_groups",
    "issue",
    "monitoring",
    "planning_group",
    "rows_all_to_all",
    "shadow_broadcast",
    "shadow_reduce",
    "reduce_lm_loss",
    "reduce_moe_metrics",
    "sum_across_shards",
    "sum_expert_loads",
]
