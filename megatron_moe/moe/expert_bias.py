"""Aux-loss-free balancing and group-limited routing, as megatron-core 0.16.1 has them.

Legend: T = tokens, E = experts, K = top-k, G = expert groups, L = MoE layers (with an expert bias) of this rank.

- Aux-loss-free balancing (DeepSeek-V3, arXiv 2408.15664): each MoE layer keeps an fp32 bias per expert, added
  to the sigmoid scores only to choose the top-k; the combine weights are the unbiased scores. A training
  micro-batch adds its pairs per expert (valid tokens only) to the layer's load; after the step the loads of
  every layer are summed over the TP x CP x DP ranks in one collective and each bias moves by
  rate * sign(mean load - load) (megatron-core's `get_updated_expert_bias`, from its `finalize_model_grads`).
  Every rank of that group sums the same loads and so holds the same bias; it is checkpointed, replicated.
- Group-limited routing (DeepSeek-V2/V3 device- or node-limited): the E experts in G equal groups; a token
  keeps its best `group_topk` groups by the sum of each group's top K / group_topk scores, then its top-K
  experts among theirs (megatron-core's `group_limited_topk`).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_moe import comm


def group_limited_topk(select_TE: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """Experts [T, K] of each token's top-`topk` among its best `group_topk` of `num_groups` groups."""
    num_tokens, num_experts = select_TE.shape
    group_TG = select_TE.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_TG, k=group_topk, dim=-1, sorted=False)[1]
    kept_TG = torch.zeros_like(group_TG).scatter_(1, best_groups, 1)
    kept_TE = kept_TG.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
    return torch.topk(select_TE.masked_fill(~kept_TE.bool(), float("-inf")), k=topk, dim=-1)[1]


def biased_gates(model_chunks) -> list[torch.nn.Module]:
    """The gates with an expert bias, in module order over the chunks (the same order on every rank of a stage)."""
    return [m for chunk in model_chunks for m in chunk.modules() if getattr(m, "expert_bias", None) is not None]


def updated_bias(load_LE: torch.Tensor, bias_LE: torch.Tensor, rate: float) -> torch.Tensor:
    """bias + rate * sign(mean load - load), per layer (the loads already summed over the group)."""
    offset_LE = load_LE.sum(dim=-1, keepdim=True) / load_LE.shape[-1] - load_LE
    return bias_LE + torch.sign(offset_LE) * rate


@torch.no_grad()
def update_expert_biases(model_chunks, group=None) -> int:
    """After a training step: every biased gate's bias moved toward its layer's mean load, the loads reset.

    1. the loads of every biased layer of this rank, stacked [L, E];
    2. ONE sum over `group` (default: megatron-core's TP x CP x DP group), the same on every rank of it;
    3. each bias updated from the summed loads, each load zeroed.
    Returns L (0: nothing to do, no collective: a stage without such layers, as megatron-core)."""
    gates = biased_gates(model_chunks)
    if not gates:
        return 0
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    load_LE = comm.sum_expert_loads(torch.stack([g.local_tokens_per_expert for g in gates]), group)  # 1., 2.
    bias_LE = updated_bias(load_LE, torch.stack([g.expert_bias for g in gates]), gates[0].bias_update_rate)
    for gate, bias_E in zip(gates, bias_LE):  # 3.
        gate.expert_bias.copy_(bias_E)
        gate.local_tokens_per_expert.zero_()
    return len(gates)
