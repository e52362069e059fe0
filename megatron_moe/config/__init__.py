"""Run configuration: flag groups, the generated CLI, and cross-group validation."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

from megatron_moe.config.fields import ConfigError, add_arguments, from_namespace, require
from megatron_moe.config.groups import (
    GROUPS,
    ActivationsConfig,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainingConfig,
)


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

    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel.data_parallel_size(world_size)

    def num_microbatches(self, world_size: int) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size(world_size))

    def validate(self, world_size: int) -> None:
        """Check every group, then what spans groups; fill derived defaults."""
        self.model.validate()
        self.moe.validate(self.model)
        self.parallel.validate(world_size, self.model, self.moe)
        self.training.validate()
        self.activations.validate()
        self.activation_policy()  # names and formats checked before any process group exists
        self.data.validate()
        dp = self.data_parallel_size(world_size)
        t = self.training
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        require(
            t.global_batch_size % (t.micro_batch_size * dp) == 0,
            "--global-batch-size", t.global_batch_size,
            f"must be a multiple of --micro-batch-size x data-parallel size = "
            f"{t.micro_batch_size} x {dp} = {t.micro_batch_size * dp}",
        )  # fmt: skip
        require(
            self.model.seq_length % (self.parallel.tensor_model_parallel_size
                                     if self.parallel.sequence_parallel else 1) == 0,
            "--seq-length", self.model.seq_length,
            "must be a multiple of --tensor-model-parallel-size under --sequence-parallel",
        )  # fmt: skip

    def activation_policy(self):
        """The per-module ActivationPolicy, or None when no selective policy is asked for."""
        from megatron_moe.activations.policy import build_policy

        a = self.activations
        if not a.selective:
            return None
        preset = "none" if a.activation_policy == "full" else a.activation_policy
        return build_policy(preset=preset, recompute=a.recompute_modules, quantize=a.quantize_activations,
                            quant_format=a.activation_quant_format)  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        return cls(**{name: group(**values[name]) for name, group in GROUPS})


def build_parser(description: str = "Pretrain a GPT mixture-of-experts model.") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    for name, group in GROUPS:
        add_arguments(parser, group, name)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    namespace = build_parser().parse_args(argv)
    return RunConfig(**{name: from_namespace(group, namespace) for name, group in GROUPS})


__all__ = [
    "ActivationsConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainingConfig",
    "build_parser",
    "parse_args",
]
