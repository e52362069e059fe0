"""What each gate is, as one table: `GATE_TRAITS[name]` is a `GateTraits` row.

Read by the flag conditions (which flags a gate makes meaningful), the rules and `MoELayerConfig.validate`
(what a gate refuses), and `megatron_moe.moe.gates` (which class builds it). Adding a gate: its class in
moe/gates.py (registered in `GATE_BUILDERS`) and its row here; nothing else names gates.
Invariant: `GATES` is this table's keys, in order; every derived tuple below is computed from it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateTraits:
    balanced: bool = False
    """Fixes every expert's load itself: no balancing loss, no capacity factor, no shadow experts."""
    own_order: bool = False
    """Its claim order over capacity is its definition (or it drops nothing): no --moe-token-drop-policy."""
    token_picking: bool = True
    """Picks --moe-router-topk experts per token (soft mixes slots instead)."""
    router_logits: bool = True
    """Has router logits, so the z-loss applies."""
    normalizes: bool = True
    """Renormalises the k chosen scores with k > 1 (--moe-normalize-topk)."""
    single_expert: bool = False
    """Routes each token to exactly one expert (--moe-router-topk 1)."""
    group_limited: bool = False
    """Takes group-limited routing (--moe-router-num-groups / --moe-router-group-topk)."""
    projecting: bool = False
    """Projects tokens to --moe-router-dim before scoring."""
    slots: bool = False
    """Routes into --moe-soft-slots slots per expert."""
    tokens_alone: bool = True
    """Routes a token without looking at the rest of its batch (a micro-batch can be cut into pieces)."""


_BALANCED = GateTraits(balanced=True, own_order=True, normalizes=False, tokens_alone=False)
GATE_TRAITS: dict[str, GateTraits] = {
    "topk": GateTraits(group_limited=True),
    "noisy_topk": GateTraits(tokens_alone=False),
    "switch": GateTraits(normalizes=False, single_expert=True),
    "sigmoid": GateTraits(group_limited=True),
    "xmoe": GateTraits(projecting=True),
    "cosine": GateTraits(projecting=True),
    "expert_choice": _BALANCED,
    "soft": dataclasses.replace(_BALANCED, token_picking=False, router_logits=False, slots=True),
    "bpr": GateTraits(own_order=True),
    "rts": GateTraits(own_order=True),
    "sinkhorn": GateTraits(normalizes=False, tokens_alone=False),
}
"""One row per gate: topk (GShard softmax), noisy_topk (trainable noise), switch (top-1), sigmoid, xmoe (low-rank
cosine, learnable temperature), cosine (Tutel), expert_choice, soft (SoftMoE slots), bpr (batch-prioritized),
rts (random token selection), sinkhorn (megatron-core's: top-k of the Sinkhorn-balanced scores in training)."""


def gates_where(trait: str, value: bool = True) -> tuple[str, ...]:
    """The gates whose `trait` is `value`, in table order."""
    return tuple(name for name, traits in GATE_TRAITS.items() if getattr(traits, trait) is value)


GATES = tuple(GATE_TRAITS)
BALANCED_GATES = gates_where("balanced")
"""Gates that fix every expert's load themselves: no balancing loss, no capacity factor."""
OWN_ORDER_GATES = gates_where("own_order")
"""Gates whose claim order is their definition (or who drop nothing): no --moe-token-drop-policy."""
