"""`F.linear(x, w)` (no bias) whose weight-gradient GEMM goes through a `WeightGradStore`.

For the router and the shared expert: the arithmetic is exactly what autograd
runs for `F.linear` (one `mm` each for forward, dX and dW, on the same operands
in the same layout, see `_input_grad`/`_weight_grad`), so a deferred weight
gradient is bit-identical to the one autograd would have accumulated. With
`cast_weight` the weight is used in fp32, as `F.linear(x, w.float())`, and its
gradient is cast back to the weight's dtype as `Tensor.float()`'s backward does.

Legend: T = tokens (the input's leading dims flattened), I = in features, O = out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.moe.weight_grad import WeightGrad, WeightGradStore, at_position


def _is_column_major(t_2d: torch.Tensor) -> bool:
    """autograd's test (mm_mat1/mat2_backward) for an mm operand laid out column by column."""
    return t_2d.stride(0) == 1 and t_2d.stride(1) == t_2d.shape[0]


def _input_grad(grad_TO: torch.Tensor, x_TI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """dX of `x_TI @ w_OI.t()` as autograd's mm backward computes it (mm_mat1_backward, mat2 = w.t())."""
    if _is_column_major(x_TI):
        return w_OI.t().mm(grad_TO.t()).t()
    return grad_TO.mm(w_OI)


def _weight_grad_now(grad_TO: torch.Tensor, x_TI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """dW of `x_TI @ w_OI.t()` as autograd computes it: mm_mat2_backward for mat2 = w.t(), then t()'s backward."""
    if _is_column_major(w_OI.t()):
        return grad_TO.t().mm(x_TI)
    return x_TI.t().mm(grad_TO).t()


def linear_weight_grad(grad_TO: torch.Tensor, x_TI: torch.Tensor, w_OI: torch.Tensor, dtype: torch.dtype) -> WeightGrad:
    """The dW GEMM as a closure over what it reads: out -> (dW in `dtype`,)."""

    def weight_grad(out=None):
        with torch.no_grad():  # also when a store runs it after backward
            grad_OI = _weight_grad_now(grad_TO, x_TI, w_OI).to(dtype)
            return (grad_OI if out is None else out.copy_(grad_OI),)

    return weight_grad


class StoreLinear(torch.autograd.Function):
    """y = F.linear(x, w) (w in fp32 with `cast_weight`); backward: dX here, dW through `store`."""

    @staticmethod
    def forward(ctx, x, weight, store: WeightGradStore, cast_weight: bool):
        w_OI = weight.float() if cast_weight else weight
        ctx.save_for_backward(x, w_OI)
        ctx.store, ctx.weight_dtype = store, weight.dtype
        return F.linear(x, w_OI)

    @staticmethod
    def backward(ctx, grad_y):
        x, w_OI = ctx.saved_tensors
        # matmul folds the leading dims of x into rows (a view for a contiguous x), as F.linear's autograd does.
        x_TI, grad_TO = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = _input_grad(grad_TO, x_TI, w_OI).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grads = ctx.store.put(linear_weight_grad(grad_TO, x_TI, w_OI, ctx.weight_dtype), (None,))
            grad_w = None if grads is None else grads[0]
        return grad_x, grad_w, None, None


def store_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    store: WeightGradStore,
    *,
    slot: int = 0,
    slots: int = 1,
    cast_weight: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight) (weight.float() with `cast_weight`); a store that defers gets the dW closure, placed
    at `slot` of the module's `slots` deferred weights (`weight_grad.at_position`).
    With a store that does not defer this is plain autograd, unchanged."""
    if not store.defers:
        return F.linear(x, weight.float() if cast_weight else weight)
    return StoreLinear.apply(x, weight, at_position(store, slot, slots), cast_weight)
