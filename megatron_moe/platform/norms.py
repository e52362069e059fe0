"""Torch LayerNorm / RMSNorm that work under sequence parallelism.

megatron-core requires sequence parallelism for MoE with TP>1, but its plain
torch norm (`WrappedTorchNorm`) refuses it and the norms that allow it (apex,
transformer-engine) are GPU builds. Under sequence parallelism each TP rank
normalises its own slice of the sequence with a replicated weight, so the
weight's gradient is partial per rank: marking the parameters
`sequence_parallel` makes `finalize_model_grads` all-reduce them over TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig


class SequenceParallelNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (by `config.normalization`) with megatron's constructor."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ):
        super().__init__()
        self.normalization = normalization or config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization={self.normalization!r} is not supported; choose LayerNorm or RMSNorm")
        self.zero_centered_gamma = zero_centered_gamma or config.layernorm_zero_centered_gamma
        self.eps = eps
        self.hidden_size = hidden_size
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
