"""The checks of one flag group alone: training, activations, data, tokenizer, checkpoint, logging.

Each `check_X(group)` raises a `ConfigError` naming the flag, its value and a valid choice; `rules.check_run`
runs them with the checks that span groups, collecting every error in one pass. Pure Python, no torch.
"""

from __future__ import annotations

from megatron_moe.config.fields import (
    Collector,
    require,
    require_fraction,
    require_non_negative,
    require_positive,
)
from megatron_moe.config.groups import (
    TOKENIZER_TYPES,
    ActivationsConfig,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    TrainingConfig,
)


def check_training(training: TrainingConfig) -> None:
    """Precision, batch sizes, the optimizer and the learning-rate schedule, counted in iterations or samples."""
    require(not (training.bf16 and training.fp16), "--bf16/--fp16", "both", "choose one")
    require(
        training.loss_scale is None or training.loss_scale > 0, "--loss-scale", training.loss_scale, "must be positive"
    )
    require_positive("--min-loss-scale", training.min_loss_scale, 1.0)
    require(
        training.initial_loss_scale >= training.min_loss_scale > 0,
        "--initial-loss-scale",
        training.initial_loss_scale,
        f"must be >= --min-loss-scale={training.min_loss_scale} > 0",
    )
    for flag, value, example in (
        ("--micro-batch-size", training.micro_batch_size, 4),
        ("--global-batch-size", training.global_batch_size, 32),
        ("--train-samples", training.train_samples, 3200),
        ("--lr-decay-iters", training.lr_decay_iters, 1000),
        ("--lr-decay-samples", training.lr_decay_samples, 32000),
        ("--lr-wsd-decay-iters", training.lr_wsd_decay_iters, 100),
        ("--lr-wsd-decay-samples", training.lr_wsd_decay_samples, 3200),
        ("--adam-eps", training.adam_eps, 1e-8),
        ("--loss-scale-window", training.loss_scale_window, 1000),
        ("--hysteresis", training.hysteresis, 2),
    ):
        require_positive(flag, value, example)
    for flag, value, example in (
        ("--train-iters", training.train_iters, 100),
        ("--lr", training.lr, 3e-4),
        ("--lr-warmup-iters", training.lr_warmup_iters, 0),
        ("--lr-warmup-samples", training.lr_warmup_samples, 0),
        ("--weight-decay", training.weight_decay, 0.01),
        ("--clip-grad", training.clip_grad, "1.0 (0: off)"),
        ("--eval-interval", training.eval_interval, "50 (0: only at the end)"),
        ("--eval-iters", training.eval_iters, 4),
    ):
        require_non_negative(flag, value, example)
    require_fraction("--adam-beta1", training.adam_beta1, 0.9, below_one=True)
    require_fraction("--adam-beta2", training.adam_beta2, 0.95, below_one=True)
    # numpy takes seeds below 2**32; 2**31 leaves room for the per-stage and model-parallel offsets.
    require(0 <= training.seed < 2**31, "--seed", training.seed, "must be in [0, 2**31), e.g. --seed 1234")
    require(
        0 <= training.lr_warmup_init <= training.lr,
        "--lr-warmup-init",
        training.lr_warmup_init,
        f"must be in [0, --lr={training.lr}] (the warm-up rises from it to --lr)",
    )
    require(training.lr >= training.min_lr >= 0, "--min-lr", training.min_lr, f"must be in [0, --lr={training.lr}]")
    if training.lr_warmup_fraction is not None:
        require_fraction("--lr-warmup-fraction", training.lr_warmup_fraction, 0.01, below_one=True)
    by_samples = training.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    require(
        not by_samples or training.train_iters in (None, iters_from_samples(training)),
        "--train-iters",
        training.train_iters,
        "and --train-samples both set the run's length: give one",
    )
    for name, value, unset in (
        ("lr-warmup", training.lr_warmup_iters, 0),
        ("lr-decay", training.lr_decay_iters, None),
        ("lr-wsd-decay", training.lr_wsd_decay_iters, None),
    ) if by_samples else (
        ("lr-warmup", training.lr_warmup_samples, 0),
        ("lr-decay", training.lr_decay_samples, None),
        ("lr-wsd-decay", training.lr_wsd_decay_samples, None),
    ):  # fmt: skip
        require(
            value == unset,
            f"--{name}-{other}",
            value,
            f"counts {other}, and this run counts {unit} (--train-{unit}): use --{name}-{unit}",
        )
    warmup = training.lr_warmup_samples if by_samples else training.lr_warmup_iters
    require(
        training.lr_warmup_fraction is None or warmup == 0,
        "--lr-warmup-fraction",
        training.lr_warmup_fraction,
        f"and --lr-warmup-{unit}={warmup} both set the warm-up: give one",
    )
    wsd = training.lr_wsd_decay_samples if by_samples else training.lr_wsd_decay_iters
    require(
        training.lr_decay_style != "WSD" or wsd is not None,
        "--lr-decay-style",
        "WSD",
        f"needs the length of its final decay, e.g. --lr-wsd-decay-{unit} {320 if by_samples else 10}",
    )


def iters_from_samples(training: TrainingConfig) -> int | None:
    """The --train-iters that `resolve_train_iters` fills in from --train-samples (None before the global batch is
    known): a validated config holds it, so validating it again (start-up does, on the real world size) finds it
    derived, not given."""
    if training.train_samples is None or training.global_batch_size is None:
        return None
    return training.train_samples // training.global_batch_size


def resolve_train_iters(training: TrainingConfig) -> None:
    """Fills --train-iters: from --train-samples (whole global batches, Megatron-LM's rule), else its default."""
    if training.train_samples is not None:
        require(
            training.train_samples >= training.global_batch_size,
            "--train-samples",
            training.train_samples,
            f"must be at least one global batch (--global-batch-size={training.global_batch_size})",
        )
        training.train_iters = iters_from_samples(training)
    elif training.train_iters is None:
        training.train_iters = 100


def check_activations(activations: ActivationsConfig) -> None:
    """Full recompute excludes per-module control; selective recompute names what it recomputes."""
    per_module = activations.recompute_modules or activations.quantize_activations
    require(
        not (activations.full_recompute and (per_module or activations.activation_policy == "arctic")),
        "--recompute-granularity",
        activations.recompute_granularity,
        "full recompute conflicts with --activation-policy arctic / --recompute-modules / "
        "--quantize-activations; use --recompute-granularity selective for per-module control",
    )
    require(
        not (
            activations.recompute_granularity == "selective"
            and activations.activation_policy == "none"
            and not per_module
        ),
        "--recompute-granularity",
        "selective",
        "name what to recompute or quantize: --activation-policy arctic, --recompute-modules or --quantize-activations",
    )


def check_data(data: DataConfig) -> None:
    """A data path (or --mock-data), the tokenizer's files, the loader's workers and the split: each checked,
    every error raised together."""
    errors = Collector()
    with errors:
        require(
            not (data.mock_data and data.data_path),
            "--data-path",
            " ".join(data.data_path),
            "and --mock-data both name the training data: give one (--mock-data trains on synthetic documents)",
        )
        require(
            bool(data.data_path) or data.mock_data,
            "--data-path",
            data.data_path,
            "give a .bin/.idx prefix from tools/preprocess_data.py (or --mock-data for synthetic documents)",
        )
    with errors:
        check_tokenizer(data)
    with errors:
        require_non_negative("--num-workers", data.num_workers, 2)
    with errors:  # also where they change nothing (another tokenizer): a negative size or id is a typo
        if data.vocab_size is not None:
            require_positive("--vocab-size", data.vocab_size, 32000)
        if data.null_tokenizer_eod_id is not None:
            require_non_negative("--null-tokenizer-eod-id", data.null_tokenizer_eod_id, 0)
    with errors:
        require(
            valid_split(data.split),
            "--split",
            data.split,
            "up to three comma-separated non-negative train,valid,test shares, not all zero, e.g. --split 98,2,0",
        )
    errors.raise_all()


def valid_split(split: str) -> bool:
    """Up to three comma-separated non-negative train,valid,test shares, not all zero."""
    try:
        shares = [float(part) for part in split.split(",")] if split else []
    except ValueError:
        return False
    return 1 <= len(shares) <= 3 and min(shares) >= 0 and sum(shares) > 0


def check_tokenizer(data: DataConfig) -> None:
    """The files the --tokenizer-type needs are named (whether they exist and fit is the tokenizer's check,
    when it loads them; tools/preprocess_data.py calls this too)."""
    kind = data.tokenizer_type
    require(kind in TOKENIZER_TYPES, "--tokenizer-type", kind, f"one of {', '.join(TOKENIZER_TYPES)}")
    if kind == "NullTokenizer":
        check_null_tokenizer(data)
        return
    if kind == "GPT2BPETokenizer":
        for flag, value, what in (
            ("--vocab-file", data.vocab_file, "vocab.json"),
            ("--merge-file", data.merge_file, "merges.txt"),
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
    require(data.tokenizer_model is not None, "--tokenizer-model", None, f"--tokenizer-type {kind} needs {made_by}")


def check_null_tokenizer(data: DataConfig) -> None:
    """NullTokenizer: --vocab-size ids, eod one of them; with --mock-data only (real data is tied to the tokenizer
    it was made with by its sidecar, which a NullTokenizer has no file to match)."""
    require(
        data.vocab_size is not None and data.vocab_size > 1,
        "--vocab-size",
        data.vocab_size,
        "--tokenizer-type NullTokenizer needs its vocabulary size (> 1), e.g. --vocab-size 32000",
    )
    eod = data.null_tokenizer_eod_id
    require(
        eod is None or 0 <= eod < data.vocab_size,
        "--null-tokenizer-eod-id",
        eod,
        f"must be an id of the vocabulary, in [0, --vocab-size={data.vocab_size})",
    )
    require(
        data.mock_data,
        "--tokenizer-type",
        "NullTokenizer",
        "with --mock-data only here: tokenized data is checked against the tokenizer it was made with (its "
        "sidecar); give that tokenizer's flags",
    )


def check_checkpoint(checkpoint: CheckpointConfig) -> None:
    """The checkpoint format and the save / exit intervals."""
    require(
        checkpoint.ckpt_format == "torch_dist",
        "--ckpt-format",
        checkpoint.ckpt_format,
        "this stack writes and reads megatron-core dist_checkpointing's torch_dist only (resharded at load "
        "for another layout); use --ckpt-format torch_dist, and tools/checkpoint/ to convert to HuggingFace",
    )
    require_non_negative("--save-interval", checkpoint.save_interval, "1000 (0: only at the end)")
    require_positive("--exit-interval", checkpoint.exit_interval, 1000)
    require_positive("--exit-duration-in-mins", checkpoint.exit_duration_in_mins, 230)
    require_positive("--keep-last-n", checkpoint.keep_last_n, 3)


def check_logging(logging: LoggingConfig) -> None:
    """The log intervals and the loss-spike warning's figures."""
    require_positive("--log-interval", logging.log_interval, 10)
    require_positive("--tensorboard-log-interval", logging.tensorboard_log_interval, 1)
    factor = logging.loss_spike_factor
    require(factor == 0 or factor > 1, "--loss-spike-factor", factor, "must be 0 (off) or above 1, e.g. 3")
    window = logging.loss_spike_window
    require(window >= 1, "--loss-spike-window", window, "must be at least 1, e.g. 20")
