"""The megatron_moe layer spec: megatron-core TransformerLayers with our norms and MoE.

Dense and MoE layers share attention; the MLP slot holds a dense MLP or an MoE
layer as `--moe-layer-freq` says: megatron_moe's own (`megatron_moe.moe`, the
default) or megatron-core's (`--moe-layer-impl mcore`). On a GPU with transformer-engine installed
the linear layers and attention come from it; otherwise from megatron-core's
local modules, where the linear layers are megatron_moe's deferrable subclasses
(`megatron_moe.overlap.linears`: megatron-core's, untouched until a Lancet store
defers their weight gradients). Norms are always `SequenceParallelNorm`, never fused into the next linear, so
both backends hold the same parameters under the same names and a checkpoint moves between them: the
dist-checkpoint keys are identical (tests/unit/test_transformer_engine.py); transformer-engine's modules add only
their `_extra_state` (FP8 metadata), which megatron-core's local linears save as None under the same keys.
"""

from __future__ import annotations

import dataclasses

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend, get_mlp_module_spec_for_backend
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_moe.model.attention import attention_spec
from megatron_moe.moe import MoELayerConfig, moe_layer_spec
from megatron_moe.overlap.linears import DeferrableColumnParallelLinear, DeferrableRowParallelLinear
from megatron_moe.platform.norms import SequenceParallelNorm


def backend_provider(use_transformer_engine: bool) -> BackendSpecProvider:
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def parallel_linears(backend: BackendSpecProvider) -> tuple[type, type]:
    """(column, row) parallel linear classes: ours on the local backend (their dW can be deferred),
    transformer-engine's as they are (they have their own `delay_wgrad_compute`)."""
    if isinstance(backend, LocalSpecProvider):
        return DeferrableColumnParallelLinear, DeferrableRowParallelLinear
    return backend.column_parallel_linear(), backend.row_parallel_linear()


def dense_mlp_spec(backend: BackendSpecProvider) -> ModuleSpec:
    """megatron-core's dense MLP spec with `parallel_linears`' fc1/fc2.

    Also on transformer-engine: its backend would make fc1 a fused layer norm + linear
    (TELayerNormColumnParallelLinear), but the layer's own `pre_mlp_layernorm` already normalizes here, so that
    would normalize twice and give the checkpoint a `mlp.linear_fc1.layer_norm_weight` the local spec lacks.
    """
    spec = get_mlp_module_spec_for_backend(backend=backend, num_experts=None)
    column, row = parallel_linears(backend)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, linear_fc1=column, linear_fc2=row))


def layer_spec(
    config: TransformerConfig, *, moe: bool, backend: BackendSpecProvider, moe_layer: MoELayerConfig | None = None
) -> ModuleSpec:
    """One transformer layer: norm -> self-attention (`attention_spec`: MLA, q/k norms) -> norm -> MLP or MoE.

    MoE layers hold megatron_moe's MoELayer when `moe_layer` is given, else megatron-core's.
    """
    column, row = parallel_linears(backend)
    if moe and moe_layer is not None:
        mlp = moe_layer_spec(moe_layer)
    elif not moe:
        mlp = dense_mlp_spec(backend)
    else:
        mlp = get_mlp_module_spec_for_backend(
            backend=backend,
            num_experts=config.num_moe_experts if moe else None,
            moe_grouped_gemm=config.moe_grouped_gemm,
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm,
            self_attention=attention_spec(config, backend, column, row),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SequenceParallelNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(
    config: TransformerConfig,
    moe_pattern: list[int],
    *,
    use_transformer_engine: bool = False,
    pp_rank: int | None = None,
    vp_stage: int | None = None,
    moe_layer: MoELayerConfig | None = None,
) -> TransformerBlockSubmodules:
    """The layers this pipeline stage (with `vp_stage`: this virtual stage of it) builds, MoE where `moe_pattern`
    has a 1."""
    backend = backend_provider(use_transformer_engine)
    dense = layer_spec(config, moe=False, backend=backend)
    moe = layer_spec(config, moe=True, backend=backend, moe_layer=moe_layer) if config.num_moe_experts else None
    specs = [moe if is_moe else dense for is_moe in moe_pattern]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=SequenceParallelNorm)


def mtp_block_spec(
    config: TransformerConfig,
    moe_pattern: list[int],
    *,
    use_transformer_engine: bool = False,
    vp_stage: int | None = None,
    moe_layer: MoELayerConfig | None = None,
) -> MultiTokenPredictionBlockSubmodules | None:
    """The multi-token prediction block this (virtual) stage builds, or None (no --mtp-num-layers, or not the last
    stage: megatron-core's `get_mtp_num_layers_to_build`). Its transformer layer is the decoder's last layer's spec,
    as Megatron-LM's gpt_builders takes it: ours (MoE through our layer where the last layer is MoE)."""
    if not config.mtp_num_layers:
        return None
    backend = backend_provider(use_transformer_engine)
    last = layer_spec(config, moe=bool(moe_pattern[-1]), backend=backend, moe_layer=moe_layer)
    block = get_gpt_mtp_block_spec_for_backend(config=config, spec=last, backend=backend, vp_stage=vp_stage)
    if block is None:
        return None
    # Its norms ours, as the decoder's (the backend's local norm refuses sequence parallelism; TE's adds keys).
    norms = dict(enorm=SequenceParallelNorm, hnorm=SequenceParallelNorm, layer_norm=SequenceParallelNorm)
    layers = [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, **norms)) for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)
