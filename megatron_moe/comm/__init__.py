"""Every collective megatron_moe issues, called by its purpose and started in one place.

    purpose-named call  ->  core.issue(Collective(kind, purpose, group, layer, ...), start)  ->  torch.distributed

- moe.py: the MoE layer's all-to-alls, ESP all-gather / reduce-scatter and their planning exchanges.
- training.py: loss and metric reductions, the agreements (exit, non-finite, start-up refusal, save failure, the
  overlap choice's predictions), barriers.
- profiling.py: the cost-model profiler's timed traffic and its agreement.
Invariants (each kept by a test): `core.issue` is the only start of a torch.distributed collective in the package
(test_comm_choke_point.py); every host read of device values in the step runs inside `core.host_read`
(test_host_read_spans.py). megatron-core's own collectives reach `issue` through megatron_core.py's taps. A
`Monitor` installed with `monitoring(...)` sees every one: watchdog.py, timers.py, skew.py.
Every call, its kind and when it runs: README.md in this folder and docs/internals/comm.md.
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
    join_reaper,
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
    sum_global_batch_counts,
)
from megatron_moe.comm.timers import CommSummary, CommTimers
from megatron_moe.comm.training import (
    agree_exit,
    agree_nonfinite,
    agree_predictions,
    agree_save_failure,
    agree_startup_refusal,
    barrier,
    broadcast_params,
    count_parameters,
    reduce_lm_loss,
    reduce_moe_metrics,
    reduce_mtp_losses,
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
    "agree_predictions",
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
    "join_reaper",
    "monitoring",
    "planning_group",
    "rows_all_to_all",
    "shadow_broadcast",
    "shadow_reduce",
    "broadcast_params",
    "reduce_lm_loss",
    "reduce_mtp_losses",
    "reduce_moe_metrics",
    "sum_across_shards",
    "sum_expert_loads",
    "sum_global_batch_counts",
]
