"""HuggingFace Mixtral <-> megatron_moe weights: names, layouts, config, and what cannot map.

Legend (docs/shapes.md): E = experts, F = expert ffn width, H = hidden, V = vocab, A = key/value
groups, M = query heads per group, D = head dim, R = rows.

Inputs: our single-process (TP=PP=EP=1) `GPTModel.state_dict()`, or HF tensors (the published
`block_sparse_moe.experts.E.w1/w2/w3` names, or transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`).
Outputs: the other side's tensors; writes use the published names; padded vocabulary rows are dropped on
export and zero on import. `incompatibilities(cfg)` lists what Mixtral cannot express (refused before writing).
How QKV, the experts and the vocabulary are laid out on each side: docs/internals/checkpointing.md.
"""

from __future__ import annotations

import torch

from megatron_moe.config import ConfigError, RunConfig


def incompatibilities(cfg: RunConfig) -> list[str]:
    """Every feature of `cfg` that a Mixtral checkpoint cannot express (empty: exportable), each with what export
    needs instead. The one home of these rules: `export-hf` refuses by them (`check_exportable`) and a run that
    saves says them at start-up (`startup_note`)."""
    m, moe = cfg.model, cfg.moe
    checks = [
        (moe.is_moe, "a dense model (no --num-experts); Mixtral is all-MoE"),
        (
            not moe.is_moe or moe.layer_pattern(m.num_layers) == [1] * m.num_layers,
            f"--moe-layer-freq={moe.moe_layer_freq}: Mixtral has an MoE block in every layer (--moe-layer-freq 1)",
        ),
        (
            not moe.is_moe or moe.own_layer,
            f"--moe-layer-impl={moe.moe_layer_impl}: export reads our MoE layer's weights (--moe-layer-impl "
            "megatron_moe)",
        ),
        (m.swiglu, "GELU experts/MLPs (Mixtral experts are SwiGLU: add --swiglu)"),
        (not m.mtp_layers, f"--mtp-num-layers={m.mtp_num_layers}: Mixtral has no multi-token prediction layers"),
        (m.normalization == "RMSNorm", f"--normalization={m.normalization} (Mixtral uses RMSNorm)"),
        (
            m.position_embedding_type == "rope",
            f"--position-embedding-type={m.position_embedding_type} (Mixtral uses RoPE)",
        ),
        (m.disable_bias_linear, "biases in linear layers (Mixtral has none: --disable-bias-linear)"),
        (not m.multi_latent_attention, "--multi-latent-attention (Mixtral's attention is GQA)"),
        (not m.qk_layernorm, "--qk-layernorm (Mixtral has no query/key norms)"),
        (not m.add_qkv_bias, "--add-qkv-bias (Mixtral's attention has no biases)"),
        (
            m.multi_latent_attention or m.head_dim * m.num_attention_heads == m.hidden_size,
            f"--kv-channels={m.kv_channels} (export writes heads of --hidden-size / --num-attention-heads)",
        ),
        (m.rotary_percent == 1.0, f"--rotary-percent={m.rotary_percent} (Mixtral rotates whole heads)"),
        (
            m.untie_embeddings_and_output_weights,
            "tied input/output embeddings (Mixtral unties them: --untie-embeddings-and-output-weights)",
        ),
        (moe.moe_gate == "topk", f"--moe-gate={moe.moe_gate} (Mixtral routes with softmax top-k: --moe-gate topk)"),
        (not moe.moe_shared_expert_ffn_hidden_size, "a shared expert (Mixtral has none)"),
        (
            moe.moe_router_score_function != "sigmoid",
            "--moe-router-score-function=sigmoid (Mixtral routes with softmax top-k)",
        ),
        (
            not moe.moe_router_pre_softmax and moe.moe_normalize_topk,
            "top-k weights not renormalised (Mixtral renormalises them: drop --moe-router-pre-softmax and "
            "--no-moe-normalize-topk)",
        ),
        (
            moe.moe_router_topk_scaling_factor in (None, 1.0),
            f"--moe-router-topk-scaling-factor={moe.moe_router_topk_scaling_factor} (Mixtral does not scale its "
            "weights)",
        ),
        (
            moe.moe_router_group_topk is None,
            f"--moe-router-group-topk={moe.moe_router_group_topk} (Mixtral picks its top-k among all experts)",
        ),
    ]
    return [message for ok, message in checks if not ok]


def check_exportable(cfg: RunConfig) -> None:
    problems = incompatibilities(cfg)
    if problems:
        raise ConfigError("this model cannot be written as Mixtral:\n  - " + "\n  - ".join(problems))


def startup_note(cfg: RunConfig) -> str | None:
    """The start-up line of a run that saves a model `export-hf` would refuse (None: it exports, or nothing is
    saved), so that the run's owner learns it when the run starts, not when its checkpoint is exported. A note,
    not a refusal: such a model is a legal run."""
    problems = incompatibilities(cfg) if cfg.checkpoint.save else []
    if not problems:
        return None
    return "note: this model cannot be exported to HuggingFace Mixtral (convert.py export-hf): " + "; ".join(problems)


def hf_config(cfg: RunConfig, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    m, moe = cfg.model, cfg.moe
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": moe.expert_ffn_width(m),
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups or m.num_attention_heads,
        "head_dim": m.hidden_size // m.num_attention_heads,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.moe_router_topk,
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": float(m.rotary_base),
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "router_aux_loss_coef": moe.moe_aux_loss_coeff,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def run_flags_from_hf(config: dict) -> list[str]:
    """Model flags for a megatron_moe run with the architecture of an HF Mixtral config."""
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 1e6)
    heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        raise ConfigError(f"head_dim={config['head_dim']} != hidden_size / num_attention_heads: not supported")
    return [
        "--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"]),
        "--num-attention-heads", str(heads), "--num-query-groups", str(config.get("num_key_value_heads", heads)),
        "--ffn-hidden-size", str(config["intermediate_size"]), "--num-experts", str(config["num_local_experts"]),
        "--moe-router-topk", str(config["num_experts_per_tok"]), "--moe-layer-freq", "1",
        "--normalization", "RMSNorm", "--norm-epsilon", str(config.get("rms_norm_eps", 1e-5)), "--swiglu",
        "--position-embedding-type", "rope", "--rotary-base", str(int(rope)), "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--seq-length", str(min(config.get("max_position_embeddings", 4096), 4096)),
        "--max-position-embeddings", str(config.get("max_position_embeddings", 4096)),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- QKV


def _qkv_shape(cfg: RunConfig) -> tuple[int, int, int]:
    m = cfg.model
    groups = m.num_query_groups or m.num_attention_heads
    return groups, m.num_attention_heads // groups, m.hidden_size // m.num_attention_heads


def split_qkv(w_RH: torch.Tensor, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    A, M, D = _qkv_shape(cfg)
    w_ARH = w_RH.view(A, (M + 2) * D, -1)
    q, k, v = torch.split(w_ARH, [M * D, D, D], dim=1)
    return q.reshape(A * M * D, -1), k.reshape(A * D, -1), v.reshape(A * D, -1)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: RunConfig) -> torch.Tensor:
    A, M, D = _qkv_shape(cfg)
    H = q.shape[-1]
    return torch.cat([q.view(A, M * D, H), k.view(A, D, H), v.view(A, D, H)], dim=1).reshape(-1, H)


# ----------------------------------------------------------------------------- export


def to_hf(ours: dict[str, torch.Tensor], cfg: RunConfig, vocab_size: int):
    """Yield (layer or None, {hf name: tensor}) groups, embedding first, in published names."""
    yield (
        None,
        {
            "model.embed_tokens.weight": ours["embedding.word_embeddings.weight"][:vocab_size],
            "model.norm.weight": ours["decoder.final_layernorm.weight"],
            "lm_head.weight": ours["output_layer.weight"][:vocab_size],
        },
    )
    for i in range(cfg.model.num_layers):
        ours_l, hf_l = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(ours[ours_l + "self_attention.linear_qkv.weight"], cfg)
        group = {
            hf_l + "input_layernorm.weight": ours[ours_l + "input_layernorm.weight"],
            hf_l + "self_attn.q_proj.weight": q,
            hf_l + "self_attn.k_proj.weight": k,
            hf_l + "self_attn.v_proj.weight": v,
            hf_l + "self_attn.o_proj.weight": ours[ours_l + "self_attention.linear_proj.weight"],
            hf_l + "post_attention_layernorm.weight": ours[ours_l + "pre_mlp_layernorm.weight"],
            hf_l + "block_sparse_moe.gate.weight": ours[ours_l + "mlp.gate.weight"],
        }
        w1_EFH, w2_EHF = ours[ours_l + "mlp.experts.weight1"], ours[ours_l + "mlp.experts.weight2"]
        gate_EFH, up_EFH = torch.chunk(w1_EFH, 2, dim=1)
        for e in range(w1_EFH.shape[0]):
            hf_e = f"{hf_l}block_sparse_moe.experts.{e}."
            group[hf_e + "w1.weight"] = gate_EFH[e]
            group[hf_e + "w3.weight"] = up_EFH[e]
            group[hf_e + "w2.weight"] = w2_EHF[e]
        yield i, group


# ----------------------------------------------------------------------------- import


def from_hf(hf: dict[str, torch.Tensor], cfg: RunConfig, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Our single-process state dict from HF tensors (published or fused expert layout)."""

    def pad_vocab(w_VH):
        out = w_VH.new_zeros(padded_vocab, w_VH.shape[1])
        out[: w_VH.shape[0]] = w_VH
        return out

    ours = {
        "embedding.word_embeddings.weight": pad_vocab(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": pad_vocab(hf["lm_head.weight"]),
    }
    for i in range(cfg.model.num_layers):
        ours_l, hf_l = f"decoder.layers.{i}.", f"model.layers.{i}."
        moe = hf_l + ("block_sparse_moe." if hf_l + "block_sparse_moe.gate.weight" in hf else "mlp.")
        ours.update(
            {
                ours_l + "input_layernorm.weight": hf[hf_l + "input_layernorm.weight"],
                ours_l + "self_attention.linear_qkv.weight": merge_qkv(
                    hf[hf_l + "self_attn.q_proj.weight"],
                    hf[hf_l + "self_attn.k_proj.weight"],
                    hf[hf_l + "self_attn.v_proj.weight"],
                    cfg,
                ),
                ours_l + "self_attention.linear_proj.weight": hf[hf_l + "self_attn.o_proj.weight"],
                ours_l + "pre_mlp_layernorm.weight": hf[hf_l + "post_attention_layernorm.weight"],
                ours_l + "mlp.gate.weight": hf[moe + "gate.weight"],
            }
        )
        ours[ours_l + "mlp.experts.weight1"], ours[ours_l + "mlp.experts.weight2"] = _experts_from_hf(hf, moe, cfg)
    return ours


def _experts_from_hf(hf: dict, moe: str, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if moe + "experts.gate_up_proj" in hf:  # transformers 5 fused: [E, 2F, H] gate then up, [E, H, F]
        return hf[moe + "experts.gate_up_proj"], hf[moe + "experts.down_proj"]
    E = cfg.moe.num_experts
    w1 = torch.stack(
        [torch.cat([hf[f"{moe}experts.{e}.w1.weight"], hf[f"{moe}experts.{e}.w3.weight"]]) for e in range(E)]
    )
    w2 = torch.stack([hf[f"{moe}experts.{e}.w2.weight"] for e in range(E)])
    return w1, w2
