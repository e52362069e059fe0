"""The modular MoE layer (FSMoE-style): Gate, Order/I-Order, Dispatch/Combine, Expert, hooks.

    route (gates.py) -> order (ordering.py) -> dispatch (dispatch.py) -> experts (experts.py)
    -> combine (dispatch.py) -> unorder (ordering.py), hooks between (hooks.py)

Capacity semantics (Tutel) in capacity.py; router losses and statistics in
routing.py / metrics.py; every collective goes through megatron_moe.comm. The layer's
config, `MoELayerConfig`, lives in the config layer (megatron_moe.config.moe_layer).
"""

from megatron_moe.config.moe_layer import MoEConfigError, MoELayerConfig
from megatron_moe.moe.capacity import capacity_limit, expert_capacity
from megatron_moe.moe.dispatch import AllToAllV, Dispatcher, PaddedAllToAll
from megatron_moe.moe.expert_bias import group_limited_topk, update_expert_biases
from megatron_moe.moe.experts import Experts, FFNExperts, ModuleListExperts
from megatron_moe.moe.gates import build_gate, finish_router_step
from megatron_moe.moe.hooks import HOOK_POINTS, Bf16OnTheWire, HookContext, MoEHook
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.metrics import collect_moe_metrics, set_moe_aux_loss_scale
from megatron_moe.moe.ordering import DenseOrdering, Ordering, SparseOrdering
from megatron_moe.moe.routing import Gate, Routing
from megatron_moe.moe.spec import moe_layer_spec

__all__ = [
    "AllToAllV",
    "Bf16OnTheWire",
    "DenseOrdering",
    "Dispatcher",
    "Experts",
    "FFNExperts",
    "Gate",
    "HOOK_POINTS",
    "HookContext",
    "MoEConfigError",
    "MoEHook",
    "MoELayer",
    "MoELayerConfig",
    "ModuleListExperts",
    "Ordering",
    "PaddedAllToAll",
    "Routing",
    "SparseOrdering",
    "build_gate",
    "capacity_limit",
    "collect_moe_metrics",
    "expert_capacity",
    "finish_router_step",
    "group_limited_topk",
    "moe_layer_spec",
    "set_moe_aux_loss_scale",
    "update_expert_biases",
]
