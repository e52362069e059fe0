"""HuggingFace MoE families: which family a run is, what the family cannot express of it, its config.json.

Families (transformers' classes): Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3. A family is what it
requires of a run's flags (`_requirements`) and its config.json both ways (`hf_config`, `run_flags_from_hf`); its
tensor names are `hf_tensors.py`'s. `family_of(cfg)` is the family a run's structure points to (MLA: DeepSeek;
query/key norms: Qwen3; a gated shared expert or QKV bias: Qwen2; else Mixtral), and `incompatibilities(cfg)` what
of the run that family cannot express (empty: it exports). `run_flags_from_hf` refuses, naming the field, what of
an HF config no flag here expresses; `read_hf_config` reads and checks a directory's config.json (without torch).
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_moe.config import ConfigError, RunConfig


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    name: str
    mla: bool
    """Multi-latent attention (DeepSeek) rather than grouped-query attention."""
    moe: str
    """An MoE layer's prefix in a layer: Mixtral's `block_sparse_moe.`, the others' `mlp.`."""
    experts: tuple[str, str, str]
    """One expert's gate, up and down projections."""
    shared: str | None
    """The shared expert's prefix in the MoE block (Qwen2's `shared_expert.`, DeepSeek's `shared_experts.`)."""


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "Mixtral", False, "block_sparse_moe.", ("w1", "w3", "w2"), None)
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE", False, "mlp.", MLP_NAMES, "shared_expert.")
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", False, "mlp.", MLP_NAMES, None)
DEEPSEEK_V2 = Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepSeek-V2", True, "mlp.", MLP_NAMES, "shared_experts.")
DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3", True, "mlp.", MLP_NAMES, "shared_experts.")
FAMILIES = {f.model_type: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3)}
MODEL_TYPES = ", ".join(repr(name) for name in FAMILIES)


def family_of(cfg: RunConfig) -> Family:
    """The family `cfg`'s structure points to: the one export writes, or whose rules a refusal names."""
    m, moe = cfg.model, cfg.moe
    if m.multi_latent_attention:
        return DEEPSEEK_V3 if moe.gate == "sigmoid" else DEEPSEEK_V2
    if m.qk_layernorm:
        return QWEN3_MOE
    if moe.is_moe and moe.moe_shared_expert_ffn_hidden_size or m.add_qkv_bias:
        return QWEN2_MOE
    return MIXTRAL


def incompatibilities(cfg: RunConfig, family: Family | None = None) -> list[str]:
    """Every feature of `cfg` that `family` (default: `family_of(cfg)`) cannot express (empty: exportable), each
    with what export needs instead. The one home of these rules: `export-hf` refuses by them (`check_exportable`)
    and a run that saves says them at start-up (`startup_note`)."""
    return [message for ok, message in _requirements(cfg, family or family_of(cfg)) if not ok]


def _requirements(cfg: RunConfig, f: Family) -> list[tuple[bool, str]]:
    m, moe = cfg.model, cfg.moe
    pattern = moe.layer_pattern(m.num_layers) if moe.is_moe else []
    checks = [
        (moe.is_moe, f"a dense model (no --num-experts); {f.name} has MoE layers"),
        (
            not moe.is_moe or moe.own_layer,
            f"--moe-layer-impl={moe.moe_layer_impl}: export reads our MoE layer's weights (--moe-layer-impl "
            "megatron_moe)",
        ),
        (m.swiglu, f"GELU experts/MLPs ({f.name}'s experts are SwiGLU: add --swiglu)"),
        (
            not m.mtp_layers or f is DEEPSEEK_V3,
            f"--mtp-num-layers={m.mtp_num_layers}: {f.name} has no multi-token prediction layers (DeepSeek-V3 has)",
        ),
        (m.normalization == "RMSNorm", f"--normalization={m.normalization} ({f.name} uses RMSNorm)"),
        (
            m.position_embedding_type == "rope",
            f"--position-embedding-type={m.position_embedding_type} ({f.name} uses RoPE)",
        ),
        (m.disable_bias_linear, f"biases in linear layers ({f.name} has none: --disable-bias-linear)"),
        (m.rotary_percent == 1.0, f"--rotary-percent={m.rotary_percent} ({f.name} rotates whole heads)"),
        (
            m.untie_embeddings_and_output_weights,
            f"tied input/output embeddings ({f.name} unties them: --untie-embeddings-and-output-weights)",
        ),
        (
            moe.moe_gate == "topk" or f is DEEPSEEK_V3,
            f"--moe-gate={moe.moe_gate} ({f.name} routes with softmax top-k: --moe-gate topk)",
        ),
        (
            m.multi_latent_attention == f.mla,
            f"--multi-latent-attention ({f.name}'s attention is GQA)"
            if not f.mla
            else f"grouped-query attention ({f.name}'s is multi-latent: --multi-latent-attention)",
        ),
    ]
    if f.mla:
        checks.append((m.qk_layernorm, f"MLA without its latent norms ({f.name} has them: --qk-layernorm)"))
    else:
        checks += [
            (m.qk_layernorm == (f is QWEN3_MOE), "--qk-layernorm (query/key norms: Qwen3-MoE has them, "
             f"{f.name} not)" if m.qk_layernorm else f"no query/key norms ({f.name} has them: --qk-layernorm)"),
            (not m.add_qkv_bias or f is QWEN2_MOE, f"--add-qkv-bias ({f.name}'s attention has no biases; "
             "Qwen2-MoE's has)"),
            (m.head_dim * m.num_attention_heads == m.hidden_size or f is not MIXTRAL,
             f"--kv-channels={m.kv_channels} (Mixtral's heads are --hidden-size / --num-attention-heads wide)"),
        ]  # fmt: skip
    checks += _mlp_requirements(cfg, f, pattern)
    return checks


def _mlp_requirements(cfg: RunConfig, f: Family, pattern: list[int]) -> list[tuple[bool, str]]:
    m, moe = cfg.model, cfg.moe
    shared = moe.moe_shared_expert_ffn_hidden_size if moe.is_moe else None
    scale = moe.moe_router_topk_scaling_factor
    sigmoid = moe.gate == "sigmoid"
    normalized = moe.topk_normalized
    leading_dense = pattern.index(1) if 1 in pattern else len(pattern)
    checks = []
    if f is MIXTRAL:
        checks.append((pattern == [1] * len(pattern), f"--moe-layer-freq={moe.moe_layer_freq}: Mixtral has an MoE "
                       "block in every layer (--moe-layer-freq 1)"))  # fmt: skip
    elif f.mla:
        checks.append((pattern == [0] * leading_dense + [1] * (len(pattern) - leading_dense),
                       f"--moe-layer-freq={moe.moe_layer_freq}: {f.name}'s dense layers are its first ones "
                       "(first_k_dense_replace), e.g. ([0]*1+[1]*N)"))  # fmt: skip
    if f is QWEN2_MOE:
        checks.append((bool(shared) and moe.moe_shared_expert_gate, "Qwen2-MoE's shared expert and its sigmoid gate "
                       "(--moe-shared-expert-intermediate-size and --moe-shared-expert-gate)"))  # fmt: skip
    elif f.shared:
        width = moe.expert_ffn_width(m) if moe.is_moe else 1
        checks += [
            (not shared or shared % width == 0, f"--moe-shared-expert-intermediate-size={shared}: {f.name}'s shared "
             f"experts are whole experts (a multiple of --moe-ffn-hidden-size={width})"),
            (not moe.moe_shared_expert_gate, f"--moe-shared-expert-gate ({f.name}'s shared experts have no gate)"),
        ]  # fmt: skip
    else:
        checks.append((not shared, f"a shared expert ({f.name} has none)"))
    if f is DEEPSEEK_V3:
        groups = moe.moe_router_group_topk
        checks += [
            (sigmoid, f"--moe-router-score-function={moe.moe_router_score_function} (DeepSeek-V3 routes with "
             "sigmoid scores)"),
            (normalized or moe.moe_router_topk == 1, "top-k weights not renormalised with sigmoid scores "
             "(DeepSeek-V3's norm_topk_prob: drop --no-moe-normalize-topk)"),
            (groups is None or moe.moe_router_topk // groups == 2, f"--moe-router-group-topk={groups}: DeepSeek-V3 "
             f"ranks groups by their top 2 scores, here by the top {moe.moe_router_topk // (groups or 1)}"),
        ]  # fmt: skip
        return checks
    checks.append(
        (moe.moe_router_score_function != "sigmoid", f"--moe-router-score-function=sigmoid ({f.name} routes with "
         "softmax top-k)")
    )  # fmt: skip
    if f is DEEPSEEK_V2:
        groups = moe.moe_router_group_topk
        return checks + [
            (not normalized, "top-k weights renormalised (DeepSeek-V2 takes the softmax over all experts: "
             "--moe-router-pre-softmax)"),
            (groups is None or moe.moe_router_topk // groups == 1, f"--moe-router-group-topk={groups}: DeepSeek-V2 "
             "ranks groups by their best score, here by the top --moe-router-topk / it"),
        ]  # fmt: skip
    checks += [
        (
            scale in (None, 1.0),
            f"--moe-router-topk-scaling-factor={scale} ({f.name} does not scale its weights)",
        ),
        (
            moe.moe_router_group_topk is None,
            f"--moe-router-group-topk={moe.moe_router_group_topk} ({f.name} picks its top-k among all experts)",
        ),
    ]
    if f is MIXTRAL:
        checks.append((normalized, "top-k weights not renormalised (Mixtral renormalises them: drop "
                       "--moe-router-pre-softmax and --no-moe-normalize-topk)"))  # fmt: skip
    else:
        checks.append((normalized or moe.moe_router_pre_softmax, f"--no-moe-normalize-topk ({f.name}'s weights "
                       "are renormalised or the softmax over all experts: --moe-router-pre-softmax)"))  # fmt: skip
    return checks


def check_exportable(cfg: RunConfig) -> Family:
    """The family `cfg` exports as; ConfigError listing what it cannot express."""
    family = family_of(cfg)
    problems = incompatibilities(cfg, family)
    if problems:
        raise ConfigError(f"this model cannot be written as {family.name}:\n  - " + "\n  - ".join(problems))
    return family


def startup_note(cfg: RunConfig) -> str | None:
    """The start-up line of a run that saves (None: nothing is saved): the family `export-hf` would write it as,
    or, for a model it would refuse, what that family cannot express, so that the run's owner learns it when the
    run starts, not when its checkpoint is exported. A note, not a refusal: such a model is a legal run."""
    if not cfg.checkpoint.save:
        return None
    family = family_of(cfg)
    problems = incompatibilities(cfg, family)
    if not problems:
        return f"export-hf writes this model as HuggingFace {family.name} ({family.architecture})"
    return (
        f"note: this model cannot be exported to HuggingFace (convert.py export-hf); as {family.name}, the nearest "
        "family: " + "; ".join(problems)
    )


# ----------------------------------------------------------------------------- config.json


def hf_config(cfg: RunConfig, vocab_size: int, bos_id: int | None, eos_id: int) -> dict:
    """config.json of `cfg`'s family (`check_exportable`'s) for transformers."""
    f = check_exportable(cfg)
    m, moe = cfg.model, cfg.moe
    pattern = moe.layer_pattern(m.num_layers)
    expert = moe.expert_ffn_width(m)
    config = {
        "architectures": [f.architecture],
        "model_type": f.model_type,
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads if f.mla else (m.num_query_groups or m.num_attention_heads),
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
    if f is MIXTRAL:
        return config | {"intermediate_size": expert, "num_local_experts": moe.num_experts, "head_dim": m.head_dim}
    normalized = moe.topk_normalized
    config |= {"intermediate_size": m.ffn_width, "moe_intermediate_size": expert, "norm_topk_prob": normalized}
    if not f.mla:  # Qwen
        config |= {"num_experts": moe.num_experts, "head_dim": m.head_dim, "decoder_sparse_step": 1}
        config |= {"mlp_only_layers": [i for i, is_moe in enumerate(pattern) if not is_moe]}
        config |= {"use_sliding_window": False, "attention_bias": False}
        if f is QWEN2_MOE:
            config |= {"shared_expert_intermediate_size": moe.moe_shared_expert_ffn_hidden_size}
            config |= {"qkv_bias": m.add_qkv_bias}
        return config
    groups = moe.moe_router_group_topk
    config |= {
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": (moe.moe_shared_expert_ffn_hidden_size or 0) // expert,
        "first_k_dense_replace": pattern.index(1),
        "moe_layer_freq": 1,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_head_dim,
        "qk_rope_head_dim": m.qk_pos_emb_head_dim,
        "v_head_dim": m.v_head_dim,
        "routed_scaling_factor": moe.moe_router_topk_scaling_factor or 1.0,
        "n_group": moe.moe_router_num_groups if groups else 1,
        "topk_group": groups or 1,
    }
    if m.mla_rope_type == "yarn":
        config["rope_scaling"] = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": m.rotary_scaling_factor,
            "mscale": m.mscale,
            "mscale_all_dim": m.mscale_all_dim,
            "original_max_position_embeddings": YARN_DEFAULTS["original_max_position_embeddings"],
            "beta_fast": YARN_DEFAULTS["beta_fast"],
            "beta_slow": YARN_DEFAULTS["beta_slow"],
        }
    if f is DEEPSEEK_V2:
        return config | {"topk_method": "group_limited_greedy" if groups else "greedy"}
    return config | {"topk_method": "noaux_tc", "rope_interleave": True, "num_nextn_predict_layers": m.mtp_layers}


YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
"""megatron-core's MLATransformerConfig's YaRN fields that no flag here sets (Megatron-LM's own MLA runs leave
them too): an HF config with other values is refused on import."""


def run_flags_from_hf(config: dict, mtp_layers: int = 0) -> list[str]:
    """Model flags for a megatron_moe run with the architecture of an HF config of one of the families
    (`mtp_layers`: the DeepSeek-V3 MTP layers its checkpoint carries). ConfigError names a field none of our
    flags expresses; KeyError a field it lacks."""
    f = FAMILIES[config["model_type"]]
    rope = _rope(config)
    rope_flags = _rope_flags(rope, f)
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(config["hidden_size"]), "--num-attention-heads", str(heads),
        "--moe-router-topk", str(config["num_experts_per_tok"]),
        "--normalization", "RMSNorm", "--norm-epsilon", str(config.get("rms_norm_eps", 1e-5)), "--swiglu",
        "--position-embedding-type", "rope", "--rotary-base", str(int(rope.get("rope_theta", 10000.0))),
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--seq-length", str(min(config.get("max_position_embeddings", 4096), 4096)),
        "--max-position-embeddings", str(config.get("max_position_embeddings", 4096)),
    ]  # fmt: skip
    if config.get("tie_word_embeddings"):
        raise _unsupported("tie_word_embeddings=true", "an MoE run here unties them")
    if f is MIXTRAL:
        if config.get("head_dim") not in (None, config["hidden_size"] // heads):
            raise _unsupported(f"head_dim={config['head_dim']}", "Mixtral's are hidden_size / heads wide")
        return flags + [
            "--num-query-groups", str(config.get("num_key_value_heads", heads)),
            "--ffn-hidden-size", str(config["intermediate_size"]), "--num-experts", str(config["num_local_experts"]),
            "--moe-layer-freq", "1",
        ]  # fmt: skip
    flags += ["--ffn-hidden-size", str(config["intermediate_size"])]
    flags += ["--moe-ffn-hidden-size", str(config["moe_intermediate_size"])]
    normalized = config.get("norm_topk_prob", False)
    if not f.mla:
        return flags + _qwen_flags(config, f, layers, normalized)
    return flags + rope_flags + _deepseek_flags(config, f, layers, normalized, mtp_layers)


def _qwen_flags(config: dict, f: Family, layers: int, normalized: bool) -> list[str]:
    heads = config["num_attention_heads"]
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if config.get("attention_bias") or config.get("use_sliding_window"):
        what = "attention_bias=true" if config.get("attention_bias") else "use_sliding_window=true"
        raise _unsupported(what, "attention here has no output bias and no sliding window")
    flags = [
        "--num-query-groups", str(config.get("num_key_value_heads", heads)),
        "--kv-channels", str(config.get("head_dim") or config["hidden_size"] // heads),
        "--num-experts", str(config["num_experts"] if "num_experts" in config else config["num_local_experts"]),
        "--moe-layer-freq", str(pattern).replace(" ", ""),
    ]  # fmt: skip
    if not normalized:
        flags.append("--moe-router-pre-softmax")
    if f is QWEN3_MOE:
        return flags + ["--qk-layernorm"]
    flags += ["--moe-shared-expert-intermediate-size", str(config["shared_expert_intermediate_size"])]
    flags.append("--moe-shared-expert-gate")
    return flags + (["--add-qkv-bias"] if config.get("qkv_bias", True) else [])


def _deepseek_flags(config: dict, f: Family, layers: int, normalized: bool, mtp: int) -> list[str]:
    topk, experts = config["num_experts_per_tok"], config["n_routed_experts"]
    dense = config.get("first_k_dense_replace", 0)
    flags = [
        "--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", str(config["kv_lora_rank"]),
        "--qk-head-dim", str(config["qk_nope_head_dim"]), "--qk-pos-emb-head-dim", str(config["qk_rope_head_dim"]),
        "--v-head-dim", str(config["v_head_dim"]), "--num-experts", str(experts),
        "--moe-layer-freq", str([0] * dense + [1] * (layers - dense)).replace(" ", ""),
    ]  # fmt: skip
    if config.get("q_lora_rank"):
        flags += ["--q-lora-rank", str(config["q_lora_rank"])]
    if config.get("n_shared_experts"):
        flags += [
            "--moe-shared-expert-intermediate-size",
            str(config["n_shared_experts"] * config["moe_intermediate_size"]),
        ]
    scale = config.get("routed_scaling_factor", 1.0)
    if scale != 1.0:
        flags += ["--moe-router-topk-scaling-factor", str(scale)]
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    if f is DEEPSEEK_V2:
        flags.append("--moe-router-pre-softmax")
        if config.get("topk_method", "greedy") == "group_limited_greedy" and groups > 1:
            if topk // group_topk != 1:
                why = "DeepSeek-V2 ranks groups by their best score, ours by the top num_experts_per_tok / topk_group"
                raise _unsupported(f"topk_group={group_topk} with num_experts_per_tok={topk}", why)
            flags += ["--moe-router-num-groups", str(groups), "--moe-router-group-topk", str(group_topk)]
        return flags
    if config.get("rope_interleave", True) is False:
        raise _unsupported("rope_interleave=false", "MLA here rotates interleaved pairs, as DeepSeek-V3 does")
    flags += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    if not normalized and topk > 1:
        flags.append("--no-moe-normalize-topk")
    if groups > 1:
        if topk // group_topk != 2:
            why = "DeepSeek-V3 ranks groups by their top 2 scores, our router by num_experts_per_tok / topk_group"
            raise _unsupported(f"topk_group={group_topk} with num_experts_per_tok={topk}", why)
        flags += ["--moe-router-num-groups", str(groups), "--moe-router-group-topk", str(group_topk)]
    return flags + (["--mtp-num-layers", str(mtp)] if mtp else [])


def _rope(config: dict) -> dict:
    """The RoPE parameters: transformers 5's `rope_parameters`, else the published `rope_theta` / `rope_scaling`."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _rope_flags(rope: dict, f: Family) -> list[str]:
    """MLA's --rope-type (and YaRN's flags); nothing for the other families, whose RoPE is unscaled here."""
    kind = rope["rope_type"]
    if not f.mla:
        if kind != "default":
            raise _unsupported(f"rope_type={kind!r}", f"{f.name}'s RoPE here is unscaled: 'default'")
        return []
    if kind == "default":
        return ["--rope-type", "rope"]
    if kind != "yarn":
        raise _unsupported(f"rope_type={kind!r}", "MLA here takes 'default' or 'yarn'")
    for name, default in YARN_DEFAULTS.items():
        if rope.get(name, default) != default:
            raise _unsupported(f"YaRN's {name}={rope[name]}", f"no flag here sets it from {default}")
    return [
        "--rope-type", "yarn", "--rotary-scaling-factor", str(rope["factor"]),
        "--mscale", str(rope.get("mscale", 1.0)), "--mscale-all-dim", str(rope.get("mscale_all_dim", 0.0)),
    ]  # fmt: skip


def _unsupported(what: str, why: str) -> ConfigError:
    """A config.json field no flag here expresses (`read_hf_config` names the file)."""
    return ConfigError(f"{what}: not supported ({why})")


HF_DIRECTORY = (
    f"an HF model directory of model_type {MODEL_TYPES} (config.json, *.safetensors, tokenizer.model or tokenizer.json)"
)


def read_hf_config(hf_dir: str) -> dict:
    """`hf_dir`'s config.json, refused in one line (the file, what is wrong, what is valid) unless it describes an
    HF model of one of the families whose architecture flags can be read."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"--load={hf_dir}: no such directory; give {HF_DIRECTORY}")
    if not os.path.isfile(path):
        raise ConfigError(f"--load={hf_dir}: no config.json there; give {HF_DIRECTORY}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        where = f"line {error.lineno} column {error.colno}: {error.msg}" if hasattr(error, "lineno") else str(error)
        raise ConfigError(
            f"--load={hf_dir}: {path} is not valid JSON ({where}); give the config.json of an HF model"
        ) from None
    if not isinstance(config, dict) or config.get("model_type") not in FAMILIES:
        found = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise ConfigError(f"--load={hf_dir}: {path} has model_type={found!r}; these import: {MODEL_TYPES}")
    family = FAMILIES[config["model_type"]].name
    try:
        run_flags_from_hf(config)
    except KeyError as error:
        missing = f"--load={hf_dir}: {path} lacks {error}"
        raise ConfigError(f"{missing}; give the config.json of an HF {family} model") from None
    except ConfigError as error:
        raise ConfigError(f"--load={hf_dir}: {path}: {error}") from None
    return config
