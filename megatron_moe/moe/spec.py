"""How the MoE layer enters megatron-core's layer spec, and its config from the run's.

    moe_cfg = moe_layer_config(transformer_config, gate="topk", capacity_factor=0.0, ...)
    layer_submodules.mlp = moe_layer_spec(moe_cfg)

TransformerLayer then calls `build_module(spec, config=config)`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe.moe.config import MoELayerConfig
from megatron_moe.moe.hooks import MoEHook

_BALANCING = {"aux_loss": "switch", "seq_aux_loss": "switch", "none": "none"}


def moe_layer_config(config: TransformerConfig, **fields) -> MoELayerConfig:
    """Sizes, top-k, activation and loss weights from the TransformerConfig; the rest from `fields`.

    The capacity factor is NOT read from `config`: megatron-core rewrites a
    negative (adaptive) factor to None, so pass `capacity_factor=` here.
    """
    coeff = config.moe_aux_loss_coeff
    base = dict(
        num_experts=config.num_moe_experts,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
        topk=config.moe_router_topk,
        expert_type="swiglu" if config.gated_linear_unit else "gelu",
        load_balancing=_BALANCING.get(config.moe_router_load_balancing_type, "switch"),
        aux_loss_coeff=float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff),
        z_loss_coeff=float(config.moe_z_loss_coeff or 0.0),
        init_method_std=config.init_method_std,
    )
    names = {f.name for f in dataclasses.fields(MoELayerConfig)}
    unknown = set(fields) - names
    if unknown:
        raise TypeError(f"unknown MoE layer settings {sorted(unknown)}; valid: {sorted(names)}")
    return MoELayerConfig(**{**base, **fields})


def moe_layer_spec(moe_config: MoELayerConfig, *, experts: ModuleSpec | Callable | None = None,
                   hooks: Sequence[MoEHook] = ()) -> ModuleSpec:  # fmt: skip
    """The MLP-slot spec of an MoE TransformerLayer. `experts`: a custom expert module spec
    (built with num_local_experts, moe_config, ep_group, expert_dp_group)."""
    from megatron_moe.moe.layer import MoELayer

    moe_config.validate()
    return ModuleSpec(module=MoELayer, params={"moe_config": moe_config, "experts": experts, "hooks": tuple(hooks)})
