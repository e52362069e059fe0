"""How the MoE layer enters megatron-core's layer spec.

    moe_cfg = MoELayerConfig(num_experts=8, hidden_size=H, ffn_hidden_size=F, gate="topk", ...)
    layer_submodules.mlp = moe_layer_spec(moe_cfg)

TransformerLayer then calls `build_module(spec, config=config)`. A training
run gets its MoELayerConfig from its flags (`MoEConfig.layer_config`, the one
place flags become a layer config).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_moe.config.moe_layer import MoELayerConfig
from megatron_moe.moe.hooks import MoEHook
from megatron_moe.moe.layer import MoELayer


def moe_layer_spec(
    moe_config: MoELayerConfig, *, experts: ModuleSpec | Callable | None = None, hooks: Sequence[MoEHook] = ()
) -> ModuleSpec:
    """The MLP-slot spec of an MoE TransformerLayer. `experts`: a custom expert module spec
    (built with num_local_experts, moe_config, ep_group, expert_dp_group)."""
    moe_config.validate()
    return ModuleSpec(module=MoELayer, params={"moe_config": moe_config, "experts": experts, "hooks": tuple(hooks)})
