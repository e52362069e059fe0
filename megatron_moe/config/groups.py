"""The configuration of a pretraining run, one keyword-only dataclass per flag group.

Every field becomes a Megatron-style flag (`num_layers` -> `--num-layers`);
see `fields.add_arguments`. `validate()` on each group checks what the group
can check alone; `RunConfig.validate(world_size)` checks what needs the
whole picture (layout divisibility, batch sizes).
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config.fields import arg, require


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Transformer shape: layers, width, attention, positions, norms, activation."""

    num_layers: int = arg(4, "transformer layers")
    hidden_size: int = arg(256, "model width")
    ffn_hidden_size: int | None = arg(None, "dense MLP width (default 4 x hidden)")
    num_attention_heads: int = arg(4, "attention heads")
    num_query_groups: int | None = arg(None, "key/value head groups for GQA (default: MHA)")
    seq_length: int = arg(256, "tokens per sample")
    max_position_embeddings: int | None = arg(None, "learned-position table size (default seq length)")
    position_embedding_type: str = arg("rope", "position encoding", choices=("rope", "learned_absolute"))
    rotary_base: int = arg(10000, "RoPE base")
    normalization: str = arg("LayerNorm", "norm layer", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "norm epsilon")
    swiglu: bool = arg(False, "SwiGLU MLPs and experts instead of GELU")
    disable_bias_linear: bool = arg(False, "no biases in linear layers (Mixtral-style)")
    untie_embeddings_and_output_weights: bool = arg(False, "separate output layer weights")
    hidden_dropout: float = arg(0.0, "dropout after attention and MLP")
    attention_dropout: float = arg(0.0, "dropout on attention probabilities")
    init_method_std: float = arg(0.02, "std of the normal weight init")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this (a multiple of TP)")

    def validate(self) -> None:
        require(self.num_layers > 0, "--num-layers", self.num_layers, "must be positive")
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "--hidden-size", self.hidden_size,
            f"must be a multiple of --num-attention-heads={self.num_attention_heads}",
        )  # fmt: skip
        if self.num_query_groups is not None:
            require(
                self.num_attention_heads % self.num_query_groups == 0,
                "--num-query-groups", self.num_query_groups,
                f"must divide --num-attention-heads={self.num_attention_heads}",
            )  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    """Mixture of experts: how many experts, how tokens are routed, where MoE layers sit."""

    num_experts: int | None = arg(None, "experts per MoE layer (unset: a dense model)")
    moe_router_topk: int = arg(2, "experts per token")
    moe_layer_freq: str = arg(
        "1", "MoE every N layers (N, e.g. 2 = every other layer) or a 0/1 pattern like '[1,0,1,0]'"
    )
    moe_ffn_hidden_size: int | None = arg(None, "expert MLP width (default --ffn-hidden-size)")
    moe_aux_loss_coeff: float = arg(0.01, "load-balancing loss weight")
    moe_z_loss_coeff: float | None = arg(None, "router z-loss weight (unset: off)")
    moe_router_load_balancing_type: str = arg(
        "aux_loss", "balancing loss", choices=("aux_loss", "seq_aux_loss", "none")
    )
    moe_capacity_factor: float | None = arg(
        None, "Tutel semantics: > 0 fixed (drop overflow), 0 or unset dropless, < 0 dropless capped at |f|; "
        "C = ceil(|f| x topk x tokens / experts) per expert per EP rank"
    )
    moe_gate: str = arg(
        "topk", "routing function",
        choices=("topk", "noisy_topk", "switch", "sigmoid", "xmoe", "cosine", "expert_choice", "soft", "bpr", "rts"),
    )  # fmt: skip
    moe_ordering: str = arg("sparse", "token layout: sparse (index gather/scatter) or dense (GShard einsum)",
                            choices=("sparse", "dense"))  # fmt: skip
    moe_dispatcher: str = arg("alltoallv", "EP all-to-all: alltoallv (exact rows) or alltoall (capacity-padded)",
                              choices=("alltoallv", "alltoall"))  # fmt: skip
    moe_shared_expert_ffn_hidden_size: int | None = arg(None, "width of a dense MLP beside the experts (unset: none)")
    moe_load_balancing: str | None = arg(None, "balancing loss: switch, gshard (first choice) or none "
                                         "(default from --moe-router-load-balancing-type)",
                                         choices=(None, "switch", "gshard", "none"))  # fmt: skip
    moe_normalize_topk: bool = arg(True, "rescale the k chosen gate scores to sum to 1 (k > 1)")
    moe_router_dim: int | None = arg(None, "projection width of the xmoe/cosine gates (default 16 / 256)")
    moe_soft_slots: int = arg(1, "slots per expert of --moe-gate soft")
    moe_layer_impl: str = arg("megatron_moe", "MoE layer: ours or megatron-core's (for comparison)",
                              choices=("megatron_moe", "mcore"))  # fmt: skip
    moe_token_dispatcher_type: str = arg("alltoall", "token dispatch", choices=("alltoall", "allgather"))
    moe_grouped_gemm: bool = arg(False, "grouped-GEMM experts (needs the grouped_gemm package)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

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
                "--moe-layer-freq", text, f"a list of {num_layers} zeros and ones, e.g. [1,0,1,0]",
            )  # fmt: skip
            return pattern
        require(text.isdigit() and int(text) > 0, "--moe-layer-freq", text, "a positive integer or a 0/1 list")
        return [1 if i % int(text) == 0 else 0 for i in range(num_layers)]

    def validate(self, model: ModelConfig) -> None:
        if not self.is_moe:
            return
        require(self.num_experts > 0, "--num-experts", self.num_experts, "must be positive")
        require(
            0 < self.moe_router_topk <= self.num_experts,
            "--moe-router-topk", self.moe_router_topk,
            f"must be between 1 and --num-experts={self.num_experts}",
        )  # fmt: skip
        self.layer_pattern(model.num_layers)
        if self.moe_layer_impl == "megatron_moe":
            from megatron_moe.moe import MoELayerConfig  # its validate() names the flag, value and a choice

            MoELayerConfig(
                num_experts=self.num_experts, hidden_size=model.hidden_size,
                ffn_hidden_size=self.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
                topk=self.moe_router_topk, gate=self.moe_gate, capacity_factor=self.moe_capacity_factor,
                ordering=self.moe_ordering, dispatcher=self.moe_dispatcher,
                shared_expert_ffn_hidden_size=self.moe_shared_expert_ffn_hidden_size,
                load_balancing=self.moe_load_balancing or "switch", router_dim=self.moe_router_dim,
                soft_slots=self.moe_soft_slots,
            ).validate()  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Model parallelism: tensor (TP), pipeline (PP), expert (EP), context (CP); DP is what remains."""

    tensor_model_parallel_size: int = arg(1, "TP: ranks that split each weight matrix")
    pipeline_model_parallel_size: int = arg(1, "PP: pipeline stages")
    expert_model_parallel_size: int = arg(1, "EP: ranks that split the experts")
    expert_tensor_parallel_size: int | None = arg(None, "TP inside experts (default 1)")
    context_parallel_size: int = arg(1, "CP: ranks that split the sequence in attention")
    sequence_parallel: bool = arg(False, "shard norms/dropout activations over TP (needed for MoE with TP>1)")
    use_distributed_optimizer: bool = arg(False, "shard optimizer state over data-parallel ranks")

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def validate(self, world_size: int, model: ModelConfig, moe: MoEConfig) -> None:
        tp, pp, cp, ep = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
            self.expert_model_parallel_size,
        )
        for flag, value in [("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                            ("--expert-model-parallel-size", ep), ("--context-parallel-size", cp)]:  # fmt: skip
            require(value >= 1, flag, value, "must be >= 1")
        require(
            world_size % (tp * pp * cp) == 0,
            "world size", world_size,
            f"must be a multiple of TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
            f"valid world sizes are multiples of {tp * pp * cp}, or change the parallel sizes",
        )  # fmt: skip
        require(
            model.num_attention_heads % tp == 0,
            "--tensor-model-parallel-size", tp,
            f"must divide --num-attention-heads={model.num_attention_heads}",
        )  # fmt: skip
        require(
            model.make_vocab_size_divisible_by % tp == 0,
            "--make-vocab-size-divisible-by", model.make_vocab_size_divisible_by,
            f"must be a multiple of --tensor-model-parallel-size={tp}",
        )  # fmt: skip
        require(
            model.num_layers % pp == 0,
            "--pipeline-model-parallel-size", pp, f"must divide --num-layers={model.num_layers}",
        )  # fmt: skip
        if moe.is_moe:
            etp = self.expert_tensor_parallel_size or 1
            require(
                moe.num_experts % ep == 0,
                "--num-experts", moe.num_experts,
                f"must be a multiple of --expert-model-parallel-size={ep} "
                f"(e.g. --num-experts {ep * max(1, moe.num_experts // ep)})",
            )  # fmt: skip
            require(
                world_size // pp % (ep * etp) == 0,
                "--expert-model-parallel-size", ep,
                f"EP x expert-TP = {ep * etp} must divide the ranks per pipeline stage "
                f"({world_size // pp} = world {world_size} / PP {pp})",
            )  # fmt: skip
            require(
                tp == 1 or self.sequence_parallel,
                "--sequence-parallel", self.sequence_parallel,
                f"MoE with --tensor-model-parallel-size={tp} needs --sequence-parallel",
            )  # fmt: skip
        elif ep > 1:
            require(False, "--expert-model-parallel-size", ep, "needs --num-experts; use 1 for a dense model")


@dataclasses.dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, iterations, optimizer, learning-rate schedule, precision."""

    micro_batch_size: int = arg(4, "samples per micro-batch per data-parallel rank")
    global_batch_size: int | None = arg(None, "samples per step over all DP ranks (default micro x DP)")
    train_iters: int = arg(100, "optimizer steps")
    lr: float = arg(3e-4, "peak learning rate")
    min_lr: float = arg(3e-5, "final learning rate")
    lr_warmup_iters: int = arg(0, "linear warm-up steps")
    lr_decay_style: str = arg("cosine", "decay after warm-up", choices=("constant", "linear", "cosine"))
    lr_decay_iters: int | None = arg(None, "decay over this many steps (default --train-iters)")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    adam_beta1: float = arg(0.9, "Adam beta1")
    adam_beta2: float = arg(0.95, "Adam beta2")
    adam_eps: float = arg(1e-8, "Adam epsilon")
    clip_grad: float = arg(1.0, "clip the global grad norm to this (0: off)")
    bf16: bool = arg(False, "bfloat16 parameters and compute with fp32 main weights")
    fp16: bool = arg(False, "float16 with dynamic loss scaling")
    loss_scale: float | None = arg(None, "fp16: a static loss scale instead of the dynamic one")
    initial_loss_scale: float = arg(2.0**32, "fp16: the dynamic loss scale to start from")
    min_loss_scale: float = arg(1.0, "fp16: the dynamic loss scale never drops below this")
    loss_scale_window: int = arg(1000, "fp16: steps without overflow before the loss scale doubles")
    hysteresis: int = arg(2, "fp16: overflowing steps tolerated before the loss scale halves")
    seed: int = arg(1234, "random seed")
    eval_interval: int = arg(50, "validation every N steps (0: only at the end)")
    eval_iters: int = arg(4, "validation micro-batch rounds per evaluation")

    def validate(self) -> None:
        require(not (self.bf16 and self.fp16), "--bf16/--fp16", "both", "choose one")
        require(self.loss_scale is None or self.loss_scale > 0, "--loss-scale", self.loss_scale, "must be positive")
        require(self.initial_loss_scale >= self.min_loss_scale > 0, "--initial-loss-scale", self.initial_loss_scale,
                f"must be >= --min-loss-scale={self.min_loss_scale} > 0")
        require(self.micro_batch_size > 0, "--micro-batch-size", self.micro_batch_size, "must be positive")
        require(self.train_iters >= 0, "--train-iters", self.train_iters, "must be >= 0")
        require(self.lr >= self.min_lr >= 0, "--min-lr", self.min_lr, f"must be in [0, --lr={self.lr}]")
        require(self.eval_iters >= 0, "--eval-iters", self.eval_iters, "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class ActivationsConfig:
    """Activation memory: what each module keeps for backward (save, recompute, quantize)."""

    recompute_granularity: str | None = arg(
        None, "full: megatron-core recomputes whole layers; selective: per module (below)",
        choices=("full", "selective"),
    )
    activation_policy: str = arg("none", "preset: none, full (= --recompute-granularity full), or arctic "
                                 "(recompute norms/activations, quantize GEMM inputs, keep all-to-all outputs)",
                                 choices=("none", "full", "arctic"))  # fmt: skip
    recompute_modules: list[str] = arg([], "modules whose outputs are recomputed in backward "
                                       "(megatron_moe/activations/policy.py lists the names)")  # fmt: skip
    quantize_activations: list[str] = arg([], "modules whose saved activations are kept quantized")
    activation_quant_format: str = arg("int8_row", "int8_row, int8_block or fp8_row (fp8 e4m3)",
                                       choices=("int8_row", "int8_block", "fp8_row"))  # fmt: skip

    @property
    def full_recompute(self) -> bool:
        return self.recompute_granularity == "full" or self.activation_policy == "full"

    @property
    def selective(self) -> bool:
        return not self.full_recompute and (
            self.recompute_granularity == "selective" or self.activation_policy != "none"
            or bool(self.recompute_modules or self.quantize_activations)
        )  # fmt: skip

    def validate(self) -> None:
        per_module = self.recompute_modules or self.quantize_activations
        require(
            not (self.full_recompute and (per_module or self.activation_policy == "arctic")),
            "--recompute-granularity", self.recompute_granularity,
            "full recompute conflicts with --activation-policy arctic / --recompute-modules / "
            "--quantize-activations; use --recompute-granularity selective for per-module control",
        )  # fmt: skip
        require(
            not (self.recompute_granularity == "selective" and self.activation_policy == "none" and not per_module),
            "--recompute-granularity", "selective",
            "name what to recompute or quantize: --activation-policy arctic, --recompute-modules or "
            "--quantize-activations",
        )  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Tokenized data (megatron-core IndexedDataset .bin/.idx) and the tokenizer."""

    data_path: list[str] = arg([], "prefix of .bin/.idx, or a blend 'w1 prefix1 w2 prefix2 ...'")
    split: str = arg("98,2,0", "train,valid,test proportions of each data path")
    tokenizer_model: str | None = arg(None, "sentencepiece .model file")
    data_cache_path: str | None = arg(None, "where dataset index files are cached (default: beside the data)")
    num_workers: int = arg(0, "data loader worker processes")

    def validate(self) -> None:
        require(bool(self.data_path), "--data-path", self.data_path, "give a .bin/.idx prefix from tools/preprocess_data.py")
        require(self.tokenizer_model is not None, "--tokenizer-model", None, "give the sentencepiece .model the data was made with")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming (megatron-core dist_checkpointing)."""

    save: str | None = arg(None, "checkpoint directory to save to")
    load: str | None = arg(None, "checkpoint directory to resume from")
    save_interval: int = arg(0, "save every N steps (0: only at the end)")
    no_load_optim: bool = arg(False, "load weights only, not optimizer state")
    no_load_rng: bool = arg(False, "do not restore RNG states")
    no_save_optim: bool = arg(False, "save weights only")
    exit_interval: int | None = arg(None, "save and exit after this many steps of this run")
    exit_duration_in_mins: float | None = arg(None, "save and exit once this run has trained this long")
    exit_signal_handler: bool = arg(True, "on SIGTERM (e.g. slurm's pre-timeout signal) save and exit")


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Console log and TensorBoard."""

    log_interval: int = arg(10, "log a line every N steps")
    tensorboard_dir: str | None = arg(None, "write TensorBoard event files here")
    log_params_norm: bool = arg(False, "also log the parameter norm")


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
