"""The attention flags' checks (`groups_attention.AttentionFlags`): alone, and against the tensor-parallel layout.

Each error names the flag, its value and a valid choice (`fields.require`), in the flag pass before any process
group exists.
"""

from __future__ import annotations

from megatron_moe.config.fields import require, require_non_negative, require_positive
from megatron_moe.config.groups import ModelConfig


def check_attention(model: ModelConfig) -> None:
    """Head widths and ranks positive, RoPE that fits the head, MLA with RoPE and without GQA."""
    for flag, value, example in (
        ("--kv-channels", model.kv_channels, 128),
        ("--q-lora-rank", model.q_lora_rank, 1536),
        ("--kv-lora-rank", model.kv_lora_rank, 512),
        ("--qk-head-dim", model.qk_head_dim, 128),
        ("--qk-pos-emb-head-dim", model.qk_pos_emb_head_dim, 64),
        ("--v-head-dim", model.v_head_dim, 128),
        ("--rotary-scaling-factor", model.rotary_scaling_factor, 40),
        ("--mscale", model.mscale, 1.0),
    ):
        require_positive(flag, value, example)
    require_non_negative("--mscale-all-dim", model.mscale_all_dim, 1.0)
    pct = model.rotary_percent
    require(0 < pct <= 1, "--rotary-percent", pct, "must be in (0, 1], e.g. --rotary-percent 1.0")
    if not model.multi_latent_attention:
        _check_heads(model)
        return
    require(
        model.position_embedding_type == "rope",
        "--position-embedding-type",
        model.position_embedding_type,
        "multi-latent attention rotates its --qk-pos-emb-head-dim part of each head: use --position-embedding-type "
        "rope",
    )
    require(
        model.num_query_groups in (None, model.num_attention_heads),
        "--num-query-groups",
        model.num_query_groups,
        "multi-latent attention has no query groups (as Megatron-LM: GQA and MLA exclude each other); drop it",
    )
    if model.mla_rope_type == "rope":
        _require_even_rotation("--qk-pos-emb-head-dim", model.qk_pos_emb_head_dim, pct)
    else:
        require(
            model.qk_pos_emb_head_dim % 2 == 0,
            "--qk-pos-emb-head-dim",
            model.qk_pos_emb_head_dim,
            "YaRN rotates pairs of channels: must be even, e.g. --qk-pos-emb-head-dim 64",
        )


def _check_heads(model: ModelConfig) -> None:
    """Without MLA: a head width (given, or hidden / heads exactly) that RoPE rotates in pairs."""
    require(
        model.rope_type in (None, "rope"),
        "--rope-type",
        model.rope_type,
        "YaRN is multi-latent attention's here (as in Megatron-LM): use --rope-type rope, or add "
        "--multi-latent-attention",
    )
    if model.kv_channels is None:
        require(
            model.hidden_size % model.num_attention_heads == 0,
            "--hidden-size",
            model.hidden_size,
            f"must be a multiple of --num-attention-heads={model.num_attention_heads}",
        )
    if model.position_embedding_type == "rope":
        _require_even_rotation("--rotary-percent", model.head_dim, model.rotary_percent)


def _require_even_rotation(flag: str, width: int, pct: float) -> None:
    """RoPE rotates int(width x --rotary-percent) channels in pairs: a positive even number."""
    rotated = int(width * pct)
    value = pct if flag == "--rotary-percent" else width
    require(
        rotated > 0 and rotated % 2 == 0,
        flag,
        value,
        f"RoPE rotates int({width} x {pct}) = {rotated} channels of each head in pairs: that must be even and "
        "positive, e.g. --rotary-percent 1.0",
    )


def check_attention_parallel(model: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """MLA under tensor parallelism: the down-projections split over TP, the latent norms' gradients summed once."""
    if not model.multi_latent_attention or tp == 1:
        return
    if model.transformer_impl != "transformer_engine":  # its down-projections are duplicated, not split
        q, kv = model.q_lora_rank, model.kv_lora_rank
        for flag, value, width in (("--q-lora-rank", q, q), ("--kv-lora-rank", kv, kv + model.qk_pos_emb_head_dim)):
            require(
                width is None or width % tp == 0,
                flag,
                value,
                f"megatron-core's local MLA splits this latent's down-projection ({width} outputs, kv's with "
                f"--qk-pos-emb-head-dim) over TP: it must be a multiple of --tensor-model-parallel-size={tp} (or "
                "use --transformer-impl transformer_engine)",
            )
    require(
        sequence_parallel or not model.qk_layernorm,
        "--qk-layernorm",
        True,
        f"with --multi-latent-attention and --tensor-model-parallel-size={tp}, megatron-core sums the query latent "
        "norm's gradient over TP although every rank computed it whole: add --sequence-parallel (each rank then "
        "normalizes its own slice of the sequence)",
    )
