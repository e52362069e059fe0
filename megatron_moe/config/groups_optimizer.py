"""The optimizer flags of the training group: which optimizer, and Muon's settings.

Megatron-LM's names, defaults and meanings (HEAD d98e8a64dd's `_add_training_args`; megatron-core 0.16.1's
OptimizerConfig muon_* fields). `TrainingConfig` (groups.py) inherits `OptimizerFlags`, so each flag is a field of
the training group (`cfg.training.muon_momentum`). The checks are `rules_optimizer.py`'s; the optimizer is built in
`megatron_moe.training.optimizer`.
"""

from __future__ import annotations

import dataclasses

from megatron_moe.config import conditions as only
from megatron_moe.config.fields import arg

MUON_COEFFICIENT_SET_LENGTHS = {"simple": 1, "quintic": 5, "polar_express": 8, "aol": 4}
"""Muon's Newton-Schulz coefficient sets (emerging_optimizers v0.1.0's, platform/emerging_optimizers.py; a unit test
compares) and their lengths: --muon-num-ns-steps must be a multiple."""


@dataclasses.dataclass(kw_only=True)
class OptimizerFlags:
    """The optimizer and Muon's settings (Megatron-LM's flags of the same names)."""

    optimizer: str = arg(
        "adam",
        "adam: megatron-core's Adam(W) for every parameter; muon: megatron-core's Muon (TensorParallelMuon) for the "
        "2-D weights of the transformer layers (each expert's matrix of our MoE layer on its own) and Adam(W) for "
        "the rest (embeddings, output layer, norms, biases); with --use-distributed-optimizer, Muon's layer-wise "
        "distributed optimizer (whole parameters assigned to data-parallel ranks, updated ones all-gathered); "
        "dist_muon: Megatron-LM's deprecated name for muon with --use-distributed-optimizer",
        choices=("adam", "muon", "dist_muon"),
    )
    muon_momentum: float = arg(0.9, "Muon: the momentum (EMA) coefficient", applies=only.MUON)
    muon_nesterov: bool = arg(False, "Muon: Nesterov-style momentum", applies=only.MUON)
    muon_no_split_qkv: bool = arg(
        False, "Muon: orthogonalize the fused QKV weight whole, not Q, K, V apart", applies=only.MUON
    )
    muon_scale_mode: str = arg(
        "spectral",
        "Muon: the update's scale, spectral sqrt(max(out, in)), unit_rms_norm sqrt(out/in) or shape_scaling "
        "sqrt(max(1, out/in))",
        choices=("spectral", "unit_rms_norm", "shape_scaling"),
        applies=only.MUON,
    )
    muon_extra_scale_factor: float = arg(1.0, "Muon: a further factor on the update", applies=only.MUON)
    muon_fp32_matmul_prec: str = arg(
        "medium",
        "Muon: torch's float32 matmul precision in Newton-Schulz (medium: the iteration runs in bfloat16; high: "
        "float32, TF32 on a GPU that has it)",
        choices=("low", "medium", "high"),
        applies=only.MUON,
    )
    muon_coefficient_type: str = arg(
        "quintic",
        "Muon: the Newton-Schulz coefficient set (emerging_optimizers v0.1.0's)",
        choices=tuple(MUON_COEFFICIENT_SET_LENGTHS),
        applies=only.MUON,
    )
    muon_num_ns_steps: int = arg(5, "Muon: Newton-Schulz steps (a multiple of the set's length)", applies=only.MUON)
    muon_tp_mode: str = arg(
        "duplicated",
        "Muon: Newton-Schulz of a tensor-parallel weight: duplicated (all-gathered, each rank orthogonalizes the "
        "whole matrix) or distributed (on the shards, Gram matrices all-reduced): both TP-invariant; blockwise "
        "(each shard alone: the update depends on TP)",
        choices=("blockwise", "duplicated", "distributed"),
        applies=only.MUON,
    )

    @property
    def uses_muon(self) -> bool:
        """--optimizer muon or dist_muon."""
        return self.optimizer in ("muon", "dist_muon")
