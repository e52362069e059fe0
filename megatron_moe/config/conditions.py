"""When a flag changes what runs: the `applies=` conditions of the flag groups (see `fields.When`).

Each test takes the whole RunConfig. A flag the user gives while its
condition is false does nothing, so the parser says so in a start-up line, naming the
condition (`fields.flags_that_change_nothing`).
"""

from __future__ import annotations

from megatron_moe.config.fields import When
from megatron_moe.config.gate_traits import BALANCED_GATES, GATE_TRAITS, OWN_ORDER_GATES

MOE = When(lambda c: c.moe.is_moe, "with --num-experts")
OUR_MOE = When(lambda c: c.moe.own_layer, "with --num-experts and our layer (--moe-layer-impl megatron_moe)")
EXPERT_PARALLEL = When(
    lambda c: c.moe.own_layer and c.parallel.expert_model_parallel_size > 1,
    "with our MoE layer and --expert-model-parallel-size > 1 (no all-to-all otherwise)",
)
EXPERT_GROUPS = When(
    lambda c: c.moe.is_moe and c.parallel.expert_model_parallel_size > 1,
    "with --num-experts and --expert-model-parallel-size > 1 (no expert-parallel groups to place otherwise)",
)
SHARED_EXPERT = When(
    lambda c: c.moe.is_moe and bool(c.moe.moe_shared_expert_ffn_hidden_size),
    "with --num-experts and --moe-shared-expert-ffn-hidden-size (a shared expert to gate)",
)
MCORE_MOE = When(lambda c: c.moe.is_moe and not c.moe.own_layer, "with --num-experts and --moe-layer-impl mcore")


def _gate_is(c, trait: str, value: bool = True) -> bool:
    """The run's gate's `trait` (`GATE_TRAITS`) is `value` (an unknown gate, refused by the rules, has none)."""
    traits = GATE_TRAITS.get(c.moe.gate)
    return traits is not None and getattr(traits, trait) is value


def _our_gate_is(c, trait: str, value: bool = True) -> bool:
    """Our layer runs, and its gate's `trait` is `value`."""
    return c.moe.own_layer and _gate_is(c, trait, value)


_BALANCED = "/".join(BALANCED_GATES)
TOKEN_PICKING = When(
    lambda c: c.moe.is_moe and not _our_gate_is(c, "token_picking", False),
    "with --num-experts, not with --moe-gate soft",
)
BALANCING_TYPE = When(
    lambda c: c.moe.is_moe and not _our_gate_is(c, "balanced"),
    f"with --num-experts, not with --moe-gate {_BALANCED} (they balance by construction)",
)
BALANCING = When(
    lambda c: BALANCING_TYPE.test(c) and c.moe.moe_router_load_balancing_type not in ("none", "sinkhorn"),
    f"with a balancing loss: --moe-router-load-balancing-type other than none or sinkhorn, not --moe-gate {_BALANCED}",
)
Z_LOSS = When(
    lambda c: c.moe.is_moe and not _our_gate_is(c, "router_logits", False),
    "with --num-experts, not with --moe-gate soft (it has no router logits)",
)
PADDING = When(
    lambda c: c.moe.own_layer or (c.moe.is_moe and (c.moe.moe_expert_capacity_factor or 0) > 0),
    "with --num-experts and our layer, or with --moe-layer-impl mcore and a positive --moe-expert-capacity-factor",
)
NORMALIZING = When(
    lambda c: c.moe.moe_router_topk > 1 and _our_gate_is(c, "normalizes"),
    "with our layer, --moe-router-topk > 1 and a top-k gate (not switch, expert_choice, soft)",
)
SCORE_FUNCTION = When(
    lambda c: c.moe.is_moe and (not c.moe.own_layer or c.moe.moe_gate in ("topk", "sigmoid")),
    "with --num-experts and --moe-gate topk or sigmoid (or --moe-layer-impl mcore)",
)
PRE_SOFTMAX = When(
    lambda c: (
        (MCORE_MOE.test(c) and c.moe.moe_router_score_function != "sigmoid")
        or (NORMALIZING.test(c) and c.moe.gate != "sigmoid")
    ),
    "with softmax scores and --moe-router-topk > 1 (our layer: a softmax top-k gate)",
)
TOKEN_CHOICE = When(
    lambda c: MCORE_MOE.test(c) or _our_gate_is(c, "balanced", False),
    f"with --num-experts, not with --moe-gate {_BALANCED}",
)
DROPPING = When(
    lambda c: (
        (c.moe.moe_expert_capacity_factor or 0) > 0 and (MCORE_MOE.test(c) or _our_gate_is(c, "own_order", False))
    ),
    "with a positive --moe-expert-capacity-factor (tokens dropped), not with --moe-gate " + "/".join(OWN_ORDER_GATES),
)
EXPERT_BIAS = When(
    lambda c: c.moe.is_moe and c.moe.moe_router_enable_expert_bias, "with --moe-router-enable-expert-bias"
)
GROUP_TOPK = When(
    lambda c: c.moe.is_moe and (not c.moe.own_layer or _gate_is(c, "group_limited")),
    "with --num-experts and a top-k gate: --moe-gate topk or sigmoid (or --moe-layer-impl mcore)",
)
GROUP_LIMITED = When(
    lambda c: GROUP_TOPK.test(c) and c.moe.moe_router_group_topk is not None, "with --moe-router-group-topk"
)
PROJECTING = When(lambda c: _our_gate_is(c, "projecting"), "with --moe-gate xmoe or cosine")
SOFT = When(lambda c: _our_gate_is(c, "slots"), "with --moe-gate soft")

MUON = When(lambda c: c.training.uses_muon, "with --optimizer muon")
DISTRIBUTED_OPTIMIZER = When(lambda c: c.parallel.use_distributed_optimizer, "with --use-distributed-optimizer")
PIPELINE_PARALLEL = When(
    lambda c: c.parallel.pipeline_model_parallel_size > 1, "with --pipeline-model-parallel-size > 1"
)
ADAPTIVE_GRAD_REDUCE_POSSIBLE = When(
    lambda c: (
        c.parallel.grad_reduce_schedule != "adaptive"
        or (
            c.parallel.virtual_pipeline_size(c.model.num_layers) is None
            and c.parallel.num_distributed_optimizer_instances == 1
        )
    ),
    "without the interleaved pipeline (--num-virtual-stages-per-pipeline-rank / "
    "--num-layers-per-virtual-pipeline-stage): megatron-core's interleaved schedule starts each model chunk's "
    "reduction after the chunk's last micro-batch, and chunks after the first have one bucket; and with one "
    "--num-distributed-optimizer-instances (several reduce within, then all-reduce across, instances in one "
    "step of megatron-core's own); use --grad-reduce-schedule megatron",
)
TENSOR_PARALLEL = When(lambda c: c.parallel.tensor_model_parallel_size > 1, "with --tensor-model-parallel-size > 1")

DECAYING = When(lambda c: c.training.lr_decay_style != "constant", "with a --lr-decay-style other than constant")
WARMUP = When(
    lambda c: bool(c.training.lr_warmup_iters or c.training.lr_warmup_samples or c.training.lr_warmup_fraction),
    "with a learning-rate warm-up (--lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction)",
)
WSD = When(lambda c: c.training.lr_decay_style == "WSD", "with --lr-decay-style WSD")
MIXED_PRECISION = When(lambda c: c.training.fp16 or c.training.bf16, "with --fp16 or --bf16")
DYNAMIC_SCALE = When(
    lambda c: c.training.fp16 and c.training.loss_scale is None,
    "with --fp16 and no --loss-scale (dynamic loss scaling)",
)

ROPE = When(lambda c: c.model.position_embedding_type == "rope", "with --position-embedding-type rope")
MLA = When(lambda c: c.model.multi_latent_attention, "with --multi-latent-attention")
NOT_MLA = When(
    lambda c: not c.model.multi_latent_attention,
    "without --multi-latent-attention (MLA's heads are --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim wide)",
)
MLA_YARN = When(
    lambda c: c.model.multi_latent_attention and c.model.mla_rope_type == "yarn",
    "with --multi-latent-attention and YaRN RoPE (--rope-type yarn, or unset)",
)
MTP = When(lambda c: bool(c.model.mtp_num_layers), "with --mtp-num-layers > 0 (multi-token prediction)")

MCORE_MLP = When(
    lambda c: not c.moe.own_layer or 0 in c.moe.layer_pattern(c.model.num_layers),
    "with a megatron-core MLP: a dense layer (--moe-layer-freq), a dense model, or --moe-layer-impl mcore",
)
BIAS_GELU = When(
    lambda c: MCORE_MLP.test(c) and not c.model.swiglu and not c.model.disable_bias_linear and not MCORE_MOE.test(c),
    "with a megatron-core GELU MLP (not --swiglu) that has biases (not --disable-bias-linear; megatron-core fuses "
    "GELU only with its bias) and no megatron-core MoE layer (--moe-layer-impl mcore: its experts fuse SwiGLU only)",
)
BIAS_SWIGLU = When(lambda c: MCORE_MLP.test(c) and c.model.swiglu, "with --swiglu and a megatron-core MLP")
WEIGHT_GRADS_NOT_DEFERRED = When(
    lambda c: c.moe.wgrad_policy(c.parallel.expert_model_parallel_size) == "off",
    "without weight gradients deferred by --overlap-wgrad (our MoE layer at EP > 1 defers them unless it is off; the "
    "fusion stays off while they are)",
)

QUANTIZING = When(
    lambda c: bool(c.activations.quantize_activations) or c.activations.activation_policy == "arctic",
    "with --quantize-activations or --activation-policy arctic",
)

GPT2_BPE = When(lambda c: c.data.tokenizer_type == "GPT2BPETokenizer", "with --tokenizer-type GPT2BPETokenizer")
NULL_TOKENIZER = When(lambda c: c.data.tokenizer_type == "NullTokenizer", "with --tokenizer-type NullTokenizer")
TOKENIZER_MODEL = When(
    lambda c: c.data.tokenizer_type not in ("GPT2BPETokenizer", "NullTokenizer"),
    "with --tokenizer-type SentencePieceTokenizer or HuggingFaceTokenizer",
)

REAL_DATA = When(
    lambda c: not c.data.mock_data,
    "with --data-path: megatron-core splits --mock-data's documents evenly, 1,1,1, as in Megatron-LM",
)

TENSORBOARD = When(lambda c: c.logging.tensorboard_dir is not None, "with --tensorboard-dir")
WANDB = When(lambda c: c.logging.wandb_project is not None, "with --wandb-project")
SAVING = When(lambda c: c.checkpoint.save is not None, "with --save")
LOADING = When(lambda c: c.checkpoint.load is not None, "with --load")
