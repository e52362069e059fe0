"""The training run's own collectives: the replicas' start (the parameters' broadcast), the logged loss, MoE
metrics, the exit agreement, barriers, the dW-overlap profile, the start-up summary's parameter count.

All are kind `other`: small, once per step (or per save, or per profiled plan), never overlapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, group_size, is_distributed, issue, nbytes

BUCKET = 64 << 20
"""`broadcast_params` sends at most this much in one collective (it copies parameters into a bucket first)."""


def broadcast_params(ddp) -> None:
    """megatron-core DDP's `broadcast_params`, coalesced: every parameter from the first rank of its data-parallel
    group (the expert-data-parallel group for expert parameters, `allreduce=False`), as one broadcast per group and
    `BUCKET`-byte bucket where megatron-core issues one per parameter (a model of 100 parameters: 100
    collectives at start-up, each a round trip through the group). Every rank issues the same broadcasts in the same
    order: the parameters' order is the module's, the same on every rank of a group."""
    groups = (("dense", ddp.dp_cp_group, False), ("expert", ddp.expt_dp_group, True))
    for name, group, expert in groups:
        params = [p.data for p in ddp.module.parameters() if (not getattr(p, "allreduce", True)) == expert]
        if not params or group_size(group) == 1:
            continue
        record = Collective("other", f"broadcast_params/{name}", group, nbytes=sum(nbytes(p) for p in params))
        issue(record, lambda group=group, params=params: dist._broadcast_coalesced(group, params, BUCKET, 0))


def reduce_lm_loss(total: torch.Tensor, group) -> torch.Tensor:
    """In place: the step's [loss sum, token count] summed over the data-parallel ranks of `group`."""
    record = Collective("other", "reduce_lm_loss", group, nbytes=nbytes(total))
    issue(record, lambda: dist.all_reduce(total, group=group))
    return total


def reduce_mtp_losses(values: torch.Tensor, group) -> torch.Tensor:
    """In place: the step's per-MTP-layer losses summed over the data-parallel ranks of `group` (megatron-core's
    own reduce averages with ReduceOp.AVG, which gloo lacks; the caller divides)."""
    record = Collective("other", "reduce_mtp_losses", group, nbytes=nbytes(values))
    issue(record, lambda: dist.all_reduce(values, group=group))
    return values


def reduce_moe_metrics(table: torch.Tensor, group=None) -> torch.Tensor:
    """In place: a fixed-shape MoE statistics table summed over `group` (None: the world).

    Without torch.distributed (a single process) the table is already complete.
    """
    if is_distributed():
        record = Collective("other", "reduce_moe_metrics", group, nbytes=nbytes(table))
        issue(record, lambda: dist.all_reduce(table, group=group))
    return table


def sum_expert_loads(load_LE: torch.Tensor, group) -> torch.Tensor:
    """In place: the step's tokens per expert of each MoE layer with an expert bias [L, E], summed over `group`
    (megatron-core's TP x CP x DP group), so that every rank of it moves the bias alike (`moe.expert_bias`). One
    rank (or no group): already complete."""
    if group_size(group) > 1:
        record = Collective("other", "sum_expert_loads", group, nbytes=nbytes(load_LE))
        issue(record, lambda: dist.all_reduce(load_LE, group=group))
    return load_LE


def agree_exit(flags: torch.Tensor) -> torch.Tensor:
    """In place: each exit reason's flag, set on every rank when any rank set it (max over the world)."""
    record = Collective("other", "agree_exit", nbytes=nbytes(flags))
    issue(record, lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX))
    return flags


def agree_nonfinite(flags: torch.Tensor) -> torch.Tensor:
    """In place: one slot per rank of the world, each rank having set its own (`training.divergence`); the max
    over the world, so every rank sees which ranks found non-finite values. Without torch.distributed (a single
    process) the table is already agreed."""
    if is_distributed():
        record = Collective("other", "agree_nonfinite", nbytes=nbytes(flags))
        issue(record, lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX))
    return flags


def agree_startup_refusal(refusal: str | None) -> str | None:
    """Rank 0's start-up refusal (None: it goes on), on every rank: a check only rank 0 makes (the `--save`
    lock) ends every rank alike. Without torch.distributed (a single process) it is already agreed."""
    if not is_distributed():
        return refusal
    box = [refusal]
    issue(Collective("other", "agree_startup_refusal"), lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def barrier(purpose: str, group=None) -> None:
    """Every rank of `group` (None: the world) reaches this point; `purpose` names it (`checkpoint_saved`)."""
    issue(Collective("other", f"barrier/{purpose}", group), lambda: dist.barrier(group=group))


def agree_wgrad_profile(table: torch.Tensor, group=None) -> torch.Tensor:
    """In place: a fixed-shape table of profiled dW and all-to-all times
    (`megatron_moe.overlap.wgrad_schedule.agree`), the max over `group` (None: the world), so that every rank makes
    the same schedule.

    Without torch.distributed (a single process) the table is already agreed.
    """
    if is_distributed():
        record = Collective("other", "agree_wgrad_profile", group, nbytes=nbytes(table))
        issue(record, lambda: dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group))
    return table


def agree_predictions(table: torch.Tensor) -> torch.Tensor:
    """In place: each candidate's predicted step (`megatron_moe.overlap.choice`), the max over the world: the
    pipeline runs at its slowest stage's pace, and every rank then makes the same choice. A single process: already
    agreed."""
    if is_distributed():
        record = Collective("other", "agree_predictions", nbytes=nbytes(table))
        issue(record, lambda: dist.all_reduce(table, op=dist.ReduceOp.MAX))
    return table


def count_parameters(counts: torch.Tensor) -> torch.Tensor:
    """In place: each rank's count of the parameters it holds first (`training.summary.parameter_counts`), summed
    over the world."""
    if is_distributed():
        issue(Collective("other", "count_parameters", nbytes=nbytes(counts)), lambda: dist.all_reduce(counts))
    return counts


def agree_save_failure(table: torch.Tensor) -> torch.Tensor:
    """In place: after a checkpoint save failed on every rank at once, [disk full, bytes needed, bytes free] as the
    most any rank found (max over the world), so that every rank reports the same line. A single process: already
    agreed."""
    if is_distributed():
        record = Collective("other", "agree_save_failure", nbytes=nbytes(table))
        issue(record, lambda: dist.all_reduce(table, op=dist.ReduceOp.MAX))
    return table
