"""Shared expert / dense-MoE residual (Arctic, DeepSpeed residual MoE).

A dense MLP beside the routed experts, applied to every token, whose output is
added to the MoE output. It needs nothing from the routed path, so the layer
runs it after starting the dispatch all-to-all and before waiting on it.

Legend: T = tokens, H = hidden, F = shared ffn width (x2 for SwiGLU).

Its weights are replicated over tensor-parallel ranks (not split): under
sequence parallelism each TP rank applies it to its own tokens, so the
parameters are marked `sequence_parallel` and `finalize_model_grads` sums
their gradients over TP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_moe.moe.ffn import ffn_activation


class SharedExpert(torch.nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        ffn_hidden_size: int,
        gated: bool,
        init_method: Callable,
        output_init_method: Callable,
        sequence_parallel: bool,
        params_dtype=torch.float32,
    ):
        super().__init__()
        self.gated = gated
        width = 2 * ffn_hidden_size if gated else ffn_hidden_size
        self.weight1 = torch.nn.Parameter(torch.empty(width, hidden_size, dtype=params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=params_dtype))
        with torch.no_grad():
            init_method(self.weight1)
            output_init_method(self.weight2)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return F.linear(ffn_activation(F.linear(x_TH, self.weight1), self.gated), self.weight2)
