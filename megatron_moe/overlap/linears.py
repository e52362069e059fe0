"""megatron-core's local Column/RowParallelLinear whose weight-gradient GEMM may be deferred.

The layer spec (`megatron_moe.model.spec`) uses these for attention's QKV and
output projections and the dense MLP's fc1/fc2. With the default store
(`RUN_NOW`, `defers` False) `_forward_impl` is megatron-core's, untouched. With
a store that defers, `_LinearDeferringWeightGrad` runs instead: a copy of
megatron-core 0.16.1's `LinearWithGradAccumulationAndAsyncCommunication`
(tensor_parallel/layers.py) for the cases this project runs (no gradient
accumulation fusion, no embedding wgrad buffer) whose backward computes the
input and bias gradients exactly as megatron-core does and hands the weight
gradient `grad_output.t().matmul(total_input)` to the store as a closure.
Under sequence parallelism the closure owns its gathered input (megatron-core
gathers into a shared global buffer that the next layer's backward reuses).
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.parallel_state import get_global_memory_buffer
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    custom_bwd,
    custom_fwd,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.utils import get_tensor_model_parallel_group_if_none, prepare_input_tensors_for_wgrad_compute

from megatron_moe.comm.tensor_parallel import all_reduce_input_grad, gather_sequence_shards, reduce_scatter_sequence
from megatron_moe.config.fields import require
from megatron_moe.moe.weight_grad import DeferrableWeights, WeightGrad, WeightGradStore
from megatron_moe.platform.cpu_compat import Patch, source, source_sha256

_MCORE_LINEAR = inspect.signature(linear_with_grad_accumulation_and_async_allreduce)
"""The arguments megatron-core's `_forward_impl` passes on (by keyword) to its linear function."""


def _linear_weight_grad(grad_output: torch.Tensor, total_input: torch.Tensor) -> WeightGrad:
    """megatron-core's dW GEMM as a closure over the (2D, contiguous) tensors it reads: out -> (dW,)."""

    def weight_grad(out=None):
        with torch.no_grad():
            grad_weight = grad_output.t().matmul(total_input)
            return (grad_weight if out is None else out.copy_(grad_weight),)

    return weight_grad


class _LinearDeferringWeightGrad(torch.autograd.Function):
    """megatron-core's LinearWithGradAccumulationAndAsyncCommunication with the dW GEMM given to `store`."""

    @staticmethod
    @custom_fwd  # megatron-core's autocast handling (its device-specific partial), as in its own function
    def forward(ctx, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, store: WeightGradStore):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group, ctx.store = (
            allreduce_dgrad,
            sequence_parallel,
            tp_group,
            store,
        )
        if sequence_parallel:
            total_input = _gathered(input, tp_group)
        else:
            total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        tp_group = ctx.tp_group
        # 1. (SP) start gathering the input again, into a tensor the dW closure owns.
        # 2. dX = grad_output @ W, then start its all-reduce (no SP) or reduce-scatter (SP) over TP.
        # 3. hand the dW GEMM to the store (run now or later), bias grad, wait for the step-2 collective.
        handle = None
        total_input = input
        if ctx.sequence_parallel:
            total_input = input.new_empty((input.shape[0] * tp_group.size(), *input.shape[1:]))
            handle = gather_sequence_shards(total_input, input, tp_group)
        grad_input = grad_output.matmul(weight)
        if handle is not None:
            handle.wait()
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)

        if ctx.allreduce_dgrad:
            handle = all_reduce_input_grad(grad_input, tp_group)
        if ctx.sequence_parallel:
            assert not ctx.allreduce_dgrad
            sub_grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device, requires_grad=False)
            handle = reduce_scatter_sequence(sub_grad_input, grad_input, tp_group)
            grad_input = sub_grad_input

        grads = ctx.store.put(_linear_weight_grad(grad_output, total_input), (None,))
        grad_weight = None if grads is None else grads[0]
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if handle is not None:  # the step-2 collective (the step-1 gather was waited above)
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _gathered(input: torch.Tensor, tp_group) -> torch.Tensor:
    """Every TP rank's sequence shard of `input` along dim 0, in megatron-core's shared buffer (forward only)."""
    dim_size = [input.shape[0] * tp_group.size(), *input.shape[1:]]
    total_input = get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
    handle = gather_sequence_shards(total_input, input, tp_group)
    if handle is not None:
        handle.wait()
    return total_input


class _DeferrableParallelLinear(DeferrableWeights):
    """The `_forward_impl` override shared by both parallel linears; `weight` is the only deferred parameter."""

    weight: torch.nn.Parameter | None
    weight_grad_store: WeightGradStore

    def deferred_params(self) -> list[torch.nn.Parameter]:
        return [] if self.weight is None else [self.weight]

    def _forward_impl(self, input, weight, *args, **kwargs):
        store = self.weight_grad_store
        if not store.defers or weight is not self.weight or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        call = _MCORE_LINEAR.bind(input, weight, *args, **kwargs)
        call.apply_defaults()
        options = call.arguments
        for field, on in (
            ("gradient_accumulation_fusion", options["gradient_accumulation_fusion"]),
            ("defer_embedding_wgrad_compute", options["grad_output_buffer"] is not None),
        ):
            expected = "must be False while --overlap-wgrad defers weight gradients (as megatron_moe builds models)"
            require(not on, f"TransformerConfig.{field}", True, expected)
        tp_group = get_tensor_model_parallel_group_if_none(options["tp_group"])
        allreduce_dgrad, sequence_parallel = options["allreduce_dgrad"], options["sequence_parallel"]
        return _LinearDeferringWeightGrad.apply(
            input, weight, options["bias"], allreduce_dgrad, sequence_parallel, tp_group, store
        )


class DeferrableColumnParallelLinear(_DeferrableParallelLinear, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear; its dW GEMM goes to `weight_grad_store`."""


class DeferrableRowParallelLinear(_DeferrableParallelLinear, RowParallelLinear):
    """megatron-core's RowParallelLinear; its dW GEMM goes to `weight_grad_store`."""


UPSTREAM_LINEAR = ("megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication")
UPSTREAM_LINEAR_SHA256 = "3d4f0816be38b490d9d7688778d5c001229a84007ced54e5dc36a5fbe7e36650"
"""megatron-core 0.16.1's `LinearWithGradAccumulationAndAsyncCommunication`, which `_LinearDeferringWeightGrad`
copies: any other text is a change the copy has not seen."""


def _copied_linear_is_current() -> bool:
    return source_sha256(*UPSTREAM_LINEAR) == UPSTREAM_LINEAR_SHA256


def _layers_forward_through_forward_impl() -> bool:
    layers = source("megatron.core.tensor_parallel.layers")
    return layers.count("output_parallel = self._forward_impl(") == 2 and set(_MCORE_LINEAR.parameters) >= {
        "input",
        "weight",
        "bias",
        "allreduce_dgrad",
        "sequence_parallel",
        "tp_group",
    }


PROBES: tuple[Patch, ...] = (
    Patch(
        "deferring_linear_copy",
        "overlap/linears.py: _LinearDeferringWeightGrad is a copy of megatron-core's "
        "LinearWithGradAccumulationAndAsyncCommunication whose dW GEMM goes to a store (Lancet, --overlap-wgrad).",
        None,
        _copied_linear_is_current,
    ),
    Patch(
        "deferrable_parallel_linears",
        "overlap/linears.py: Deferrable{Column,Row}ParallelLinear override _forward_impl, which megatron-core's "
        "Column/RowParallelLinear.forward call with the linear function's arguments.",
        None,
        _layers_forward_through_forward_impl,
    ),
)
