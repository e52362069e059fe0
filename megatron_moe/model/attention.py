"""Self-attention of the megatron_moe layer spec: megatron-core's SelfAttention, or its MLASelfAttention with
--multi-latent-attention, configured from the attention flags (`config.groups_attention.AttentionFlags`).

The modules are megatron-core's local spec's (`get_gpt_layer_local_spec`) or, on transformer-engine, its TE spec's,
with two differences that hold on both backends: the linears are `parallel_linears`' (ours on the local backend,
so Lancet can defer their weight gradients), and every norm is `SequenceParallelNorm`, never fused into the next
linear. MLA's local core attention is `LatentDotProductAttention` (megatron-core 0.16.1's own takes no MLA head
widths). One exception: MLASelfAttention accepts its q/kv down-projections only as exactly megatron-core's
ColumnParallelLinear (or transformer-engine's Linear), a class-identity check, so on the local backend those two
are megatron-core's own and their weight gradients are computed in backward as usual.
"""

from __future__ import annotations

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_moe.config import ModelConfig
from megatron_moe.platform.norms import SequenceParallelNorm
from megatron_moe.platform.patch import Patch, source

MLA_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rotary_base",
    "rotary_percent",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
)
"""MLATransformerConfig's fields set from the flags of the same names (Megatron-LM's core_transformer_config_from_
args); original_max_position_embeddings, beta_fast and beta_slow keep MLATransformerConfig's defaults, as there."""


def config_class(model: ModelConfig) -> type[TransformerConfig]:
    """MLATransformerConfig with --multi-latent-attention (as Megatron-LM picks it), else TransformerConfig."""
    return MLATransformerConfig if model.multi_latent_attention else TransformerConfig


def config_kwargs(model: ModelConfig) -> dict:
    """The attention fields of megatron-core's config for `model`'s flags (for `config_class(model)`)."""
    kwargs = {"kv_channels": model.kv_channels, "qk_layernorm": model.qk_layernorm, "add_qkv_bias": model.add_qkv_bias}
    kwargs["apply_query_key_layer_scaling"] = model.apply_query_key_layer_scaling
    if model.multi_latent_attention:
        kwargs |= {name: getattr(model, name) for name in MLA_FIELDS}
        kwargs |= {"multi_latent_attention": True, "rope_type": model.mla_rope_type}
    return kwargs


def mla_fused_rope() -> bool:
    """megatron-core found its fused MLA YaRN RoPE kernels (triton) at import; apply_rope_fusion with MLA needs them."""
    return mcore_mla.fused_apply_mla_rope_for_q is not None


class LatentDotProductAttention(DotProductAttention):
    """megatron-core's local DotProductAttention with MLA's head widths: MLASelfAttention builds its core attention
    with `k_channels` (query/key head: --qk-head-dim + --qk-pos-emb-head-dim) and `v_channels` (--v-head-dim),
    which 0.16.1's DotProductAttention does not take (only transformer-engine's does), and its output is heads x
    `v_channels` wide, not heads x kv_channels. MLA always passes its (YaRN-scaled) `softmax_scale`."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        if kwargs.get("softmax_scale") is None and k_channels is not None:
            kwargs["softmax_scale"] = k_channels**-0.5
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def attention_spec(config: TransformerConfig, backend: BackendSpecProvider, column: type, row: type) -> ModuleSpec:
    """Causal self-attention for `config` (MLA when `config.multi_latent_attention`), with `column` / `row` as its
    parallel linears and `SequenceParallelNorm` as its query/key (MLA: latent) norms with `config.qk_layernorm`."""
    qk_norm = SequenceParallelNorm if config.qk_layernorm else IdentityOp
    if not config.multi_latent_attention:
        submodules = SelfAttentionSubmodules(
            linear_qkv=column,
            core_attention=backend.core_attention(),
            linear_proj=row,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        )
        return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}, submodules=submodules)
    local = isinstance(backend, LocalSpecProvider)
    # transformer-engine's spec keeps the down-projections whole on every TP rank (Linear, "duplicated").
    down = ColumnParallelLinear if local else backend.linear()
    submodules = MLASelfAttentionSubmodules(
        linear_q_proj=column,
        linear_q_down_proj=down,
        linear_q_up_proj=column,
        linear_kv_down_proj=down,
        linear_kv_up_proj=column,
        core_attention=LatentDotProductAttention if local else backend.core_attention(),
        linear_proj=row,
        q_layernorm=qk_norm,
        kv_layernorm=qk_norm,
    )
    return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal}, submodules=submodules)


def _local_attention_takes_no_head_widths() -> bool:
    init = source("megatron.core.transformer.dot_product_attention", "DotProductAttention")
    return "k_channels" not in init and "k_channels=" in source("megatron.core.transformer.multi_latent_attention")


def _mla_checks_down_projection_classes() -> bool:
    src = source("megatron.core.transformer.multi_latent_attention")
    return "submodules.linear_q_down_proj in [" in src and "ColumnParallelLinear,\n" in src


PROBES: tuple[Patch, ...] = (
    Patch(
        "latent_dot_product_attention",
        "model/attention.py: LatentDotProductAttention, megatron-core's local DotProductAttention taking MLA's "
        "k_channels / v_channels, which MLASelfAttention passes and 0.16.1's does not accept.",
        None,
        _local_attention_takes_no_head_widths,
    ),
    Patch(
        "mla_down_projections_not_deferred",
        "model/attention.py: MLA's q/kv down-projections are megatron-core's ColumnParallelLinear, not our deferrable "
        "subclass: MLASelfAttention accepts only the listed classes (identity, not issubclass).",
        None,
        _mla_checks_down_projection_classes,
    ),
)
