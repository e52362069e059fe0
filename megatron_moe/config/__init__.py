"""Run configuration: flag groups, the generated CLI, and cross-group validation.

The bottom layer of megatron_moe: pure Python, importing neither torch nor
megatron-core nor another megatron_moe package. The types the layers above
are configured with (the MoE layer's `MoELayerConfig`, the `ActivationPolicy`)
live here too, so the run config builds and checks them without importing
the code that uses them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections.abc import Callable, Sequence

from megatron_moe.config import rules, rules_groups
from megatron_moe.config.activation_policy import ActivationPolicy, build_policy
from megatron_moe.config.directories import directory_errors
from megatron_moe.config.fields import (
    ConfigError,
    ConfigErrors,
    add_arguments,
    check_given_flags_apply,
    error_lines,
    flags_that_change_nothing,
    from_namespace,
    raise_errors,
)
from megatron_moe.config.groups import (
    GROUPS,
    TOKENIZER_TYPES,
    ActivationsConfig,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainingConfig,
)
from megatron_moe.config.kernels import Kernels, cpu_stand_ins, kernel_errors
from megatron_moe.config.megatron_lm import accept_megatron_lm_flags, unknown_flag
from megatron_moe.config.moe_layer import MoEConfigError, MoELayerConfig
from megatron_moe.config.parallel_dims import ParallelDims


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything one pretraining run is told, grouped as the flags are."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    activations: ActivationsConfig = dataclasses.field(default_factory=ActivationsConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    notes: list[str] = dataclasses.field(default_factory=list, compare=False)
    """Lines for the start-up log from parsing (Megatron-LM flags accepted as not needed); not a setting."""

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The parallel layout on `world_size` ranks (unset: the fewest that hold it): the degrees and the sizes
        derived from them (DP, expert-DP, the token split)."""
        return ParallelDims.from_config(self.parallel, world_size, self.model.num_layers)

    @property
    def optimizer_kind(self) -> str:
        """The optimizer megatron-core builds: adam, distributed_adam (its DistributedOptimizer), muon, or
        layer_wise_muon (Megatron-LM's rule: muon with --use-distributed-optimizer, or dist_muon, is Muon's
        layer-wise distributed optimizer, megatron-core's DistributedOptimizer and DDP's sharding off)."""
        distributed = self.parallel.use_distributed_optimizer
        if self.training.uses_muon:
            return "layer_wise_muon" if distributed or self.training.optimizer == "dist_muon" else "muon"
        return "distributed_adam" if distributed else "adam"

    @property
    def sharded_by_ddp(self) -> bool:
        """megatron-core's distributed optimizer in force (DDP reduce-scatters into its shards)."""
        return self.optimizer_kind == "distributed_adam"

    def num_microbatches(self, world_size: int) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.dims(world_size).dp)

    def validate(self, world_size: int) -> None:
        """Check every group, then what spans groups; fill derived defaults (`rules.check_run`)."""
        rules.check_run(self, world_size)

    def activation_policy(self) -> ActivationPolicy | None:
        """The per-module ActivationPolicy, or None when no selective policy is asked for."""
        a = self.activations
        if not a.selective:
            return None
        preset = "none" if a.activation_policy == "full" else a.activation_policy
        return build_policy(
            preset=preset,
            recompute=a.recompute_modules,
            quantize=a.quantize_activations,
            quant_format=a.activation_quant_format,
        )

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name, _ in GROUPS}

    @classmethod
    def from_dict(cls, values: dict) -> RunConfig:
        """From `to_dict()`, also of a checkpoint saved before the MoE flags were renamed."""
        values = {**values, "moe": _renamed_moe_flags(values["moe"])}
        return cls(**{name: group(**values[name]) for name, group in GROUPS})


def _renamed_moe_flags(moe: dict) -> dict:
    """Saved MoE settings under the flags that replaced --moe-capacity-factor, --moe-dispatcher and
    --moe-load-balancing, meaning what they ran as."""
    moe = dict(moe)
    if "moe_capacity_factor" in moe:
        moe["moe_expert_capacity_factor"] = moe.pop("moe_capacity_factor")
    if "moe_dispatcher" in moe:
        moe["moe_pad_expert_input_to_capacity"] = moe.pop("moe_dispatcher") == "alltoall"
    if "moe_load_balancing" in moe:
        old = moe.pop("moe_load_balancing")
        if moe.get("moe_layer_impl", "megatron_moe") == "megatron_moe":  # seq_aux_loss ran as switch there
            kind = old or ("none" if moe.get("moe_router_load_balancing_type") == "none" else "switch")
            moe["moe_router_load_balancing_type"] = {"switch": "aux_loss", "gshard": "top1_aux_loss"}.get(kind, kind)
    return moe


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line, not a usage dump; a bad value raises argparse's
    ArgumentError (naming its flag), so that `parse_args` can set the flag aside and find the next error."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, exit_on_error=False, **kwargs)

    def error(self, message):
        raise ConfigError(message)


def build_parser(
    description: str = "Pretrain a GPT mixture-of-experts model.", *, defaults: bool = True
) -> argparse.ArgumentParser:
    """The CLI; `defaults=False` leaves flags not given out of the parsed namespace."""
    parser = _Parser(description=description, allow_abbrev=False, usage="%(prog)s [flags] (--help lists them by group)")
    for name, group in GROUPS:
        add_arguments(parser, group, name, defaults=defaults)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """The run config the flags describe. Every error is found in one pass and raised together (`ConfigErrors`,
    one line each; a single error is one ConfigError line): an unknown flag (naming the closest ones), a bad
    value, a refused Megatron-LM flag. Megatron-LM flags not needed here, and flags that change nothing in this
    run, are accepted, each with a line in `RunConfig.notes`."""
    cfg, errors = _parse(sys.argv[1:] if argv is None else argv)
    raise_errors(errors)
    return cfg


def _parse(argv: Sequence[str]) -> tuple[RunConfig | None, list[str]]:
    """(the run config of the flags that parse, one line per flag that does not): a flag in error is set aside
    and the rest parsed again, so that one pass names every bad flag (None for the config after an error argparse
    names no flag for: nothing is then known to check further)."""
    argv, notes, errors = accept_megatron_lm_flags(argv)
    parser = build_parser()
    while True:
        try:
            namespace, unknown = parser.parse_known_args(argv)
            break
        except (argparse.ArgumentError, ConfigError) as error:  # ConfigError: argparse's own error(), unattributed
            errors.append(str(error))
            argv = _without_flag(parser, argv, getattr(error, "argument_name", None))
            if argv is None:
                return None, errors
    errors += [unknown_flag(parser, item) for item in _unknown_flags(unknown)]
    cfg = RunConfig(**{name: from_namespace(group, namespace) for name, group in GROUPS})
    given, _ = build_parser(defaults=False).parse_known_args(argv)  # the unknown ones named above
    cfg.notes = notes + flags_that_change_nothing(cfg, GROUPS, set(vars(given)))
    if {"train_iters", "train_samples"} <= set(vars(given)):  # typed, not filled in by validation (rules_groups)
        length = "and --train-samples both set the run's length: give one"
        errors.append(f"--train-iters={cfg.training.train_iters}: {length}")
    return cfg, errors


def _without_flag(parser: argparse.ArgumentParser, argv: list[str], name: str | None) -> list[str] | None:
    """`argv` without each occurrence of the flag `name` (argparse's "--a/--b" for a flag of two names) and its
    values; None where no flag of ours is named."""
    names = set((name or "").split("/")) & set(parser._option_string_actions)
    if not names:
        return None
    action = parser._option_string_actions[next(iter(names))]
    kept, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag not in names:
            kept.append(argv[i])
            i += 1
            continue
        i += 1
        if "=" in argv[i - 1] or action.nargs == 0:
            continue
        most = 1 if action.nargs in (None, "?") else len(argv)
        while most and i < len(argv) and not _is_flag(argv[i]):
            i, most = i + 1, most - 1
    return kept


def _is_flag(item: str) -> bool:
    """A `--flag` or `-f`, not a value (a negative number is a value)."""
    if not item.startswith("-") or item == "-":
        return False
    try:
        float(item)
        return False
    except ValueError:
        return True


def _unknown_flags(unknown: list[str]) -> list[str]:
    """The unknown arguments to name: each unknown flag (the bare words after it are its values), and bare words
    that follow no unknown flag."""
    named, after_flag = [], False
    for item in unknown:
        if _is_flag(item):
            named.append(item)
            after_flag = True
        elif not after_flag:
            named.append(item)
    return named


def _flag_named(error: str) -> str | None:
    """The flag an error line is about: its first `--flag` (argparse's "argument --a/--b: ..." included)."""
    for word in error.split():
        if word.startswith("--"):
            return word.split("=")[0].split("/")[0].rstrip(":;,")
    return None


def parse_and_validate(
    argv: Sequence[str] | None,
    world_size: int,
    *,
    files: Callable[[RunConfig], None] | None = None,
    kernels: Kernels | None = None,
) -> RunConfig:
    """`parse_args` then `RunConfig.validate` on `world_size` ranks, then `files` (the entry point passes the
    data layer's `data.files.check_data_files`: the files exist and the data's documents cover its splits; this
    layer imports nothing above it), and where `kernels` is given (the entry point's `kernels.probe_kernels()`)
    the kernels the flags need (`kernels.kernel_errors`), then the directories (`directories.directory_errors`: --save
    and --tensorboard-dir writable, --load readable), every error found in one pass and raised together. Where
    a flag did not parse, the run is checked without it, and an error that names that flag again (a consequence
    of setting it aside) is left out."""
    cfg, errors = _parse(sys.argv[1:] if argv is None else argv)
    unparsed = {flag for flag in map(_flag_named, errors) if flag}
    checks = (
        lambda: cfg.validate(world_size),
        lambda: files(cfg) if files else None,
        lambda: check_kernels(cfg),
        lambda: raise_errors(directory_errors(cfg)),
    )

    def check_kernels(cfg: RunConfig) -> None:
        if kernels is not None:
            raise_errors(kernel_errors(cfg, kernels))
            cfg.notes += cpu_stand_ins(cfg, kernels)

    for check in checks if cfg is not None else ():
        try:
            check()
        except ConfigError as error:
            errors += [line for line in error_lines(error) if not any(flag in line for flag in unparsed)]
    raise_errors(errors)
    return cfg


def layout_line(cfg: RunConfig, world_size: int) -> str:
    """The layout and batch of a validated run in one line (a dry run's answer)."""
    p, m = cfg.parallel, cfg.model
    moe_layers = sum(cfg.moe.layer_pattern(m.num_layers)) if cfg.moe.is_moe else 0
    return (
        f"TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} CP={p.context_parallel_size} "
        f"EP={p.expert_model_parallel_size} DP={cfg.dims(world_size).dp} SP={p.sequence_parallel} "
        f"micro-batch={cfg.training.micro_batch_size} global-batch={cfg.training.global_batch_size} "
        f"microbatches={cfg.num_microbatches(world_size)} MoE layers={moe_layers}/{m.num_layers}"
    )


TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
"""The data group's fields that choose the tokenizer: the flags tools/preprocess_data.py shares with training."""


def add_tokenizer_arguments(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """The training flags that choose the tokenizer (--tokenizer-type, --tokenizer-model, --vocab-file,
    --merge-file), for a tool that tokenizes: the same names, help and checks as training's."""
    description = "The tokenizer: the same flags as the trainer's, building the same tokenizer."
    add_arguments(parser, DataConfig, "tokenizer", defaults=defaults, only=TOKENIZER_FIELDS, description=description)


def tokenizer_config(namespace: argparse.Namespace, argv: Sequence[str] | None = None) -> DataConfig:
    """The DataConfig of the tokenizer flags a tool parsed (`add_tokenizer_arguments`) from `argv`; a flag given
    that the --tokenizer-type does not read is refused, and a missing one named, as in training."""
    data = DataConfig(**{name: getattr(namespace, name) for name in TOKENIZER_FIELDS})
    given_parser = _Parser(allow_abbrev=False, add_help=False)
    add_tokenizer_arguments(given_parser, defaults=False)
    given, _ = given_parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    check_given_flags_apply(types.SimpleNamespace(data=data), [("data", DataConfig)], set(vars(given)))
    rules_groups.check_tokenizer(data)
    return data


__all__ = [
    "ActivationPolicy",
    "ActivationsConfig",
    "CheckpointConfig",
    "ConfigError",
    "ConfigErrors",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "MoEConfigError",
    "MoELayerConfig",
    "ParallelConfig",
    "ParallelDims",
    "RunConfig",
    "TOKENIZER_FIELDS",
    "TOKENIZER_TYPES",
    "TrainingConfig",
    "add_tokenizer_arguments",
    "build_parser",
    "layout_line",
    "parse_and_validate",
    "parse_args",
    "tokenizer_config",
]
