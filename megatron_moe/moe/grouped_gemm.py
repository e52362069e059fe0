"""Grouped GEMM: rows grouped by expert times each expert's own weight, in one call.

Legend: N = rows (all experts), E = experts, I = input width, O = output width.

`GroupedLinear.apply(x_NI, w_EOI, counts)` computes y[rows of e] = x[rows of e] @ w[e].T.
Kernels, best first: one `torch.bmm` when every group has the same rows
(capacity-padded), the `grouped_gemm` package on an accelerator (it has its
own backward), `torch._grouped_mm` where it runs (CPU in torch 2.13: forward
and both backward GEMMs, checked once by a probe), else one `torch.mm` per
expert into slices of one buffer. The backward is written as two separate
steps, `grouped_input_grad` (dX, on the critical path) and `grouped_weight_grad` (dW), so a
scheduler can later run dW while an all-to-all is in flight.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools

import torch

from megatron_moe.platform import from_host


@functools.cache
def _torch_grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Probe torch._grouped_mm for the two shapes we use (3-D weights; 2-D x 2-D weight grad)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(3, 8, dtype=dtype, device=device_type)
        w = torch.ones(2, 16, 8, dtype=dtype, device=device_type).transpose(1, 2)  # as used: a transposed view
        offs = torch.tensor([1, 3], dtype=torch.int32, device=device_type)
        y = torch._grouped_mm(x, w, offs=offs)
        dw = torch._grouped_mm(y.t(), x, offs=offs)
        return bool(y.shape == (3, 16) and dw.shape == (2, 16, 8) and float(y[0, 0]) == 8.0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def _grouped_gemm_package():
    if importlib.util.find_spec("grouped_gemm") is None:
        return None
    from grouped_gemm import ops

    return ops


def _offsets(counts: list[int], device) -> torch.Tensor:
    """Each group's end row, on `device` (copied without waiting for the device)."""
    return from_host(list(itertools.accumulate(counts)), torch.int32, device)


def _use_torch_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel runs here and the widths keep every stride 16-byte aligned (its requirement)."""
    aligned = all(n * a.element_size() % 16 == 0 for n in (a.shape[-1], b.shape[-1], b.shape[-2]))
    return aligned and _torch_grouped_mm_works(a.device.type, a.dtype)


def _equal_groups(counts: list[int]) -> bool:
    """Every expert has the same number of rows, at least one (capacity-padded): one batched GEMM fits."""
    return bool(counts) and counts[0] > 0 and all(c == counts[0] for c in counts)


def grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, counts: list[int], out=None) -> torch.Tensor:
    """y = x @ w[e] per group; w_EIO may be a transposed view. With `out`, written into it."""
    if _equal_groups(counts):
        groups, rows = len(counts), counts[0]
        y = torch.bmm(x_NI.reshape(groups, rows, -1), w_EIO, out=None if out is None else out.view(groups, rows, -1))
        return y.view(groups * rows, -1)
    if out is None and _use_torch_grouped_mm(x_NI, w_EIO):
        return torch._grouped_mm(x_NI, w_EIO, offs=_offsets(counts, x_NI.device))
    out = x_NI.new_empty(x_NI.shape[0], w_EIO.shape[2]) if out is None else out
    start = 0
    for e, count in enumerate(counts):
        if count:
            torch.mm(x_NI[start : start + count], w_EIO[e], out=out[start : start + count])
        start += count
    return out


def grouped_input_grad(grad_NO: torch.Tensor, w_EOI: torch.Tensor, counts: list[int], out=None) -> torch.Tensor:
    return grouped_mm(grad_NO, w_EOI, counts, out)


def grouped_weight_grad(grad_NO: torch.Tensor, x_NI: torch.Tensor, counts: list[int], out=None) -> torch.Tensor:
    """dW[e] = grad[rows of e].T @ x[rows of e]  -> [E, O, I] (zero for an expert without rows)."""
    if _equal_groups(counts):
        groups, rows = len(counts), counts[0]
        return torch.bmm(grad_NO.reshape(groups, rows, -1).transpose(1, 2), x_NI.reshape(groups, rows, -1), out=out)
    if out is None and _use_torch_grouped_mm(grad_NO, x_NI):
        return torch._grouped_mm(grad_NO.t(), x_NI, offs=_offsets(counts, x_NI.device))
    out = x_NI.new_empty(len(counts), grad_NO.shape[1], x_NI.shape[1]) if out is None else out
    start = 0
    for e, count in enumerate(counts):
        if count:
            torch.mm(grad_NO[start : start + count].t(), x_NI[start : start + count], out=out[e])
        else:
            out[e].zero_()
        start += count
    return out


class GroupedLinear(torch.autograd.Function):
    """y_NO = grouped x_NI @ w_EOI[e].T, rows of expert e contiguous (`counts[e]` of them)."""

    @staticmethod
    def forward(ctx, x_NI, w_EOI, counts):
        ctx.save_for_backward(x_NI, w_EOI)
        ctx.counts = counts
        if x_NI.shape[0] == 0:
            return x_NI.new_zeros(0, w_EOI.shape[1])
        return grouped_mm(x_NI, w_EOI.transpose(1, 2), counts)

    @staticmethod
    def backward(ctx, grad_NO):
        x_NI, w_EOI = ctx.saved_tensors
        if x_NI.shape[0] == 0:
            return torch.zeros_like(x_NI), torch.zeros_like(w_EOI), None
        grad_NO = grad_NO.contiguous()
        grad_x = grouped_input_grad(grad_NO, w_EOI, ctx.counts) if ctx.needs_input_grad[0] else None
        grad_w = grouped_weight_grad(grad_NO, x_NI, ctx.counts) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def uses_grouped_gemm_package(x_NI: torch.Tensor) -> bool:
    """Whether `grouped_linear` runs the `grouped_gemm` package (its own autograd) for these rows."""
    return x_NI.device.type != "cpu" and x_NI.shape[0] > 0 and _grouped_gemm_package() is not None


def grouped_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Differentiable grouped GEMM; picks the fastest kernel this device has."""
    if uses_grouped_gemm_package(x_NI):
        batch_sizes = torch.tensor(counts, dtype=torch.long)  # the package wants them on the host
        return _grouped_gemm_package().gmm(x_NI, w_EOI, batch_sizes, trans_b=True)
    return GroupedLinear.apply(x_NI, w_EOI, counts)


def kernel_name(device_type: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Which grouped kernel runs here (for logs and the benchmark)."""
    if device_type != "cpu" and _grouped_gemm_package() is not None:
        return "grouped_gemm"
    return "torch._grouped_mm" if _torch_grouped_mm_works(device_type, dtype) else "mm-loop"
