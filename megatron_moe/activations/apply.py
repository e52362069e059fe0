"""Putting an ActivationPolicy on the transformer layers of a built model.

Each layer's forward runs inside the policy's `LayerScope`; the named
megatron-core submodules (norms, attention GEMMs, dense MLP) run as policy
regions. An MLP slot that implements `use_activation_scope(scope)` (our MoE
layer) places its own regions: router, ordering, dispatch, experts, combine.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_moe.activations.engine import LayerScope, SavedBytes
from megatron_moe.config.activation_policy import ActivationPolicy

# (attribute path inside a TransformerLayer, policy name)
LAYER_MODULES = (
    ("input_layernorm", "input_norm"),
    ("self_attention.linear_qkv", "qkv"),
    # multi-latent attention's query and key/value projections (whichever its --q-lora-rank builds)
    ("self_attention.linear_q_proj", "qkv"),
    ("self_attention.linear_q_down_proj", "qkv"),
    ("self_attention.linear_q_up_proj", "qkv"),
    ("self_attention.linear_kv_down_proj", "qkv"),
    ("self_attention.linear_kv_up_proj", "qkv"),
    ("self_attention.core_attention", "core_attention"),
    ("self_attention.linear_proj", "attn_proj"),
    ("pre_mlp_layernorm", "pre_mlp_norm"),
)
DENSE_MLP = (("linear_fc1", "mlp_fc1"), ("linear_fc2", "mlp_fc2"))


def _resolve(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def run_module_in_region(scope: LayerScope, module: torch.nn.Module, name: str) -> None:
    """Route `module`'s forward through the scope under policy name `name`."""
    module.forward = functools.partial(scope.call, name, module.forward)


def _wrap_layer_forward(layer: TransformerLayer, scope: LayerScope) -> None:
    forward = layer.forward

    @functools.wraps(forward)
    def scoped_forward(*args, **kwargs):
        with scope.active():
            return forward(*args, **kwargs)

    layer.forward = scoped_forward


def apply_activation_policy(
    model: torch.nn.Module, policy: ActivationPolicy, counter: SavedBytes | None = None
) -> LayerScope | None:
    """Install `policy` on every TransformerLayer of `model`; returns the scope (None if trivial)."""
    if policy.is_trivial and counter is None:
        return None
    scope = LayerScope(policy, counter)
    for layer in (m for m in model.modules() if isinstance(m, TransformerLayer)):
        _wrap_layer_forward(layer, scope)
        for path, name in LAYER_MODULES:
            module = _resolve(layer, path)
            if isinstance(module, torch.nn.Module):
                run_module_in_region(scope, module, name)
        mlp = layer.mlp
        if hasattr(mlp, "use_activation_scope"):
            mlp.use_activation_scope(scope)
        elif hasattr(mlp, "linear_fc1"):  # megatron-core dense MLP
            for attr, name in DENSE_MLP:
                run_module_in_region(scope, getattr(mlp, attr), name)
            mlp.activation_func = functools.partial(scope.call, "mlp_act", mlp.activation_func)
    return scope
