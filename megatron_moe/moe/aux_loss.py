"""The router losses' gradient path: the layer output carries them into the backward pass.

The loss a router adds (load balancing, z-loss) is not part of the lm loss the schedule differentiates: the
layer's output passes through `AuxLossAutoScaler`, whose backward also feeds the router losses their gradient,
scaled as the lm loss is (`megatron_moe.moe.metrics.set_moe_aux_loss_scale` sets the scale).
"""

from __future__ import annotations

import torch


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on the layer output whose backward also feeds d(aux)/d(aux) = scale into the router.

    The scale is taken when the forward runs (`scale` argument), not from a
    global: the loop sets it to loss_scale / num_microbatches, exactly the
    factor megatron-core's schedule applies to the lm loss, so the aux-loss
    gradient of a step is the mean over its micro-batches whatever their number.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None
