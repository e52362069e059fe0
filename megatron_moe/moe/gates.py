"""The gates, and `build_gate(cfg)`: the gate `--moe-gate` names, from `GATE_BUILDERS`.

Legend: T = tokens, H = hidden, E = experts, K = top-k, D = router projection width.
In: tokens x_TH [T, H] (and which are valid); out: a `Routing` (pairs or soft weights, router losses).
- `SoftmaxTopKGate`: GShard top-k softmax; noisy (trainable noise), Switch (k = 1, not renormalised),
  Batch-Prioritized Routing and Random Token Selection are its variants.
- `SigmoidGate`: a sigmoid score per expert; with an expert bias, DeepSeek-V3's aux-loss-free balancing.
- `CosineGate`: X-MoE's and Tutel's cosine routers (they differ in width and initial scale).
- expert_choice and soft: gates_balanced.py.
Invariant: over capacity a token-choice gate drops in its claim order (k-major, or --moe-token-drop-policy).
Adding a gate: its class here, its `GATE_BUILDERS` entry, its row in config/gate_traits.py (what it is).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_moe.config.moe_layer import MoELayerConfig
from megatron_moe.moe.expert_bias import group_limited_topk, update_expert_biases
from megatron_moe.moe.gates_balanced import ExpertChoiceGate, SoftMoEGate
from megatron_moe.moe.pieces import batch_order
from megatron_moe.moe.routing import DeferrableRouter, ForcedBias, Gate, Routing, router_linear, router_losses

PRIORITIES = ("token", "importance", "random", "probs", "position")


class _TopKGateBase(Gate):
    """Shared tail of the token-choice gates: top-k, renormalise, claim order, losses."""

    def __init__(self, cfg: MoELayerConfig, *, normalize: bool, priority: str | None = None):
        super().__init__()
        priority = priority or cfg.drop_policy or "token"
        assert priority in PRIORITIES, priority
        self.num_experts, self.topk = cfg.num_experts, cfg.topk
        self.normalize = normalize and cfg.topk > 1
        self.scaling = cfg.topk_scaling_factor
        self.priority = priority
        self.load_balancing, self.aux_coeff, self.z_coeff = cfg.load_balancing, cfg.aux_loss_coeff, cfg.z_loss_coeff
        if self.load_balancing == "sinkhorn":  # a way of choosing experts (the sinkhorn gate), not a loss
            self.load_balancing = "none"
        self.capacity_factor = cfg.capacity_factor
        self.force_load_balancing = cfg.force_load_balancing  # DeferrableRouter gates: random logits
        if cfg.force_biased is not None:  # DeferrableRouter gates: random logits and a shared bias
            self.forced_bias = ForcedBias(cfg.force_biased, cfg.num_experts, (cfg.init_seed, 0))
        self.seq_batch = 1  # sequences B in the [S, B] micro-batch the tokens flatten; the layer sets it
        self.num_groups, self.group_topk = cfg.num_groups, cfg.group_topk
        self.bias_update_rate = cfg.bias_update_rate
        # Aux-loss-free balancing (`megatron_moe.moe.expert_bias`): the bias is state (checkpointed, replicated);
        # the load is this step's and is not.
        zeros_E = torch.zeros(cfg.num_experts, dtype=torch.float32) if cfg.expert_bias else None
        self.register_buffer("expert_bias", zeros_E)
        self.register_buffer("local_tokens_per_expert", None if zeros_E is None else zeros_E.clone(), persistent=False)
        # global_aux_loss (with a weight only: megatron-core counts nothing at coefficient 0): the step's routed
        # choices per expert over the TP x DP x CP ranks so far, and its micro-batches; zeroed after each step, not
        # checkpointed.
        tally = cfg.load_balancing == "global_aux_loss" and cfg.aux_loss_coeff > 0
        counts_E = torch.zeros(cfg.num_experts) if tally else None
        self.register_buffer("global_tokens_per_expert", counts_E, persistent=False)
        self.register_buffer("ga_steps", torch.zeros(()) if tally else None, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        """The bias, loads and counts stay fp32 whatever the model's dtype (`.to(bf16)`, Float16Module), as
        megatron-core."""
        super()._apply(fn, *args, **kwargs)
        for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
            if self._buffers.get(name) is not None:
                self._buffers[name] = self._buffers[name].float()
        return self

    def _choose(self, scores_TE, select_TE) -> tuple[torch.Tensor, torch.Tensor]:
        """(combine weights [T, K], experts [T, K]): the top-k of `select_TE` (+ the expert bias; within the best
        groups when group-limited), weighted by `scores_TE` at those experts, as megatron-core's
        `topk_routing_with_score_function`."""
        if self.expert_bias is None and self.group_topk is None and select_TE is scores_TE:
            return torch.topk(scores_TE, self.topk, dim=-1)
        if self.expert_bias is not None:
            select_TE = select_TE + self.expert_bias
        if self.group_topk is None:
            expert_TK = torch.topk(select_TE, self.topk, dim=-1)[1]
        else:
            expert_TK = group_limited_topk(select_TE, self.topk, self.num_groups, self.group_topk)
        return torch.gather(scores_TE, 1, expert_TK), expert_TK

    @torch.no_grad()
    def record_load(self, routing: Routing, valid_T: torch.Tensor | None) -> None:
        """A training micro-batch's (or piece's) pairs per expert, valid tokens only, added to the step's load."""
        if self.local_tokens_per_expert is None:
            return
        expert_N = routing.expert_N  # k-major: pair n is token n % T
        valid_N = torch.ones(expert_N.shape, device=expert_N.device) if valid_T is None else valid_T.repeat(self.topk)
        self.local_tokens_per_expert.scatter_add_(0, expert_N, valid_N.float())

    def _route(self, logits_TE, scores_TE, probs_TE, valid_T, select_TE=None) -> Routing:
        """`scores` are the combine weights; `select` (default `scores`) picks the experts; `probs` (sums to 1)
        feed the losses."""
        num_tokens = logits_TE.shape[0]
        weight_TK, expert_TK = self._choose(scores_TE, scores_TE if select_TE is None else select_TE)
        if self.normalize:
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        if self.scaling is not None:
            weight_TK = weight_TK * self.scaling
        aux, parts = (None, {}) if self._losses_later else self._losses(logits_TE, probs_TE, expert_TK, valid_T)
        return Routing(
            num_tokens=num_tokens,
            num_experts=self.num_experts,
            probs_TE=probs_TE,
            expert_N=expert_TK.t().reshape(-1),  # k-major: all first choices, then all second ...
            weight_N=weight_TK.t().reshape(-1),
            claim_N=self._claim_order(scores_TE, weight_TK),
            aux_loss=aux,
            losses=parts,
            logits_TE=logits_TE if self._losses_later else None,
        )

    def reset_global_tally(self) -> None:
        """A new step: global_aux_loss's f_e starts afresh (megatron-core's `reset_global_aux_loss_tracker`)."""
        if self.ga_steps is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def _losses(self, logits_TE, probs_TE, expert_TK, valid_T):
        """The router losses; the balancing loss counts `probs`' own top-k where the expert bias or the groups
        pick other experts than it (megatron-core's `compute_routing_scores_for_aux_loss`). global_aux_loss only in
        a training forward with grad and a coefficient, as megatron-core: evaluation, the no-grad first pass of a
        recomputed layer and a recomputed router region neither count nor communicate."""
        if self.expert_bias is not None or self.group_topk is not None:
            expert_TK = torch.topk(probs_TE.detach(), self.topk, dim=-1)[1]
        kind = self.load_balancing
        if kind == "global_aux_loss" and not (self.ga_steps is not None and self.training and torch.is_grad_enabled()):
            kind = "none"
        return router_losses(
            logits_TE,
            probs_TE,
            expert_TK,
            kind=kind,
            aux_coeff=self.aux_coeff,
            z_coeff=self.z_coeff,
            valid_T=valid_T,
            group=self.token_group,
            batch=self.seq_batch,
            tally=(self.global_tokens_per_expert, self.ga_steps),
            global_group=self.global_group,
        )

    @property
    def routes_pieces(self) -> bool:
        """Without a capacity each token's experts are its own top-k (the claim order drops nothing); noise draws
        differ with the batch's shape."""
        return not self.capacity_factor and getattr(self, "noise_weight", None) is None

    def batch_routing(self, pieces):
        shapes = [shape for *_, shape in pieces]
        routings = [routing for routing, *_ in pieces]

        def batch(tensors):
            return batch_order(tensors, shapes)

        logits_TE, probs_TE = batch([r.logits_TE for r in routings]), batch([r.probs_TE for r in routings])
        expert_TK = batch([r.expert_N.view(self.topk, -1).t() for r in routings])
        valid_T = batch([valid_T for _, valid_T, _ in pieces])
        if len(shapes[0]) == 3:
            self.seq_batch = sum(shape[1] for shape in shapes)  # the micro-batch's sequences, batched back
        aux, parts = self._losses(logits_TE, probs_TE, expert_TK, valid_T)
        num_tokens = sum(r.num_tokens for r in routings)
        return Routing(
            num_tokens=num_tokens, num_experts=self.num_experts, probs_TE=probs_TE, aux_loss=aux, losses=parts
        )

    def _claim_order(self, scores_TE, weight_TK) -> torch.Tensor | None:
        """Pairs in the order they take capacity slots; None = k-major token order."""
        if self.priority == "token":
            return None
        num_tokens = scores_TE.shape[0]
        k_offsets = torch.arange(self.topk, device=weight_TK.device).unsqueeze(1) * num_tokens
        if self.priority == "position":  # token-major: (t0,k0), (t0,k1), (t1,k0) ...
            return (k_offsets + torch.arange(num_tokens, device=weight_TK.device).unsqueeze(0)).t().reshape(-1)
        if self.priority == "probs":  # every pair by its combine weight, highest first
            return torch.argsort(weight_TK.detach().t().reshape(-1), descending=True, stable=True)
        if self.priority == "importance" or not self.training:
            # BPR: a token's importance is its top score; most important first.
            order_T = torch.argsort(weight_TK[:, 0].detach(), descending=True, stable=True)
        else:
            order_T = torch.randperm(num_tokens, device=scores_TE.device)
        return (k_offsets + order_T.unsqueeze(0)).reshape(-1)


class SoftmaxTopKGate(_TopKGateBase, DeferrableRouter):
    """softmax(x W) -> top-k (GShard / Switch / BPR / RTS), optionally with trainable noise."""

    def __init__(self, cfg: MoELayerConfig, *, noisy: bool = False, priority: str | None = None, normalize=None):
        super().__init__(cfg, normalize=cfg.normalize_topk if normalize is None else normalize, priority=priority)
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        torch.nn.init.normal_(self.weight, std=cfg.init_method_std)
        self.noise_weight = None
        if noisy:
            # Shazeer et al.: noise std = softplus(x W_noise), learned; starts at softplus(0).
            self.noise_weight = torch.nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        logits_TE = self.router_logits(x_TH)
        if self.noise_weight is not None and self.training:
            noise_std_TE = F.softplus(router_linear(x_TH, self.noise_weight))
            logits_TE = logits_TE + torch.randn_like(logits_TE) * noise_std_TE
        probs_TE = torch.softmax(logits_TE, dim=-1)
        # megatron-core picks groups by the logits unless the weights are the softmax over all experts (pre-softmax)
        select_TE = logits_TE if self.normalize and self.group_topk is not None else None
        return self._route(logits_TE, probs_TE, probs_TE, valid_T, select_TE)


class SigmoidGate(_TopKGateBase, DeferrableRouter):
    """sigmoid(x W) per expert; top-k by score; balancing on the scores normalised per token."""

    def __init__(self, cfg: MoELayerConfig):
        super().__init__(cfg, normalize=cfg.normalize_topk)
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        torch.nn.init.normal_(self.weight, std=cfg.init_method_std)

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        logits_TE = self.router_logits(x_TH)
        scores_TE = torch.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        return self._route(logits_TE, scores_TE, probs_TE, valid_T)


class SinkhornGate(_TopKGateBase, DeferrableRouter):
    """megatron-core's sinkhorn routing: in training the top-k of the Sinkhorn-balanced exp(logits) (no gradient)
    picks the experts; the weights are sigmoid(logits) for k = 1, else softmax(logits), at those experts, not
    renormalised; no balancing loss (the choice balances). In evaluation the top-k of the weights picks."""

    def __init__(self, cfg: MoELayerConfig):
        super().__init__(cfg, normalize=False)
        self.load_balancing = "none"  # megatron-core asserts no aux loss with sinkhorn; the z-loss stays
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        torch.nn.init.normal_(self.weight, std=cfg.init_method_std)

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        logits_TE = self.router_logits(x_TH)
        scores_TE = torch.sigmoid(logits_TE) if self.topk == 1 else torch.softmax(logits_TE, dim=-1)
        select_TE = sinkhorn(logits_TE.detach().float()) if self.training else scores_TE
        return self._route(logits_TE, scores_TE, torch.softmax(logits_TE, dim=-1), valid_T, select_TE)


@torch.no_grad()
def sinkhorn(cost_TE: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """megatron-core's `moe_utils.sinkhorn`, as written: rescale exp(cost) by row and column factors until the
    column factors move less than `tol` on average (a host read per round, as there)."""
    cost_TE = torch.exp(cost_TE)
    d0_T = torch.ones(cost_TE.size(0), device=cost_TE.device, dtype=cost_TE.dtype)
    d1_E = torch.ones(cost_TE.size(1), device=cost_TE.device, dtype=cost_TE.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1_E
    while error > tol:
        d0_T = (1 / d0_T.size(0)) * 1 / (torch.sum(d1_E * cost_TE, 1) + eps)
        d1_E = (1 / d1_E.size(0)) * 1 / (torch.sum(d0_T.unsqueeze(1) * cost_TE, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1_E))
        d1_old = d1_E
    return d1_E * cost_TE * d0_T.unsqueeze(1)


class CosineGate(_TopKGateBase):
    """softmax(scale * cos(P x, e_j)) with P a D x H projection and e_j learned expert embeddings.

    The log of the scale is learned and clamped at log(100) as in Tutel, so a
    growing temperature cannot blow up the logits.
    """

    MAX_LOG_SCALE = math.log(100.0)

    def __init__(self, cfg: MoELayerConfig, *, dim: int, init_scale: float):
        super().__init__(cfg, normalize=cfg.normalize_topk)
        self.proj_weight = torch.nn.Parameter(torch.empty(dim, cfg.hidden_size))
        self.expert_embedding = torch.nn.Parameter(torch.empty(cfg.num_experts, dim))
        torch.nn.init.normal_(self.proj_weight, std=cfg.init_method_std)
        torch.nn.init.normal_(self.expert_embedding, std=cfg.init_method_std)
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(init_scale)))

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        proj_TD = F.normalize(router_linear(x_TH, self.proj_weight), dim=-1)
        experts_ED = F.normalize(self.expert_embedding.float(), dim=-1)
        scale = torch.exp(torch.clamp(self.log_scale.float(), max=self.MAX_LOG_SCALE))
        logits_TE = scale * (proj_TD @ experts_ED.t())
        probs_TE = torch.softmax(logits_TE, dim=-1)
        return self._route(logits_TE, probs_TE, probs_TE, valid_T)


GATE_BUILDERS: dict[str, Callable[[MoELayerConfig], Gate]] = {
    "topk": SoftmaxTopKGate,
    "noisy_topk": lambda cfg: SoftmaxTopKGate(cfg, noisy=True),
    "switch": lambda cfg: SoftmaxTopKGate(cfg, normalize=False),
    "bpr": lambda cfg: SoftmaxTopKGate(cfg, priority="importance"),
    "rts": lambda cfg: SoftmaxTopKGate(cfg, priority="random"),
    "sigmoid": SigmoidGate,
    "sinkhorn": SinkhornGate,
    # X-MoE: 16-wide projection, temperature 0.07 (scale 1/0.07); Tutel: 256 wide, scale 1/0.01.
    "xmoe": lambda cfg: CosineGate(cfg, dim=cfg.router_dim or 16, init_scale=1 / 0.07),
    "cosine": lambda cfg: CosineGate(cfg, dim=cfg.router_dim or 256, init_scale=1 / 0.01),
    "expert_choice": ExpertChoiceGate,
    "soft": SoftMoEGate,
}
"""Gate name -> its constructor from the layer config; a key of config/gate_traits.py's `GATE_TRAITS` each."""


def build_gate(cfg: MoELayerConfig) -> Gate:
    """The gate `--moe-gate` names."""
    return GATE_BUILDERS[cfg.gate](cfg)


@torch.no_grad()
def finish_router_step(model_chunks) -> None:
    """After a training step's backward, where megatron-core's `finalize_model_grads` does the same for its router:
    every expert bias moved toward its layer's mean load (`update_expert_biases`: one collective where a gate has
    one), every global_aux_loss tally zeroed (no collective)."""
    update_expert_biases(model_chunks)
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, _TopKGateBase):
                module.reset_global_tally()


__all__ = [
    "GATE_BUILDERS",
    "CosineGate",
    "SigmoidGate",
    "SinkhornGate",
    "SoftmaxTopKGate",
    "build_gate",
    "finish_router_step",
]
