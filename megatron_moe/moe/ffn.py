"""The FFN activation of the routed experts and the shared expert: GELU, or SwiGLU over [gate rows, up rows].

Legend: R = rows, F = ffn width (x2 for SwiGLU's gate and up halves, in that order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ffn_activation(h_RF: torch.Tensor, gated: bool) -> torch.Tensor:
    """act(h): SwiGLU silu(gate) * up when `gated` (h is [gate | up] along the last dim), else GELU."""
    if gated:
        gate, up = torch.chunk(h_RF, 2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h_RF)


def ffn_activation_backward_(grad_a: torch.Tensor, h_RF: torch.Tensor, gated: bool) -> torch.Tensor:
    """d act(h) / dh times `grad_a`; GELU writes it over `grad_a` (which the caller owns), SwiGLU scales `grad_a`."""
    if not gated:
        return torch.ops.aten.gelu_backward.grad_input(grad_a, h_RF, grad_input=grad_a)
    gate, up = torch.chunk(h_RF, 2, dim=-1)
    grad_h = torch.empty_like(h_RF)
    grad_gate, grad_up = torch.chunk(grad_h, 2, dim=-1)
    torch.mul(grad_a, F.silu(gate), out=grad_up)
    torch.ops.aten.silu_backward.grad_input(grad_a.mul_(up), gate, grad_input=grad_gate)
    return grad_h
