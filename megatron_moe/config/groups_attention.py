"""The attention flags of the model group: head width, query/key norms, multi-latent attention, its YaRN RoPE.

Megatron-LM's names, defaults and meanings (its TransformerConfig fields and `_add_mla_args`, HEAD d98e8a64dd).
`ModelConfig` (groups.py) inherits `AttentionFlags`, so each flag is a field of the model group
(`cfg.model.qk_layernorm`). The checks are `rules_attention.py`'s; megatron-core's config and modules are built
from these in `megatron_moe.model.attention`.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config import conditions as only
from megatron_moe.config.fields import arg

ROPE_TYPES = ("rope", "yarn")


@dataclasses.dataclass(kw_only=True)
class AttentionFlags:
    """Attention's shape beyond hidden size and heads (Megatron-LM's flags of the same names)."""

    kv_channels: int | None = arg(
        None,
        "width of each attention head (projection size = heads x this); default --hidden-size / --num-attention-heads",
        applies=only.NOT_MLA,
    )
    add_qkv_bias: bool = arg(
        False,
        "biases on the query/key/value projection alone (Qwen2's attention), also with --disable-bias-linear",
        applies=only.NOT_MLA,
    )
    apply_query_key_layer_scaling: bool = arg(
        False,
        "scale Q.K^T by 1 / layer number and the softmax back (megatron-core's fp16 stability aid; the same attention, "
        "its softmax in fp32)",
        applies=only.NOT_MLA,
    )
    qk_layernorm: bool = arg(
        False,
        "normalize queries and keys per head before the dot product (--normalization's norm); with "
        "--multi-latent-attention: the norms of MLA's compressed query and key/value latents",
    )
    multi_latent_attention: bool = arg(
        False, "multi-latent attention (DeepSeek-V2/V3's MLA): queries and keys/values through low-rank latents"
    )
    q_lora_rank: int | None = arg(
        None,
        "rank of MLA's query latent (a down- then up-projection); unset: one query projection (DeepSeek-V2-Lite)",
        applies=only.MLA,
    )
    kv_lora_rank: int = arg(32, "rank of MLA's key/value latent", applies=only.MLA)
    qk_head_dim: int = arg(
        128,
        "MLA: width of each query/key head without its RoPE part (q head = this + --qk-pos-emb-head-dim)",
        applies=only.MLA,
    )
    qk_pos_emb_head_dim: int = arg(64, "MLA: width of each query/key head's RoPE part", applies=only.MLA)
    v_head_dim: int = arg(128, "MLA: width of each value head", applies=only.MLA)
    rope_type: str | None = arg(
        None,
        "RoPE variant: rope, or yarn (multi-latent attention only); unset: yarn with --multi-latent-attention, "
        "else rope",
        choices=ROPE_TYPES,
        applies=only.ROPE,
    )
    rotary_percent: float = arg(1.0, "fraction of each head's width that RoPE rotates", applies=only.ROPE)
    rotary_scaling_factor: float = arg(1.0, "YaRN's context-extension factor", applies=only.MLA_YARN)
    mscale: float = arg(1.0, "YaRN's attention-scale factor (mscale) of MLA", applies=only.MLA_YARN)
    mscale_all_dim: float = arg(0.0, "YaRN's mscale over all dimensions of MLA", applies=only.MLA_YARN)

    @property
    def head_dim(self) -> int:
        """The width of a (non-MLA) attention head: --kv-channels, else hidden / heads (megatron-core's rule)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def mla_rope_type(self) -> str:
        """MLA's RoPE: --rope-type, else yarn (MLATransformerConfig's default, as Megatron-LM leaves it)."""
        return self.rope_type or "yarn"
