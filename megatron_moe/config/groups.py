"""The configuration of a pretraining run, one keyword-only dataclass per flag group: the schema.

Every field becomes a Megatron-style flag (`num_layers` -> `--num-layers`);
see `fields.add_arguments`. The groups hold the flags and the small pure
values read off them (`ffn_width`, `is_moe`, `layer_config`, ...); the checks,
of each group alone and of what spans groups (layout divisibility, batch
sizes), are `rules.py`'s, and the layout's derived sizes `parallel_dims.py`'s.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config import conditions as only
from megatron_moe.config.activation_policy import QUANT_FORMATS
from megatron_moe.config.fields import arg
from megatron_moe.config.groups_attention import AttentionFlags
from megatron_moe.config.groups_moe import MoEConfig
from megatron_moe.config.groups_optimizer import OptimizerFlags
from megatron_moe.config.pipeline_layout import pipeline_layout_stages
from megatron_moe.config.placement import PLACEMENTS

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
"""Megatron-LM's --tokenizer-type names this stack builds (megatron_moe/data/tokenizer/)."""
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""megatron-core's OptimizerParamScheduler's decay styles (Megatron-LM's --lr-decay-style)."""
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclasses.dataclass(kw_only=True)
class ModelConfig(AttentionFlags):
    """Transformer shape: layers, width, attention (`AttentionFlags`' too), positions, norms, activation."""

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
    mtp_num_layers: int | None = arg(
        None,
        "multi-token prediction (DeepSeek-V3): this many MTP layers after the last stage's decoder, each predicting "
        "one token further (megatron-core's MultiTokenPredictionBlock; its transformer layer is the last layer's "
        "spec, its MoE our layer); unset or 0: none",
    )
    mtp_loss_scaling_factor: float = arg(
        0.1, "multi-token prediction: the MTP losses' weight (their mean over the MTP layers)", applies=only.MTP
    )

    @property
    def ffn_width(self) -> int:
        """The dense MLP's width: --ffn-hidden-size, else 4 x hidden (the one home of that default)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def mtp_layers(self) -> int:
        """The MTP layers (--mtp-num-layers; unset is 0)."""
        return self.mtp_num_layers or 0

    @property
    def layer_count(self) -> int:
        """Transformer layers by their global numbers: --num-layers, then the MTP layers (megatron-core numbers
        them num_layers + 1, ...): what a table indexed by layer number is sized by."""
        return self.num_layers + self.mtp_layers


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
    pipeline_model_parallel_layout: str | None = arg(
        None,
        "uneven pipeline stages (Megatron-LM's, e.g. DeepSeek-V3's \"Et*3|(tt|)*29,m|L\"): E the embedding, t a "
        "transformer layer, m an MTP layer, L the loss; | ends a stage, (..)*n repeats, commas are cosmetic. PP x V "
        "stages give each pipeline rank V model chunks (the interleaved pipeline; instead of the two virtual-stage "
        "flags); megatron-core places the layers (unset: --num-layers split evenly)",
        applies=only.PIPELINE_PARALLEL,
    )
    expert_model_parallel_size: int = arg(1, "EP: ranks that split the experts", applies=only.MOE)
    expert_tensor_parallel_size: int | None = arg(
        None,
        "ESP (expert-sharded parallelism, megatron-core's expert tensor parallelism): ranks that split each "
        "expert's FFN width, consecutive ranks (inside a node); tokens are all-gathered over them before the "
        "experts and reduce-scattered after, the EP all-to-all runs between these groups (unset: "
        "--tensor-model-parallel-size, Megatron-LM's default)",
        applies=only.MOE,
    )
    expert_placement: str = arg(
        "e+d",
        "where the expert-parallel groups sit (Snowflake Arctic's names; torchrun numbers ranks node by node): e+d "
        "keeps an EP group on consecutive ranks (inside a node; the experts' gradient reduction crosses nodes), d+e "
        "keeps an expert's expert-DP replicas on consecutive ranks and spreads the EP group across nodes (the "
        "all-to-all crosses); auto picks the one that sends fewer bytes across nodes per step, from the run's "
        "shapes and torchrun's ranks per node. Same computation, summed in another grouping; checkpoints load "
        "under either (docs/placement.md)",
        choices=(*PLACEMENTS, "auto"),
        applies=only.EXPERT_GROUPS,
    )
    use_tp_pp_dp_mapping: bool = arg(
        False,
        "Megatron-LM's other rank order: the pipeline dimension before the data-parallel one (megatron-core's "
        "order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp): a pipeline's stages on nearer ranks, the data-parallel "
        "replicas farthest apart. Same computation; with --expert-placement e+d only",
        applies=only.PIPELINE_PARALLEL,
    )
    context_parallel_size: int = arg(1, "CP: ranks that split the sequence in attention")
    sequence_parallel: bool = arg(
        False, "shard norms/dropout activations over TP (needed for MoE with TP>1)", applies=only.TENSOR_PARALLEL
    )
    use_distributed_optimizer: bool = arg(False, "shard optimizer state over data-parallel ranks")
    num_distributed_optimizer_instances: int = arg(
        1,
        "Megatron-LM's partial distributed optimizer: the data-parallel ranks form this many instances, each "
        "holding a whole copy of the optimizer state sharded over its own ranks; gradients are reduce-scattered "
        "inside an instance, then all-reduced across instances (megatron-core's). Must divide DP and expert DP",
        applies=only.DISTRIBUTED_OPTIMIZER,
    )
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

    @property
    def expert_tensor_parallel(self) -> int:
        """ESP: --expert-tensor-parallel-size, where unset TP (Megatron-LM's arguments.py: the experts are sharded
        as the dense layers are unless told otherwise)."""
        given = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if given is None else given

    def virtual_pipeline_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank (megatron-core's virtual_pipeline_model_parallel_size) from either
        interleaved-pipeline flag; None without an interleaved pipeline (also for 1 chunk: plain 1F1B)."""
        chunks = self.num_virtual_stages_per_pipeline_rank
        if self.pipeline_model_parallel_layout is not None:
            stages = pipeline_layout_stages(self.pipeline_model_parallel_layout)
            chunks = len(stages) // self.pipeline_model_parallel_size
        if self.num_layers_per_virtual_pipeline_stage:
            chunks = num_layers // self.pipeline_model_parallel_size // self.num_layers_per_virtual_pipeline_stage
        return chunks if chunks is not None and chunks > 1 else None


@dataclasses.dataclass(kw_only=True)
class TrainingConfig(OptimizerFlags):
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
    lr_warmup_init: float = arg(0.0, "the learning rate the linear warm-up starts from", applies=only.WARMUP)
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
    weight_decay: float = arg(0.01, "weight decay, decoupled (AdamW's; Muon's too)")
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


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Tokenized data (megatron-core IndexedDataset .bin/.idx) and the tokenizer."""

    data_path: list[str] = arg([], "prefix of .bin/.idx, or a blend 'w1 prefix1 w2 prefix2 ...'")
    mock_data: bool = arg(
        False,
        "train on megatron-core's synthetic documents (MockGPTDataset: documents of random length, each counting "
        "1, 2, 3, ... up to the tokenizer's vocabulary, then eod) instead of --data-path, as Megatron-LM's "
        "--mock-data; the tokenizer flags still set the vocabulary and eod",
    )
    split: str = arg("98,2,0", "train,valid,test proportions of each data path", applies=only.REAL_DATA)
    tokenizer_type: str = arg(
        "SentencePieceTokenizer",
        "the tokenizer's kind (Megatron-LM's names): SentencePieceTokenizer (--tokenizer-model .model), "
        "GPT2BPETokenizer (--vocab-file, --merge-file), HuggingFaceTokenizer (--tokenizer-model tokenizer.json "
        "or its directory), NullTokenizer (ids typed as numbers, --vocab-size of them; with --mock-data)",
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
    vocab_size: int | None = arg(None, "NullTokenizer: its vocabulary (eod the last id)", applies=only.NULL_TOKENIZER)
    null_tokenizer_eod_id: int | None = arg(
        None, "NullTokenizer: the end-of-document id (unset: --vocab-size - 1)", applies=only.NULL_TOKENIZER
    )
    data_cache_path: str | None = arg(None, "where dataset index files are cached (default: beside the data)")
    num_workers: int = arg(0, "data loader worker processes")


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
    allow_data_change: bool = arg(
        False,
        "resume although the data differs from the checkpoint's (another --data-path or blend, or its .bin/.idx "
        "rewritten): the change is listed, not refused; not a Megatron-LM flag",
        applies=only.LOADING,
    )
    no_save_optim: bool = arg(False, "save weights only", applies=only.SAVING)
    exit_interval: int | None = arg(None, "save and exit after this many steps of this run")
    exit_duration_in_mins: float | None = arg(None, "save and exit once this run has trained this long")
    exit_signal_handler: bool = arg(True, "on SIGTERM (e.g. slurm's pre-timeout signal) save and exit")
    ckpt_format: str = arg("torch_dist", "checkpoint format: megatron-core dist_checkpointing's torch_dist")


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Console log and TensorBoard."""

    log_interval: int = arg(10, "log a line every N steps")
    log_format: str = arg(
        "text",
        "the console's iteration line: text, a short one (iteration, lm loss, grad norm, step ms, tokens/s, "
        "exposed comm %%, ETA), or json, each logged iteration's full record as one JSON object (after the "
        "timestamp). Either way every record is appended to log.jsonl in --tensorboard-dir (none without it), "
        "beside the event files, which get every figure",
        choices=("text", "json"),
    )
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
        "turn off the communication timers (exposed comm per kind and MoE layer in the log record and "
        "TensorBoard); only to measure their cost, which is under 1%% of a step",
    )
    verbose: bool = arg(
        False,
        "also megatron-core's INFO lines and, once each, its notices this stack filters as noise; and the "
        "cost-model profile's whole table (one line per fitted kind; else one summary line)",
    )
    log_throughput: bool = arg(
        True,
        "model TFLOP/s per device in the log record (6 x active weights per token + attention, x tokens / devices / "
        "step time, as Megatron-LM counts them) and MFU: of the GPU's data-sheet 16-bit peak, on CPU of "
        "the measured GEMM rate (best of 5 probes, measured again when a run passes it; never above 100%%)",
    )
    tensorboard_log_interval: int = arg(1, "write the step scalars to TensorBoard every N steps")
    log_validation_ppl_to_tensorboard: bool = arg(
        False, "write the validation perplexity to TensorBoard beside the loss", applies=only.TENSORBOARD
    )
    log_num_zeros_in_grad: bool = arg(False, "count the zero entries of the gradients (the log record and TensorBoard)")
    wandb_project: str | None = arg(None, "also log to Weights & Biases, this project (needs the wandb package)")
    wandb_exp_name: str | None = arg(None, "the Weights & Biases run name", applies=only.WANDB)
    wandb_save_dir: str | None = arg(
        None,
        "where wandb keeps its files (unset: <--save>/wandb or ./wandb); WANDB_MODE=offline works",
        applies=only.WANDB,
    )


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
