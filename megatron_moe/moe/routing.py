"""What a gate returns (`Routing`), the gate interface, and the router losses.

Legend: T = tokens of this rank, H = hidden, E = experts (global), K = top-k,
N = routed (token, expert) pairs, Z = soft slots (E x slots per expert).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math

import torch

from megatron_moe import comm
from megatron_moe.moe.deferred_linear import store_linear
from megatron_moe.moe.weight_grad import RUN_NOW, DeferrableWeights, WeightGradStore


@dataclasses.dataclass
class Routing:
    """A gate's decision for the T tokens of this rank.

    Token- and expert-choice gates give (token, expert, weight) pairs. Pairs of
    token-choice gates are k-major (pair n = k * T + t, so `token_N` is None);
    `claim_N` lists the pairs in the order in which they claim capacity slots
    (None: pair order, i.e. every first choice before any second choice, as GShard).
    The soft gate gives dense dispatch and combine weights over slots instead.
    """

    num_tokens: int
    num_experts: int
    probs_TE: torch.Tensor
    """fp32 router distribution per token (sums to 1), for statistics; may carry grad."""
    expert_N: torch.Tensor | None = None
    weight_N: torch.Tensor | None = None
    """fp32 combine weight of each pair (differentiable)."""
    token_N: torch.Tensor | None = None
    """Source token of each pair; None for k-major token-choice pairs."""
    claim_N: torch.Tensor | None = None
    slots_per_expert: int | None = None
    """Expert-choice and soft gates fix every expert's load to exactly this many slots."""
    dispatch_TZ: torch.Tensor | None = None
    combine_TZ: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    """Weighted sum of the router losses (scalar with grad), attached to backward by the layer."""
    logits_TE: torch.Tensor | None = None
    """The router's logits, kept while the losses wait for the micro-batch's other pieces (`Gate.losses_later`)."""
    losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Unweighted losses, detached, for the log (`load_balancing`, `z_loss`)."""

    @property
    def is_soft(self) -> bool:
        return self.dispatch_TZ is not None

    def token_of(self, pairs: torch.Tensor) -> torch.Tensor:
        """Source token of the given pair indices."""
        if self.token_N is None:
            return torch.remainder(pairs, self.num_tokens)
        return self.token_N.index_select(0, pairs)


class Gate(torch.nn.Module, abc.ABC):
    """A routing function: tokens [T, H] -> Routing. Router math runs in fp32."""

    token_group = None
    """Ranks holding other shards of the same sequences (TP under sequence parallelism), for the losses."""
    global_group = None
    """Ranks whose micro-batches make the global batch (megatron-core's TP x DP x CP group), for global_aux_loss."""

    routes_pieces = False
    """True when a piece of a micro-batch routes exactly as in the whole micro-batch (each token alone: no capacity,
    no noise) and `batch_routing` is there: Lancet's operator partition may split the micro-batch."""
    _losses_later = False

    @abc.abstractmethod
    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        """`valid_T` (bool, optional) marks tokens that count in losses and statistics."""

    @contextlib.contextmanager
    def losses_later(self, later: bool = True):
        """While on, the gate routes one piece of a partitioned micro-batch: no router losses (`batch_routing` makes
        the micro-batch's from every piece's routing)."""
        if later and not self.routes_pieces:
            raise TypeError(f"{type(self).__name__} cannot route a piece of a micro-batch (routes_pieces is False)")
        previous, self._losses_later = self._losses_later, later
        try:
            yield
        finally:
            self._losses_later = previous

    def record_load(self, routing: Routing, valid_T: torch.Tensor | None) -> None:
        """Count a training micro-batch's routed pairs for the expert bias (`megatron_moe.moe.expert_bias`); a gate
        without one counts nothing."""

    def batch_routing(self, pieces: list[tuple[Routing, torch.Tensor | None, torch.Size]]) -> Routing:
        """The micro-batch's routing figures (token count, probabilities, router losses) from its pieces' routings
        made under `losses_later`: [(routing, valid_T, the piece's [S, B_i, H] shape)] in piece order."""
        raise NotImplementedError(f"{type(self).__name__} does not route pieces")


def router_linear(x_TH: torch.Tensor, weight_EH: torch.Tensor, store: WeightGradStore = RUN_NOW) -> torch.Tensor:
    """fp32 logits whatever the parameter and activation dtypes: `F.linear(x.float(), w.float())`.

    A `store` that defers gets the weight-gradient GEMM (same arithmetic, `megatron_moe.moe.deferred_linear`)."""
    return store_linear(x_TH.float(), weight_EH, store, cast_weight=True)


class RandomLogits(torch.autograd.Function):
    """megatron-core's RandomSTE (--moe-router-force-load-balancing, for benchmarks): the logits replaced by
    N(0, 1) draws (on a GPU from the expert-parallel RNG stream, so each EP rank draws its own), the gradient
    passed straight through to the router."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        if logits.is_cuda:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                return logits.clone().normal_()
        return logits.clone().normal_()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


class ForcedBias:
    """Megatron-LM's --moe-router-force-biased STD (benchmarks only; megatron-core's RandomSTEShared, after
    0.16.1): a bias per expert drawn N(0, |STD|) and added to the random logits, the same on every rank, so the
    load is skewed as a real router's can be. STD > 0: a new bias each forward, from megatron-core's
    data-parallel RNG stream (seeded alike on every rank, replayed by a recompute like dropout's, saved with the
    checkpoint's RNG state). STD < 0: one bias per layer for the whole run, keyed by (--seed, layer) alone (the
    same after a resume; megatron-core draws it once from the stream and does not keep it across one)."""

    def __init__(self, std: float, num_experts: int, key: tuple[int, ...] = (0, 0)):
        self.std, self.num_experts, self.key = std, num_experts, key
        self._kept_E: torch.Tensor | None = None

    def bias_E(self, like: torch.Tensor) -> torch.Tensor:
        from megatron_moe.platform.rng import data_parallel_stream, host_rng_keyed, rng_tracker

        if self.std < 0:
            if self._kept_E is None or self._kept_E.device != like.device:
                with host_rng_keyed(*self.key):
                    self._kept_E = torch.randn(self.num_experts).mul_(-self.std).to(like.device, like.dtype)
            return self._kept_E
        tracker, name = rng_tracker(), data_parallel_stream()
        if name not in tracker.get_states():  # a layer used outside training (no streams seeded): the device's own
            return like.new_empty(self.num_experts).normal_(std=self.std)
        with tracker.fork(name):
            return like.new_empty(self.num_experts).normal_(std=self.std)


class DeferrableRouter(DeferrableWeights):
    """A gate whose router projection `self.weight` [E, H] may have its weight gradient deferred.

    Other gate parameters (noise weight, scales) keep autograd's gradient."""

    weight: torch.nn.Parameter

    def deferred_params(self) -> list[torch.nn.Parameter]:
        return [self.weight]

    force_load_balancing = False
    """--moe-router-force-load-balancing: random logits (`RandomLogits`), loads balanced in expectation."""
    forced_bias: ForcedBias | None = None
    """--moe-router-force-biased: random logits plus a random bias per expert shared by the ranks: loads skewed."""

    def router_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, E] of `self.weight` (random ones, the gradient straight through, when forcing balance;
        plus a bias shared by every rank when forcing a skew)."""
        logits_TE = router_linear(x_TH, self.weight, self.weight_grad_store)
        if self.force_load_balancing or self.forced_bias is not None:
            logits_TE = RandomLogits.apply(logits_TE)
        if self.forced_bias is not None:
            logits_TE = logits_TE + self.forced_bias.bias_E(logits_TE)  # a constant: the gradient passes as is
        return logits_TE


def _masked_mean(values_T: torch.Tensor, valid_T: torch.Tensor | None, group=None) -> torch.Tensor:
    """Mean over the (valid) tokens of every rank of `group` that holds a shard of these sequences."""
    if valid_T is None:
        total, count = values_T.sum(dim=0), values_T.new_full((), float(values_T.shape[0]))  # no host copy
    else:
        weights = valid_T.to(values_T.dtype).view(-1, *([1] * (values_T.dim() - 1)))
        total, count = (values_T * weights).sum(dim=0), weights.sum()
    if comm.group_size(group) > 1:
        total = comm.sum_across_shards(total, group)
        count = comm.sum_across_shards(count.detach(), group)
    return total / count.clamp(min=1)


def load_balancing_loss(
    probs_TE: torch.Tensor, expert_TK: torch.Tensor, kind: str, valid_T: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """Switch/GShard balancing loss E * sum_e f_e * P_e (1.0 when perfectly balanced).

    f_e: fraction of routed choices on expert e (`kind` aux_loss: all k choices,
    as Switch and Megatron; top1_aux_loss: the first choice, as GShard); P_e:
    mean router probability of e. Only P carries grad.
    """
    num_experts = probs_TE.shape[1]
    chosen = expert_TK[:, :1] if kind == "top1_aux_loss" else expert_TK
    one_hot_TE = torch.zeros_like(probs_TE).scatter_add_(
        1, chosen, torch.ones(chosen.shape, dtype=probs_TE.dtype, device=chosen.device)
    )
    fraction_E = _masked_mean(one_hot_TE, valid_T, group) / chosen.shape[1]
    return num_experts * torch.sum(fraction_E.detach() * _masked_mean(probs_TE, valid_T, group))


def seq_load_balancing_loss(
    probs_TE: torch.Tensor, expert_TK: torch.Tensor, batch: int, valid_T: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """DeepSeek-V2/V3's sequence-level balancing loss, as megatron-core's seq_aux_loss: the aux_loss of each
    sequence alone (tokens t = s * batch + b, the [S, B] layout flattened), averaged over the `batch` sequences.
    Padding counts as megatron-core counts it: one token count, the valid tokens over `batch`.
    """
    num_experts = probs_TE.shape[1]
    one_hot_TE, probs_TE = _routed_of_valid(probs_TE, expert_TK, valid_T)
    if valid_T is None:
        count = probs_TE.new_full((), probs_TE.shape[0] / batch)
    else:
        count = valid_T.to(probs_TE.dtype).sum() / batch
    tokens_X, probs_X = one_hot_TE.view(-1, batch * num_experts).sum(0), probs_TE.view(-1, batch * num_experts).sum(0)
    if comm.group_size(group) > 1:
        tokens_X = comm.sum_across_shards(tokens_X, group)
        probs_X = comm.sum_across_shards(probs_X, group)
        count = comm.sum_across_shards(count.detach(), group)
    count = count.clamp(min=1)
    per_pair = tokens_X.detach() / (count * expert_TK.shape[1]) * probs_X / count
    return num_experts * per_pair.sum() / batch


def global_load_balancing_loss(
    probs_TE: torch.Tensor,
    expert_TK: torch.Tensor,
    tally: tuple[torch.Tensor, torch.Tensor],
    valid_T: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """megatron-core's global_aux_loss (arXiv 2501.11873): aux_loss with f_e over the global batch so far.

    1. this micro-batch's routed choices per expert (valid tokens), summed over `group` (megatron-core's TP x DP x
       CP group: every rank of the pipeline stage, each issuing it in the same forward);
    2. added in place to `tally` = (running sum [E], micro-batches []), which is zeroed after each step; f_e is the
       running sum's mean over the micro-batches so far, over k x the group's tokens of this micro-batch;
    3. P_e: this rank's (valid) tokens' probability sum over the group's tokens, so each rank's loss is its share
       of the global one: megatron-core's value and gradient (`switch_load_balancing_loss_func`).
    """
    num_tokens, num_experts = probs_TE.shape
    topk = expert_TK.shape[1]
    one_hot_TE, probs_TE = _routed_of_valid(probs_TE, expert_TK, valid_T)
    counts_E = comm.sum_global_batch_counts(one_hot_TE.sum(dim=0), group)  # 1.
    running_E, steps = tally
    running_E.add_(counts_E)  # 2.
    steps.add_(1)
    total = num_tokens * comm.group_size(group) if valid_T is None else counts_E.sum() / topk
    return torch.sum(probs_TE.sum(dim=0) * (running_E / steps)) * (num_experts / (topk * total * total))  # 3.


def z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """ST-MoE router z-loss: mean of logsumexp(logits)^2."""
    return _masked_mean(torch.logsumexp(logits_TE, dim=-1).square(), valid_T, group)


def entropy_sum(probs_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over (valid) tokens of the router distribution's entropy, in nats (detached)."""
    p = probs_TE.detach()
    ent_T = -(p * torch.log(p.clamp(min=1e-20))).sum(dim=-1)
    if valid_T is not None:
        ent_T = ent_T * valid_T
    return ent_T.sum()


def router_losses(
    logits_TE,
    probs_TE,
    expert_TK,
    *,
    kind: str,
    aux_coeff: float,
    z_coeff: float,
    valid_T=None,
    group=None,
    batch=1,
    tally=None,
    global_group=None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(weighted total with grad or None, unweighted detached parts).

    `group`: the ranks whose tokens are shards of the same sequences (TP under
    sequence parallelism); the losses are over all of their tokens, as on one rank. `batch`: the sequences in
    the [S, B] layout the tokens flatten (seq_aux_loss's per-sequence loss). `tally`, `global_group`:
    global_aux_loss's running counts (added to) and the ranks whose micro-batches make the global batch.
    """
    total, parts = None, {}
    if kind != "none" and expert_TK is not None:
        if kind == "seq_aux_loss":
            lb = seq_load_balancing_loss(probs_TE, expert_TK, batch, valid_T, group)
        elif kind == "global_aux_loss":
            lb = global_load_balancing_loss(probs_TE, expert_TK, tally, valid_T, global_group)
        else:
            lb = load_balancing_loss(probs_TE, expert_TK, kind, valid_T, group)
        parts["load_balancing"] = lb.detach()
        if kind == "global_aux_loss":  # a rank's share: the log's mean over the stage's ranks is then their sum,
            parts["load_balancing"] = parts["load_balancing"] * comm.group_size(global_group)  # megatron-core's
        if aux_coeff > 0:
            total = aux_coeff * lb
    if z_coeff > 0:
        z = z_loss(logits_TE, valid_T, group)
        parts["z_loss"] = z.detach()
        total = z_coeff * z if total is None else total + z_coeff * z
    return total, parts


def expert_choice_slots(num_tokens: int, topk: int, num_experts: int) -> int:
    """Tokens each expert picks so that on average a token gets `topk` experts."""
    return max(1, min(num_tokens, math.ceil(topk * num_tokens / num_experts)))


def _routed_of_valid(
    probs_TE: torch.Tensor, expert_TK: torch.Tensor, valid_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's routed choices as a [T, E] count, its probabilities), both zero on tokens not `valid_T`."""
    one_hot_TE = torch.zeros_like(probs_TE).scatter_add_(
        1, expert_TK, torch.ones(expert_TK.shape, dtype=probs_TE.dtype, device=expert_TK.device)
    )
    if valid_T is None:
        return one_hot_TE, probs_TE
    mask_T1 = valid_T.to(probs_TE.dtype).unsqueeze(1)
    return one_hot_TE * mask_T1, probs_TE * mask_T1
