"""Shared expert / dense-MoE residual (Arctic, DeepSpeed residual MoE).

Legend: T = tokens, H = hidden, F = shared ffn width (x2 for SwiGLU).
In: x_TH; out: a dense MLP's output [T, H] that the layer adds to the MoE output. It needs nothing from the routed
path, so the layer runs it while the dispatch all-to-all is in flight. Its weights are replicated over TP ranks:
under sequence parallelism each applies it to its own tokens, so the parameters are `sequence_parallel` and
`finalize_model_grads` sums their gradients over TP. Both weight-gradient GEMMs can be deferred
(`DeferrableWeights`): fc1's closure returns (dW1, None), fc2's (None, dW2). `gate` (--moe-shared-expert-gate,
Qwen2-MoE): the output times sigmoid(x @ gate_weight^T), megatron-core's SharedExpertMLP arithmetic and name; the
gate's own [1, H] weight gradient is computed at once (not deferred).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_moe.moe.deferred_linear import store_linear
from megatron_moe.moe.ffn import ffn_activation
from megatron_moe.moe.weight_grad import DeferrableWeights


class SharedExpert(torch.nn.Module, DeferrableWeights):
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
        gate: bool = False,
    ):
        super().__init__()
        self.gated = gated
        width = 2 * ffn_hidden_size if gated else ffn_hidden_size
        self.weight1 = torch.nn.Parameter(torch.empty(width, hidden_size, dtype=params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=params_dtype))
        with torch.no_grad():
            init_method(self.weight1)
            output_init_method(self.weight2)
        self.gate_weight = None
        if gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=params_dtype))
            with torch.no_grad():
                init_method(self.gate_weight)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def deferred_params(self) -> list[torch.nn.Parameter]:
        return [self.weight1, self.weight2]

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        store = self.weight_grad_store
        h_TF = store_linear(x_TH, self.weight1, store, slot=0, slots=2)
        out_TH = store_linear(ffn_activation(h_TF, self.gated), self.weight2, store, slot=1, slots=2)
        if self.gate_weight is not None:
            out_TH = out_TH * torch.sigmoid(torch.nn.functional.linear(x_TH, self.gate_weight))
        return out_TH
