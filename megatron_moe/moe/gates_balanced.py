"""Gates that fix every expert's load themselves, so no capacity factor applies.

Legend: T = tokens, H = hidden, E = experts, C = tokens (expert choice) or
slots (soft) per expert, Z = E x C soft slots.

- `ExpertChoiceGate` (Zhou et al.): each expert picks its C = ceil(k T / E)
  highest-scoring tokens; a token may get zero or several experts.
- `SoftMoEGate` (Puigcerver et al.): each slot is a softmax-over-tokens mix
  of all tokens; each token's output a softmax-over-slots mix of the slot
  outputs. It mixes tokens across the sequence, so it is not causal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.config.moe_layer import MoELayerConfig
from megatron_moe.moe.routing import (
    DeferrableRouter,
    Gate,
    Routing,
    expert_choice_slots,
    router_linear,
    router_losses,
)


class ExpertChoiceGate(Gate, DeferrableRouter):
    def __init__(self, cfg: MoELayerConfig):
        super().__init__()
        self.num_experts, self.topk, self.z_coeff = cfg.num_experts, cfg.topk, cfg.z_loss_coeff
        self.weight = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        torch.nn.init.normal_(self.weight, std=cfg.init_method_std)

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        num_tokens = x_TH.shape[0]
        logits_TE = self.router_logits(x_TH)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        slots = expert_choice_slots(num_tokens, self.topk, self.num_experts)
        weight_EC, token_EC = torch.topk(probs_TE.t(), slots, dim=-1)
        # Balanced by construction: no balancing loss, only the optional z-loss.
        aux, parts = router_losses(
            logits_TE,
            probs_TE,
            None,
            kind="none",
            aux_coeff=0.0,
            z_coeff=self.z_coeff,
            valid_T=valid_T,
            group=self.token_group,
        )
        experts = torch.arange(self.num_experts, device=x_TH.device)
        return Routing(
            num_tokens=num_tokens,
            num_experts=self.num_experts,
            probs_TE=probs_TE,
            expert_N=experts.repeat_interleave(slots),
            weight_N=weight_EC.reshape(-1),
            token_N=token_EC.reshape(-1),
            slots_per_expert=slots,
            aux_loss=aux,
            losses=parts,
        )


class SoftMoEGate(Gate):
    def __init__(self, cfg: MoELayerConfig):
        super().__init__()
        self.num_experts, self.slots = cfg.num_experts, cfg.soft_slots
        self.slot_embedding = torch.nn.Parameter(torch.empty(cfg.num_experts * cfg.soft_slots, cfg.hidden_size))
        torch.nn.init.normal_(self.slot_embedding, std=cfg.init_method_std)
        # Both sides are L2-normalised (the paper's stabiliser), so a learned scale sets the sharpness.
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> Routing:
        num_tokens = x_TH.shape[0]
        x_TH = F.normalize(x_TH.float(), dim=-1)
        logits_TZ = self.scale.float() * router_linear(x_TH, F.normalize(self.slot_embedding.float(), dim=-1))
        if valid_T is not None:  # padding never feeds a slot
            logits_TZ = logits_TZ.masked_fill(~valid_T.unsqueeze(1), float("-inf"))
        dispatch_TZ = torch.softmax(logits_TZ, dim=0)
        combine_TZ = torch.softmax(logits_TZ.masked_fill(torch.isinf(logits_TZ), 0.0), dim=1)
        probs_TE = combine_TZ.detach().view(num_tokens, self.num_experts, self.slots).sum(-1)
        return Routing(
            num_tokens=num_tokens,
            num_experts=self.num_experts,
            probs_TE=probs_TE,
            slots_per_expert=self.slots,
            dispatch_TZ=dispatch_TZ,
            combine_TZ=combine_TZ,
        )
