"""The configuration of a pretraining run, one keyword-only dataclass per flag group.

Every field becomes a Megatron-style flag (`num_layers` -> `--num-layers`);
see `fields.add_arguments`. `validate()` on each group checks what the group
can check alone; `RunConfig.validate(world_size)` checks what needs the
whole picture (layout divisibility, batch sizes).
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config import conditions as only
from megatron_moe.config.activation_policy import QUANT_FORMATS
from megatron_moe.config.fields import arg, require, require_fraction, require_non_negative, require_positive
from megatron_moe.config.moe_layer import DROP_POLICIES, GATES, ORDERINGS, MoELayerConfig, parse_degree

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
"""Megatron-LM's --tokenizer-type names this stack builds (megatron_moe/data/tokenizer/)."""
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""megatron-core's OptimizerParamScheduler's decay styles (Megatron-LM's --lr-decay-style)."""
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
MCORE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
"""megatron-core's MoE layer's --moe-router-load-balancing-type choices (as this CLI offers them)."""


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Transformer shape: layers, width, attention, positions, norms, activation."""

    num_layers: int = arg(4, "transformer layers")
    hidden_size: int = arg(256, "model width")
    ffn_hidden_size: int | None = arg(None, "dense MLP width (default 4 x hidden)")
    num_attention_heads: int = arg(4, "attention heads")
    num_query_groups: int | None = arg(None, "key/value head groups for GQA (default: MHA)")
    seq_length: int = arg(256, "tokens per sample")
    max_position_embeddings: int | None = arg(
        None, "learned-position table size; with RoPE, the context length HuggingFace exports record (default seq)"
    )
    position_embedding_type: str = arg("rope", "position encoding", choices=("rope", "learned_absolute"))
    rotary_base: int = arg(10000, "RoPE base", applies=only.ROPE)
    normalization: str = arg("LayerNorm", "norm layer", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "norm epsilon")
    swiglu: bool = arg(False, "SwiGLU MLPs and experts instead of GELU")
    disable_bias_linear: bool = arg(False, "no biases in linear layers (Mixtral-style)")
    untie_embeddings_and_output_weights: bool = arg(False, "separate output layer weights")
    hidden_dropout: float = arg(0.0, "dropout after attention and MLP")
    attention_dropout: float = arg(0.0, "dropout on attention probabilities")
    attention_softmax_in_fp32: bool = arg(
        False, "attention's softmax in fp32 under half precision (else in bf16/fp16)", applies=only.MIXED_PRECISION
    )
    init_method_std: float = arg(0.02, "std of the normal weight init")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this (a multiple of TP)")
    transformer_impl: str | None = arg(
        None,
        "the layers' attention and linears (the norms are always ours): local (megatron-core's own modules) or "
        "transformer_engine (needs transformer-engine on a GPU); unset: transformer_engine where it is installed on "
        "a GPU, else local",
        choices=("local", "transformer_engine"),
    )
    use_flash_attn: bool = arg(
        False,
        "flash attention (transformer-engine's flash backend; megatron-core's local attention has no flash kernel)",
    )
    # megatron-core's fusions are on where the platform has their kernels (megatron_moe.model.fusions); these turn
    # one off, as Megatron-LM's flags of the same names do.
    no_bias_gelu_fusion: bool = arg(False, "unfused bias + GELU in megatron-core's MLP", applies=only.BIAS_GELU)
    no_bias_swiglu_fusion: bool = arg(False, "unfused bias + SwiGLU in megatron-core's MLP", applies=only.BIAS_SWIGLU)
    no_bias_dropout_fusion: bool = arg(False, "unfused bias + dropout + residual add after attention and MLP")
    no_masked_softmax_fusion: bool = arg(
        False, "unfused scale + causal mask + softmax in megatron-core's attention", applies=only.MIXED_PRECISION
    )
    no_rope_fusion: bool = arg(False, "unfused rotary position embedding", applies=only.ROPE)
    no_gradient_accumulation_fusion: bool = arg(
        False,
        "weight gradients computed, then added to the fp32 gradient buffer (not accumulated into it by the GEMM)",
        applies=only.WEIGHT_GRADS_NOT_DEFERRED,
    )

    @property
    def ffn_width(self) -> int:
        """The dense MLP's width: --ffn-hidden-size, else 4 x hidden (the one home of that default)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    def validate(self) -> None:
        for flag, value, example in (
            ("--num-layers", self.num_layers, 4),
            ("--hidden-size", self.hidden_size, 256),
            ("--ffn-hidden-size", self.ffn_hidden_size, 1024),
            ("--num-attention-heads", self.num_attention_heads, 4),
            ("--num-query-groups", self.num_query_groups, 1),
            ("--seq-length", self.seq_length, 256),
            ("--max-position-embeddings", self.max_position_embeddings, self.seq_length),
            ("--rotary-base", self.rotary_base, 10000),
            ("--norm-epsilon", self.norm_epsilon, 1e-5),
            ("--init-method-std", self.init_method_std, 0.02),
            ("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by, 128),
        ):
            require_positive(flag, value, example)
        require_fraction("--hidden-dropout", self.hidden_dropout, 0.1)
        require_fraction("--attention-dropout", self.attention_dropout, 0.1)
        if self.position_embedding_type == "learned_absolute" and self.max_position_embeddings is not None:
            require(
                self.seq_length <= self.max_position_embeddings,
                "--seq-length",
                self.seq_length,
                f"must be <= --max-position-embeddings={self.max_position_embeddings} (the learned-position table)",
            )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "--hidden-size",
            self.hidden_size,
            f"must be a multiple of --num-attention-heads={self.num_attention_heads}",
        )
        if self.num_query_groups is not None:
            require(
                self.num_attention_heads % self.num_query_groups == 0,
                "--num-query-groups",
                self.num_query_groups,
                f"must divide --num-attention-heads={self.num_attention_heads}",
            )


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    """Mixture of experts: how many experts, how tokens are routed, where MoE layers sit."""

    num_experts: int | None = arg(None, "experts per MoE layer (unset: a dense model)")
    moe_router_topk: int = arg(2, "experts per token", applies=only.TOKEN_PICKING)
    moe_layer_freq: str = arg(
        "1",
        "MoE every N layers (N, e.g. 2 = every other layer) or a 0/1 pattern like '[1,0,1,0]'",
        applies=only.MOE,
    )
    moe_ffn_hidden_size: int | None = arg(None, "expert MLP width (default --ffn-hidden-size)", applies=only.MOE)
    moe_aux_loss_coeff: float = arg(0.01, "load-balancing loss weight", applies=only.BALANCING)
    moe_z_loss_coeff: float | None = arg(None, "router z-loss weight (unset: off)", applies=only.Z_LOSS)
    moe_router_load_balancing_type: str = arg(
        "aux_loss",
        "balancing loss E x sum_e f_e x P_e (f_e: share of routed choices on expert e, P_e: its mean router "
        "probability): aux_loss (all k choices counted), top1_aux_loss (the first choice only, GShard), none; "
        "seq_aux_loss only with --moe-layer-impl mcore",
        choices=("aux_loss", "top1_aux_loss", "seq_aux_loss", "none"),
        applies=only.BALANCING_TYPE,
    )
    moe_expert_capacity_factor: float | None = arg(
        None,
        "Tutel semantics: > 0 fixed (drop overflow), 0 or unset dropless, < 0 dropless capped at |f|; "
        "C = ceil(|f| x topk x tokens / experts) per expert per EP rank",
        applies=only.MOE,
    )
    moe_pad_expert_input_to_capacity: bool = arg(
        False,
        "pad every expert's rows from every EP rank to the capacity C (the experts run one batched GEMM); "
        "without a capacity factor (dropless) C is the step's largest count over the EP group",
        applies=only.PADDING,
    )
    moe_token_dispatcher_type: str = arg(
        "alltoall",
        "token dispatch: alltoall (all-to-all over EP, exact rows unless padded); allgather only with "
        "--moe-layer-impl mcore",
        choices=("alltoall", "allgather"),
        applies=only.MOE,
    )
    moe_gate: str = arg("topk", "routing function", choices=GATES, applies=only.OUR_MOE)
    moe_ordering: str = arg(
        "sparse",
        "token layout: sparse (index gather/scatter) or dense (GShard einsum, always padded to capacity)",
        choices=ORDERINGS,
        applies=only.OUR_MOE,
    )
    moe_shared_expert_ffn_hidden_size: int | None = arg(
        None, "width of a dense MLP beside the experts (unset: none)", applies=only.OUR_MOE
    )
    moe_pipeline_degree: str = arg(
        "auto",
        "FSMoE's pipeline: the dispatched rows in this many chunks in forward, chunk i's experts running while "
        "chunk i+1's all-to-all is in flight; an integer >= 1 (1: not pipelined) or auto (the cost model's choice "
        "from the cluster's profile, --moe-cost-profile; 1 where EP = ESP = 1)",
        applies=only.OUR_MOE,
    )
    moe_bp_pipeline_degree: str = arg(
        "auto",
        "the pipeline's chunks in backward (its own schedule): an integer >= 1 or auto",
        applies=only.OUR_MOE,
    )
    moe_cost_profile: str | None = arg(
        None,
        "FSMoE's cost-model fits (JSON; tools/profile_cluster.py writes one) that resolve the pipeline degrees' "
        "auto: loaded when the cluster it describes is this run's, else measured at start-up and saved there "
        "(unset: <--save>/cost_profile.json, or measured and not saved without --save)",
        applies=only.OUR_MOE,
    )
    moe_normalize_topk: bool = arg(True, "rescale the k chosen gate scores to sum to 1", applies=only.NORMALIZING)
    moe_router_score_function: str | None = arg(
        None,
        "Megatron-LM's router score: softmax (--moe-gate topk) or sigmoid (--moe-gate sigmoid); unset: --moe-gate",
        choices=("softmax", "sigmoid"),
        applies=only.SCORE_FUNCTION,
    )
    moe_router_pre_softmax: bool = arg(
        False,
        "Megatron-LM's pre-softmax: the k weights are the softmax over all experts, not renormalised over the k "
        "(here: --no-moe-normalize-topk)",
        applies=only.PRE_SOFTMAX,
    )
    moe_router_topk_scaling_factor: float | None = arg(
        None, "multiply the k combine weights by this (DeepSeek-V3: 2.5)", applies=only.TOKEN_CHOICE
    )
    moe_token_drop_policy: str | None = arg(
        None,
        "over capacity, which pairs an expert keeps: probs (the highest weights) or position (the earliest "
        "tokens), as Megatron-LM; unset: the gate's claim order (k-major, every first choice before any second)",
        choices=DROP_POLICIES,
        applies=only.DROPPING,
    )
    moe_router_dim: int | None = arg(
        None, "projection width of the xmoe/cosine gates (default 16 / 256)", applies=only.PROJECTING
    )
    moe_soft_slots: int = arg(1, "slots per expert of --moe-gate soft", applies=only.SOFT)
    overlap_wgrad: str = arg(
        "greedy",
        "Lancet: weight-gradient GEMMs run under the backward all-to-alls. greedy: iteration 2 is timed and "
        "Lancet's best-fit plan (Algorithm 1) runs from iteration 3 (nothing deferred where nothing hides); "
        "all-under-next-a2a: every dW under the next all-to-all; off. Bit-identical gradients either way",
        choices=("off", "greedy", "all-under-next-a2a"),
        applies=only.EXPERT_PARALLEL,
    )
    overlap_wgrad_max_mb: float = arg(
        1024.0,
        "--overlap-wgrad: at most this many MiB held by queued weight-gradient inputs at once (0: no cap); "
        "a dW that would exceed it runs at its natural place",
        applies=only.EXPERT_PARALLEL,
    )
    overlap_wgrad_report: bool = arg(
        False,
        "--overlap-wgrad greedy: log the plan (which dW under which all-to-all, predicted hidden time)",
        applies=only.EXPERT_PARALLEL,
    )
    moe_layer_impl: str = arg(
        "megatron_moe",
        "MoE layer: ours or megatron-core's (the layer benchmark's reference)",
        choices=("megatron_moe", "mcore"),
        applies=only.MOE,
    )
    moe_grouped_gemm: bool = arg(
        False, "megatron-core's grouped-GEMM experts (needs the grouped_gemm package)", applies=only.MCORE_MOE
    )

    def expert_ffn_width(self, model: ModelConfig) -> int:
        """One routed expert's MLP width: --moe-ffn-hidden-size, else the dense MLP's (`ModelConfig.ffn_width`)."""
        return self.moe_ffn_hidden_size or model.ffn_width

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def own_layer(self) -> bool:
        """True when the MoE layers are megatron_moe's (not megatron-core's)."""
        return self.is_moe and self.moe_layer_impl == "megatron_moe"

    @property
    def gate(self) -> str:
        """Our layer's gate: --moe-gate, or the one --moe-router-score-function names (sigmoid: the sigmoid gate)."""
        return "sigmoid" if self.moe_router_score_function == "sigmoid" else self.moe_gate

    def wgrad_policy(self, expert_parallel_size: int) -> str:
        """--overlap-wgrad in force: off without an all-to-all to hide under (EP=1, megatron-core's layer)."""
        return self.overlap_wgrad if self.own_layer and expert_parallel_size > 1 else "off"

    def layer_pattern(self, num_layers: int) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, per layer."""
        text = self.moe_layer_freq.strip()
        if text.startswith("["):
            try:
                pattern = [int(x) for x in text.strip("[]").split(",")]
            except ValueError:
                pattern = []
            require(
                len(pattern) == num_layers and set(pattern) <= {0, 1},
                "--moe-layer-freq",
                text,
                f"a list of {num_layers} zeros and ones, e.g. [1,0,1,0]",
            )
            return pattern
        require(text.isdigit() and int(text) > 0, "--moe-layer-freq", text, "a positive integer or a 0/1 list")
        return [1 if i % int(text) == 0 else 0 for i in range(num_layers)]

    def layer_config(self, model: ModelConfig, seed: int | None = None) -> MoELayerConfig:
        """Our MoE layer's config from the run's flags: the one place flags become a MoELayerConfig (`seed`:
        --seed, for the experts' initial weights; None where the layer is only measured or checked)."""
        return MoELayerConfig(
            **({} if seed is None else {"init_seed": seed}),
            num_experts=self.num_experts,
            hidden_size=model.hidden_size,
            ffn_hidden_size=self.expert_ffn_width(model),
            topk=self.moe_router_topk,
            gate=self.gate,
            capacity_factor=self.moe_expert_capacity_factor,
            ordering=self.moe_ordering,
            pad_expert_input_to_capacity=self.moe_pad_expert_input_to_capacity,
            expert_type="swiglu" if model.swiglu else "gelu",
            shared_expert_ffn_hidden_size=self.moe_shared_expert_ffn_hidden_size,
            load_balancing=self.moe_router_load_balancing_type,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            z_loss_coeff=self.moe_z_loss_coeff or 0.0,
            normalize_topk=self.moe_normalize_topk and not self.moe_router_pre_softmax,
            topk_scaling_factor=self.moe_router_topk_scaling_factor,
            drop_policy=self.moe_token_drop_policy,
            router_dim=self.moe_router_dim,
            soft_slots=self.moe_soft_slots,
            pipeline_degree=parse_degree(self.moe_pipeline_degree),
            bp_pipeline_degree=parse_degree(self.moe_bp_pipeline_degree),
            init_method_std=model.init_method_std,
        )

    def logged_router_losses(self, model: ModelConfig) -> tuple[bool, bool]:
        """(balancing loss, z-loss): whether the MoE layers compute each, so the log shows it (not a 0)."""
        if not self.is_moe:
            return False, False
        if self.own_layer:
            layer = self.layer_config(model)
            return layer.has_balancing_loss, layer.has_z_loss
        # megatron-core computes (and tracks) a balancing loss only with a positive coefficient.
        balancing = self.moe_router_load_balancing_type != "none" and self.moe_aux_loss_coeff > 0
        return balancing, bool(self.moe_z_loss_coeff)

    def validate(self, model: ModelConfig) -> None:
        if not self.is_moe:
            return
        require_positive("--num-experts", self.num_experts, 8)
        require_positive("--moe-ffn-hidden-size", self.moe_ffn_hidden_size, 1024)
        require_positive("--moe-shared-expert-ffn-hidden-size", self.moe_shared_expert_ffn_hidden_size, 1024)
        require_positive("--moe-router-dim", self.moe_router_dim, 16)
        require_positive("--moe-soft-slots", self.moe_soft_slots, 1)
        require_non_negative("--moe-aux-loss-coeff", self.moe_aux_loss_coeff, 0.01)
        require_non_negative("--moe-z-loss-coeff", self.moe_z_loss_coeff, 0.001)
        require_non_negative("--overlap-wgrad-max-mb", self.overlap_wgrad_max_mb, 1024)
        require(
            0 < self.moe_router_topk <= self.num_experts,
            "--moe-router-topk",
            self.moe_router_topk,
            f"must be between 1 and --num-experts={self.num_experts}",
        )
        self.layer_pattern(model.num_layers)
        if self.own_layer and self.moe_router_score_function is not None:
            picks = {"softmax": "topk", "sigmoid": "sigmoid"}[self.moe_router_score_function]
            require(
                self.moe_gate in ("topk", picks),
                "--moe-router-score-function",
                self.moe_router_score_function,
                f"selects --moe-gate {picks}, not --moe-gate {self.moe_gate}; drop one of the two",
            )
        if self.own_layer:
            require(
                self.moe_token_dispatcher_type == "alltoall",
                "--moe-token-dispatcher-type",
                self.moe_token_dispatcher_type,
                "megatron_moe's layer dispatches with alltoall (allgather only with --moe-layer-impl mcore)",
            )
            self.layer_config(model).validate()  # names the flag, value and a valid choice
            return
        require(
            self.moe_router_load_balancing_type in MCORE_LOAD_BALANCING,
            "--moe-router-load-balancing-type",
            self.moe_router_load_balancing_type,
            f"megatron-core's layer (--moe-layer-impl mcore) implements {', '.join(MCORE_LOAD_BALANCING)}",
        )
        require(
            not self.moe_pad_expert_input_to_capacity or (self.moe_expert_capacity_factor or 0) > 0,
            "--moe-pad-expert-input-to-capacity",
            True,
            "megatron-core's layer pads only to a positive --moe-expert-capacity-factor",
        )


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Model parallelism: tensor (TP), pipeline (PP), expert (EP), context (CP); DP is what remains."""

    tensor_model_parallel_size: int = arg(1, "TP: ranks that split each weight matrix")
    pipeline_model_parallel_size: int = arg(1, "PP: pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None,
        "interleaved pipeline (Megatron-LM's): layers per virtual stage; each pipeline rank holds (layers / PP) / N "
        "model chunks and megatron-core's interleaved 1F1B runs them (unset: one chunk per rank)",
        applies=only.PIPELINE_PARALLEL,
    )
    num_virtual_stages_per_pipeline_rank: int | None = arg(
        None,
        "interleaved pipeline (Megatron-LM's): model chunks (virtual stages) per pipeline rank, each of layers / "
        "(PP x N) layers; the other way to say --num-layers-per-virtual-pipeline-stage (unset: one chunk per rank)",
        applies=only.PIPELINE_PARALLEL,
    )
    expert_model_parallel_size: int = arg(1, "EP: ranks that split the experts", applies=only.MOE)
    expert_tensor_parallel_size: int | None = arg(
        None,
        "ESP (expert-sharded parallelism, megatron-core's expert tensor parallelism): ranks that split each "
        "expert's FFN width, consecutive ranks (inside a node); tokens are all-gathered over them before the "
        "experts and reduce-scattered after, the EP all-to-all runs between these groups (default 1)",
        applies=only.MOE,
    )
    context_parallel_size: int = arg(1, "CP: ranks that split the sequence in attention")
    sequence_parallel: bool = arg(
        False, "shard norms/dropout activations over TP (needed for MoE with TP>1)", applies=only.TENSOR_PARALLEL
    )
    use_distributed_optimizer: bool = arg(False, "shard optimizer state over data-parallel ranks")
    overlap_grad_reduce: bool = arg(
        False,
        "start each gradient bucket's data-parallel reduce as soon as its last gradient is in (megatron-core DDP), "
        "under the rest of the last micro-batch's backward; where the adaptive --grad-reduce-schedule is in force "
        "its planned buckets overlap whether given or not",
    )
    overlap_param_gather: bool = arg(
        False,
        "all-gather the updated parameters bucket by bucket under the next forward instead of after the step "
        "(megatron-core DDP); composes with --overlap-grad-reduce, --grad-reduce-schedule and --overlap-wgrad, "
        "which act in backward",
        applies=only.DISTRIBUTED_OPTIMIZER,
    )
    ddp_bucket_size: int | None = arg(
        None,
        "parameters per megatron-core DDP gradient bucket with --overlap-grad-reduce (unset: megatron-core's "
        "default, max(40M, 1M x DP)); the adaptive --grad-reduce-schedule sets its own",
    )
    grad_reduce_schedule: str = arg(
        "adaptive",
        "where the data-parallel gradient reduction runs: megatron (megatron-core DDP's buckets, reduced after "
        "backward or, with --overlap-grad-reduce, when each is ready) or adaptive (FSMoE's gradient partition: "
        "each MoE layer's backward launches the share the cost model gives it; in force with our MoE layer, "
        "EP > 1 and a reduction across data-parallel ranks, else megatron)",
        choices=("megatron", "adaptive"),
        applies=only.ADAPTIVE_GRAD_REDUCE_POSSIBLE,
    )
    distributed_timeout_minutes: float = arg(
        10.0,
        "Megatron-LM's process-group timeout: a collective blocked this long while every peer is alive (a slow "
        "or stalled network) ends the job with the watchdog's report naming it and the peers that have not "
        "arrived (every process group's own timeout is 1 minute later); a peer that stopped ends it sooner, "
        "see --dead-peer-seconds",
    )
    stall_report_seconds: float | None = arg(
        None,
        "log which collective a rank is blocked in, and which peers have not arrived, after this many seconds "
        "(and again every as many more); unset: 30, or a quarter of --distributed-timeout-minutes when that is "
        "shorter; not a Megatron-LM flag",
    )
    dead_peer_seconds: float | None = arg(
        None,
        "end the job when a rank is blocked on a peer that has sent no heartbeat for this many seconds (the peer "
        "is stopped, hung or dead: the collective cannot finish), without waiting for --distributed-timeout-"
        "minutes; unset: 5 x --stall-report-seconds (150 s by default); not a Megatron-LM flag",
    )

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def virtual_pipeline_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank (megatron-core's virtual_pipeline_model_parallel_size) from either
        interleaved-pipeline flag; None without an interleaved pipeline (also for 1 chunk: plain 1F1B)."""
        chunks = self.num_virtual_stages_per_pipeline_rank
        if self.num_layers_per_virtual_pipeline_stage:
            chunks = num_layers // self.pipeline_model_parallel_size // self.num_layers_per_virtual_pipeline_stage
        return chunks if chunks is not None and chunks > 1 else None

    def validate_stall_seconds(self) -> None:
        """The watchdog's figures (`comm/watchdog.py`); fills the unset ones from the timeout."""
        deadline_s = 60 * self.distributed_timeout_minutes
        stall_default = min(30.0, deadline_s / 4)
        if self.stall_report_seconds is None:
            self.stall_report_seconds = stall_default
        require(
            0 < self.stall_report_seconds < deadline_s,
            "--stall-report-seconds",
            self.stall_report_seconds,
            f"must be > 0 and below --distributed-timeout-minutes={self.distributed_timeout_minutes:g} "
            f"({deadline_s:g} s), e.g. --stall-report-seconds {stall_default:g}",
        )
        if self.dead_peer_seconds is None:
            self.dead_peer_seconds = 5 * self.stall_report_seconds
        require(
            self.dead_peer_seconds >= self.stall_report_seconds,
            "--dead-peer-seconds",
            self.dead_peer_seconds,
            f"must be at least --stall-report-seconds={self.stall_report_seconds:g} (the stall is named before "
            f"the job ends for it), e.g. --dead-peer-seconds {5 * self.stall_report_seconds:g}",
        )

    def validate_virtual_pipeline(self, model: ModelConfig) -> None:
        """The interleaved pipeline's flags (Megatron-LM's rules): one of the two, PP > 1, whole layers per chunk."""
        per_stage, chunks = self.num_layers_per_virtual_pipeline_stage, self.num_virtual_stages_per_pipeline_rank
        pp, layers = self.pipeline_model_parallel_size, model.num_layers
        if per_stage is None and chunks is None:
            return
        require(
            per_stage is None or chunks is None,
            "--num-layers-per-virtual-pipeline-stage",
            per_stage,
            f"give it or --num-virtual-stages-per-pipeline-rank={chunks}, not both (they say the same thing)",
        )
        flag, value = (
            ("--num-layers-per-virtual-pipeline-stage", per_stage)
            if per_stage is not None
            else ("--num-virtual-stages-per-pipeline-rank", chunks)
        )
        require_positive(flag, value, 1)
        require(
            pp > 1,
            flag,
            value,
            "the interleaved pipeline splits each pipeline rank's layers into chunks; it needs "
            f"--pipeline-model-parallel-size > 1 (now {pp}), e.g. --pipeline-model-parallel-size 2",
        )
        if per_stage is not None:
            require(
                layers % pp == 0 and (layers // pp) % per_stage == 0,
                flag,
                value,
                f"must divide the layers per pipeline stage (--num-layers={layers} / "
                f"--pipeline-model-parallel-size={pp}), e.g. {_largest_divisor(layers // pp, per_stage)}",
            )
        else:
            require(
                layers % (pp * chunks) == 0,
                flag,
                value,
                f"--num-layers={layers} must be a multiple of --pipeline-model-parallel-size x chunks = "
                f"{pp} x {chunks}, e.g. {flag} {_largest_divisor(layers // pp if layers % pp == 0 else 1, chunks)}",
            )

    def validate(self, world_size: int, model: ModelConfig, moe: MoEConfig) -> None:
        tp, pp, cp, ep = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
            self.expert_model_parallel_size,
        )
        for flag, value in [
            ("--tensor-model-parallel-size", tp),
            ("--pipeline-model-parallel-size", pp),
            ("--expert-model-parallel-size", ep),
            ("--context-parallel-size", cp),
            ("--expert-tensor-parallel-size", self.expert_tensor_parallel_size or 1),
        ]:
            require(value >= 1, flag, value, "must be >= 1")
        require_positive("--distributed-timeout-minutes", self.distributed_timeout_minutes, 10)
        require_positive("--ddp-bucket-size", self.ddp_bucket_size, 1_000_000)
        self.validate_stall_seconds()
        require(
            world_size % (tp * pp * cp) == 0,
            "world size",
            world_size,
            f"must be a multiple of TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
            f"valid world sizes are multiples of {tp * pp * cp}, or change the parallel sizes",
        )
        require(
            model.num_attention_heads % tp == 0,
            "--tensor-model-parallel-size",
            tp,
            f"must divide --num-attention-heads={model.num_attention_heads}",
        )
        require(
            model.make_vocab_size_divisible_by % tp == 0,
            "--make-vocab-size-divisible-by",
            model.make_vocab_size_divisible_by,
            f"must be a multiple of --tensor-model-parallel-size={tp}",
        )
        require(
            model.num_layers % pp == 0,
            "--pipeline-model-parallel-size",
            pp,
            f"must divide --num-layers={model.num_layers}",
        )
        self.validate_virtual_pipeline(model)
        if moe.is_moe:
            etp = self.expert_tensor_parallel_size or 1
            ffn = moe.expert_ffn_width(model)
            require(
                ffn % etp == 0,
                "--expert-tensor-parallel-size",
                etp,
                f"must divide the experts' width --moe-ffn-hidden-size={ffn} (each expert's FFN is split over it), "
                f"e.g. {next(d for d in range(etp, 0, -1) if ffn % d == 0)}",
            )
            require(
                etp == 1 or moe.own_layer,
                "--expert-tensor-parallel-size",
                etp,
                "use 1 with --moe-layer-impl mcore (expert-sharded parallelism is megatron_moe's layer's)",
            )
            require(
                moe.num_experts % ep == 0,
                "--num-experts",
                moe.num_experts,
                f"must be a multiple of --expert-model-parallel-size={ep} "
                f"(e.g. --num-experts {ep * max(1, moe.num_experts // ep)})",
            )
            require(
                world_size // pp % (ep * etp) == 0,
                "--expert-model-parallel-size",
                ep,
                f"EP x expert-TP = {ep * etp} must divide the ranks per pipeline stage "
                f"({world_size // pp} = world {world_size} / PP {pp})",
            )
            require(
                tp == 1 or self.sequence_parallel,
                "--sequence-parallel",
                self.sequence_parallel,
                f"MoE with --tensor-model-parallel-size={tp} needs --sequence-parallel",
            )
        elif ep > 1:
            require(False, "--expert-model-parallel-size", ep, "needs --num-experts; use 1 for a dense model")


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is at most `at_most` (1 at least): a valid choice to name in an error."""
    return next(d for d in range(max(min(n, at_most), 1), 0, -1) if n % d == 0)


@dataclasses.dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, iterations, optimizer, learning-rate schedule, precision."""

    micro_batch_size: int = arg(4, "samples per micro-batch per data-parallel rank")
    global_batch_size: int | None = arg(None, "samples per step over all DP ranks (default micro x DP)")
    train_iters: int | None = arg(None, "optimizer steps (unset: 100, or --train-samples / global batch)")
    train_samples: int | None = arg(
        None, "train on this many samples instead (--train-iters = samples / global batch, Megatron-LM's rule)"
    )
    lr: float = arg(3e-4, "peak learning rate")
    min_lr: float = arg(3e-5, "final learning rate", applies=only.DECAYING)
    lr_warmup_iters: int = arg(0, "linear warm-up steps")
    lr_warmup_samples: int = arg(0, "linear warm-up samples (with --train-samples)")
    lr_warmup_fraction: float | None = arg(
        None, "warm up over this fraction of the decay span (instead of --lr-warmup-iters/samples)"
    )
    lr_decay_style: str = arg(
        "cosine",
        "decay after warm-up; WSD: constant, then --lr-wsd-decay-style over the last --lr-wsd-decay-iters/samples",
        choices=LR_DECAY_STYLES,
    )
    lr_decay_iters: int | None = arg(None, "decay over this many steps (default --train-iters)", applies=only.DECAYING)
    lr_decay_samples: int | None = arg(
        None, "decay over this many samples (with --train-samples; default --train-samples)", applies=only.DECAYING
    )
    lr_wsd_decay_style: str = arg(
        "exponential", "WSD: the shape of its final decay", choices=WSD_DECAY_STYLES, applies=only.WSD
    )
    lr_wsd_decay_iters: int | None = arg(None, "WSD: steps of the final decay", applies=only.WSD)
    lr_wsd_decay_samples: int | None = arg(
        None, "WSD: samples of the final decay (with --train-samples)", applies=only.WSD
    )
    weight_decay: float = arg(0.01, "AdamW weight decay")
    adam_beta1: float = arg(0.9, "Adam beta1")
    adam_beta2: float = arg(0.95, "Adam beta2")
    adam_eps: float = arg(1e-8, "Adam epsilon")
    clip_grad: float = arg(1.0, "clip the global grad norm to this (0: off)")
    bf16: bool = arg(False, "bfloat16 parameters and compute with fp32 main weights")
    fp16: bool = arg(False, "float16 with dynamic loss scaling")
    loss_scale: float | None = arg(
        None, "a static loss scale (fp16: instead of the dynamic one)", applies=only.MIXED_PRECISION
    )
    initial_loss_scale: float = arg(2.0**32, "fp16: the dynamic loss scale to start from", applies=only.DYNAMIC_SCALE)
    min_loss_scale: float = arg(1.0, "fp16: the dynamic loss scale never drops below this", applies=only.DYNAMIC_SCALE)
    loss_scale_window: int = arg(
        1000, "fp16: steps without overflow before the loss scale doubles", applies=only.DYNAMIC_SCALE
    )
    hysteresis: int = arg(
        2, "fp16: overflowing steps tolerated before the loss scale halves", applies=only.DYNAMIC_SCALE
    )
    seed: int = arg(1234, "random seed")
    eval_interval: int = arg(50, "validation every N steps (0: only at the end)")
    eval_iters: int = arg(4, "validation micro-batch rounds per evaluation")

    def validate(self) -> None:
        require(not (self.bf16 and self.fp16), "--bf16/--fp16", "both", "choose one")
        require(self.loss_scale is None or self.loss_scale > 0, "--loss-scale", self.loss_scale, "must be positive")
        require_positive("--min-loss-scale", self.min_loss_scale, 1.0)
        require(
            self.initial_loss_scale >= self.min_loss_scale > 0,
            "--initial-loss-scale",
            self.initial_loss_scale,
            f"must be >= --min-loss-scale={self.min_loss_scale} > 0",
        )
        for flag, value, example in (
            ("--micro-batch-size", self.micro_batch_size, 4),
            ("--global-batch-size", self.global_batch_size, 32),
            ("--train-samples", self.train_samples, 3200),
            ("--lr-decay-iters", self.lr_decay_iters, 1000),
            ("--lr-decay-samples", self.lr_decay_samples, 32000),
            ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters, 100),
            ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples, 3200),
            ("--adam-eps", self.adam_eps, 1e-8),
            ("--loss-scale-window", self.loss_scale_window, 1000),
            ("--hysteresis", self.hysteresis, 2),
        ):
            require_positive(flag, value, example)
        for flag, value, example in (
            ("--train-iters", self.train_iters, 100),
            ("--lr", self.lr, 3e-4),
            ("--lr-warmup-iters", self.lr_warmup_iters, 0),
            ("--lr-warmup-samples", self.lr_warmup_samples, 0),
            ("--weight-decay", self.weight_decay, 0.01),
            ("--clip-grad", self.clip_grad, "1.0 (0: off)"),
            ("--eval-interval", self.eval_interval, "50 (0: only at the end)"),
            ("--eval-iters", self.eval_iters, 4),
        ):
            require_non_negative(flag, value, example)
        require_fraction("--adam-beta1", self.adam_beta1, 0.9, below_one=True)
        require_fraction("--adam-beta2", self.adam_beta2, 0.95, below_one=True)
        # numpy takes seeds below 2**32; 2**31 leaves room for the per-stage and model-parallel offsets.
        require(0 <= self.seed < 2**31, "--seed", self.seed, "must be in [0, 2**31), e.g. --seed 1234")
        require(self.lr >= self.min_lr >= 0, "--min-lr", self.min_lr, f"must be in [0, --lr={self.lr}]")
        if self.lr_warmup_fraction is not None:
            require_fraction("--lr-warmup-fraction", self.lr_warmup_fraction, 0.01, below_one=True)
        by_samples = self.train_samples is not None
        unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
        require(
            not by_samples or self.train_iters is None,
            "--train-iters",
            self.train_iters,
            "and --train-samples both set the run's length: give one",
        )
        for name, value, unset in (
            ("lr-warmup", self.lr_warmup_iters, 0),
            ("lr-decay", self.lr_decay_iters, None),
            ("lr-wsd-decay", self.lr_wsd_decay_iters, None),
        ) if by_samples else (
            ("lr-warmup", self.lr_warmup_samples, 0),
            ("lr-decay", self.lr_decay_samples, None),
            ("lr-wsd-decay", self.lr_wsd_decay_samples, None),
        ):  # fmt: skip
            require(
                value == unset,
                f"--{name}-{other}",
                value,
                f"counts {other}, and this run counts {unit} (--train-{unit}): use --{name}-{unit}",
            )
        warmup = self.lr_warmup_samples if by_samples else self.lr_warmup_iters
        require(
            self.lr_warmup_fraction is None or warmup == 0,
            "--lr-warmup-fraction",
            self.lr_warmup_fraction,
            f"and --lr-warmup-{unit}={warmup} both set the warm-up: give one",
        )
        wsd = self.lr_wsd_decay_samples if by_samples else self.lr_wsd_decay_iters
        require(
            self.lr_decay_style != "WSD" or wsd is not None,
            "--lr-decay-style",
            "WSD",
            f"needs the length of its final decay, e.g. --lr-wsd-decay-{unit} {320 if by_samples else 10}",
        )

    def resolve_iters(self) -> None:
        """--train-iters from --train-samples (whole global batches, Megatron-LM's rule), or its default."""
        if self.train_samples is not None:
            require(
                self.train_samples >= self.global_batch_size,
                "--train-samples",
                self.train_samples,
                f"must be at least one global batch (--global-batch-size={self.global_batch_size})",
            )
            self.train_iters = self.train_samples // self.global_batch_size
        elif self.train_iters is None:
            self.train_iters = 100

    def lr_schedule_samples(self) -> dict:
        """The scheduler's spans in samples (it counts samples, as Megatron-LM's): warm-up, decay, WSD's decay."""
        gbs = self.global_batch_size
        if self.train_samples is not None:
            decay = self.lr_decay_samples or self.train_samples
            warmup, wsd = self.lr_warmup_samples, self.lr_wsd_decay_samples
        else:
            decay = (self.lr_decay_iters or self.train_iters) * gbs
            warmup = self.lr_warmup_iters * gbs
            wsd = None if self.lr_wsd_decay_iters is None else self.lr_wsd_decay_iters * gbs
        if self.lr_warmup_fraction is not None:
            warmup = int(self.lr_warmup_fraction * decay)
        return {"warmup": warmup, "decay": max(decay, warmup + 1), "wsd_decay": wsd}


@dataclasses.dataclass(kw_only=True)
class ActivationsConfig:
    """Activation memory: what each module keeps for backward (save, recompute, quantize)."""

    recompute_granularity: str | None = arg(
        None,
        "full: megatron-core recomputes whole layers; selective: per module (below)",
        choices=("full", "selective"),
    )
    activation_policy: str = arg(
        "none",
        "preset: none, full (= --recompute-granularity full), or arctic "
        "(recompute norms/activations, quantize GEMM inputs, keep all-to-all outputs)",
        choices=("none", "full", "arctic"),
    )
    recompute_modules: list[str] = arg(
        [],
        "modules whose outputs are recomputed in backward (megatron_moe/config/activation_policy.py lists the names)",
    )
    quantize_activations: list[str] = arg([], "modules whose saved activations are kept quantized")
    activation_quant_format: str = arg(
        "int8_row", "int8_row, int8_block or fp8_row (fp8 e4m3)", choices=QUANT_FORMATS, applies=only.QUANTIZING
    )

    @property
    def full_recompute(self) -> bool:
        return self.recompute_granularity == "full" or self.activation_policy == "full"

    @property
    def selective(self) -> bool:
        return not self.full_recompute and (
            self.recompute_granularity == "selective"
            or self.activation_policy != "none"
            or bool(self.recompute_modules or self.quantize_activations)
        )

    def validate(self) -> None:
        per_module = self.recompute_modules or self.quantize_activations
        require(
            not (self.full_recompute and (per_module or self.activation_policy == "arctic")),
            "--recompute-granularity",
            self.recompute_granularity,
            "full recompute conflicts with --activation-policy arctic / --recompute-modules / "
            "--quantize-activations; use --recompute-granularity selective for per-module control",
        )
        require(
            not (self.recompute_granularity == "selective" and self.activation_policy == "none" and not per_module),
            "--recompute-granularity",
            "selective",
            "name what to recompute or quantize: --activation-policy arctic, --recompute-modules or "
            "--quantize-activations",
        )


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Tokenized data (megatron-core IndexedDataset .bin/.idx) and the tokenizer."""

    data_path: list[str] = arg([], "prefix of .bin/.idx, or a blend 'w1 prefix1 w2 prefix2 ...'")
    split: str = arg("98,2,0", "train,valid,test proportions of each data path")
    tokenizer_type: str = arg(
        "SentencePieceTokenizer",
        "the tokenizer's kind (Megatron-LM's names): SentencePieceTokenizer (--tokenizer-model .model), "
        "GPT2BPETokenizer (--vocab-file, --merge-file), HuggingFaceTokenizer (--tokenizer-model tokenizer.json "
        "or its directory)",
        choices=TOKENIZER_TYPES,
    )
    tokenizer_model: str | None = arg(
        None,
        "SentencePieceTokenizer: the .model file; HuggingFaceTokenizer: a directory holding tokenizer.json, or "
        "that file",
        applies=only.TOKENIZER_MODEL,
    )
    vocab_file: str | None = arg(None, "GPT-2 BPE vocabulary (vocab.json)", applies=only.GPT2_BPE)
    merge_file: str | None = arg(None, "GPT-2 BPE merges (merges.txt)", applies=only.GPT2_BPE)
    data_cache_path: str | None = arg(None, "where dataset index files are cached (default: beside the data)")
    num_workers: int = arg(0, "data loader worker processes")

    def validate(self) -> None:
        require(
            bool(self.data_path), "--data-path", self.data_path, "give a .bin/.idx prefix from tools/preprocess_data.py"
        )
        self.validate_tokenizer()
        require_non_negative("--num-workers", self.num_workers, 2)
        try:
            shares = [float(part) for part in self.split.split(",")]
        except ValueError:
            shares = []
        require(
            1 <= len(shares) <= 3 and min(shares) >= 0 and sum(shares) > 0,
            "--split",
            self.split,
            "up to three comma-separated non-negative train,valid,test shares, not all zero, e.g. --split 98,2,0",
        )

    def validate_tokenizer(self) -> None:
        """The files the --tokenizer-type needs are named (whether they exist and fit is the tokenizer's check,
        when it loads them; tools/preprocess_data.py calls this too)."""
        kind = self.tokenizer_type
        require(kind in TOKENIZER_TYPES, "--tokenizer-type", kind, f"one of {', '.join(TOKENIZER_TYPES)}")
        if kind == "GPT2BPETokenizer":
            for flag, value, what in (
                ("--vocab-file", self.vocab_file, "vocab.json"),
                ("--merge-file", self.merge_file, "merges.txt"),
            ):
                require(
                    value is not None,
                    flag,
                    None,
                    f"--tokenizer-type GPT2BPETokenizer needs GPT-2's {what}, e.g. {flag} data/bpe/{what} "
                    f"(tools/train_tokenizer.py --model-type bytelevel-bpe writes both)",
                )
            return
        made_by = (
            "the sentencepiece .model the data was made with"
            if kind == "SentencePieceTokenizer"
            else "a directory holding tokenizer.json, or that file (tools/train_tokenizer.py --model-type "
            "bytelevel-bpe writes one)"
        )
        require(self.tokenizer_model is not None, "--tokenizer-model", None, f"--tokenizer-type {kind} needs {made_by}")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming (megatron-core dist_checkpointing)."""

    save: str | None = arg(None, "checkpoint directory to save to")
    load: str | None = arg(None, "checkpoint directory to resume from")
    save_interval: int = arg(0, "save every N steps (0: only at the end)", applies=only.SAVING)
    keep_last_n: int | None = arg(
        None,
        "after each save delete all but the newest N complete iter_* checkpoints (never the one the pointer "
        "names); not a Megatron-LM flag",
        applies=only.SAVING,
    )
    no_load_optim: bool = arg(False, "load weights only, not optimizer state", applies=only.LOADING)
    no_load_rng: bool = arg(False, "do not restore RNG states", applies=only.LOADING)
    no_save_optim: bool = arg(False, "save weights only", applies=only.SAVING)
    exit_interval: int | None = arg(None, "save and exit after this many steps of this run")
    exit_duration_in_mins: float | None = arg(None, "save and exit once this run has trained this long")
    exit_signal_handler: bool = arg(True, "on SIGTERM (e.g. slurm's pre-timeout signal) save and exit")
    ckpt_format: str = arg("torch_dist", "checkpoint format: megatron-core dist_checkpointing's torch_dist")

    def validate(self) -> None:
        require(
            self.ckpt_format == "torch_dist",
            "--ckpt-format",
            self.ckpt_format,
            "this stack writes and reads megatron-core dist_checkpointing's torch_dist only (resharded at load "
            "for another layout); use --ckpt-format torch_dist, and tools/checkpoint/ to convert to HuggingFace",
        )
        require_non_negative("--save-interval", self.save_interval, "1000 (0: only at the end)")
        require_positive("--exit-interval", self.exit_interval, 1000)
        require_positive("--exit-duration-in-mins", self.exit_duration_in_mins, 230)
        require_positive("--keep-last-n", self.keep_last_n, 3)


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Console log and TensorBoard."""

    log_interval: int = arg(10, "log a line every N steps")
    tensorboard_dir: str | None = arg(None, "write TensorBoard event files here")
    log_params_norm: bool = arg(
        False, "log the L2 norm of all parameters (each counted once) after each step, as Megatron-LM does"
    )
    loss_spike_factor: float = arg(
        3.0,
        "warn when a step's loss exceeds this factor x the median of the last --loss-spike-window steps, and at "
        "iterations 1-3 when it exceeds 2 x ln(padded vocab), an untrained model's loss (0: off)",
    )
    loss_spike_window: int = arg(20, "steps in the rolling median --loss-spike-factor compares with")
    no_comm_timers: bool = arg(
        False,
        "turn off the communication timers (exposed comm per kind and MoE layer in the log line and "
        "TensorBoard); only to measure their cost, which is under 1%% of a step",
    )
    verbose: bool = arg(
        False, "also megatron-core's INFO lines and, once each, its notices this stack filters as noise"
    )
    log_throughput: bool = arg(
        True,
        "model TFLOP/s per device in the log line (6 x active weights per token + attention, x tokens / devices / "
        "step time, as Megatron-LM counts them) and MFU: of the GPU's data-sheet 16-bit peak, on CPU of the "
        "measured GEMM rate",
    )
    tensorboard_log_interval: int = arg(1, "write the step scalars to TensorBoard every N steps")
    log_validation_ppl_to_tensorboard: bool = arg(
        False, "write the validation perplexity to TensorBoard beside the loss", applies=only.TENSORBOARD
    )
    log_num_zeros_in_grad: bool = arg(False, "count the zero entries of the gradients (log line and TensorBoard)")
    wandb_project: str | None = arg(None, "also log to Weights & Biases, this project (needs the wandb package)")
    wandb_exp_name: str | None = arg(None, "the Weights & Biases run name", applies=only.WANDB)
    wandb_save_dir: str | None = arg(
        None,
        "where wandb keeps its files (unset: <--save>/wandb or ./wandb); WANDB_MODE=offline works",
        applies=only.WANDB,
    )

    def validate(self) -> None:
        require_positive("--log-interval", self.log_interval, 10)
        require_positive("--tensorboard-log-interval", self.tensorboard_log_interval, 1)
        factor = self.loss_spike_factor
        require(factor == 0 or factor > 1, "--loss-spike-factor", factor, "must be 0 (off) or above 1, e.g. 3")
        window = self.loss_spike_window
        require(window >= 1, "--loss-spike-window", window, "must be at least 1, e.g. 20")


GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("moe", MoEConfig),
    ("parallel", ParallelConfig),
    ("training", TrainingConfig),
    ("activations", ActivationsConfig),
    ("data", DataConfig),
    ("checkpoint", CheckpointConfig),
    ("logging", LoggingConfig),
)
