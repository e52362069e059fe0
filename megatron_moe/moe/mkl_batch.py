"""MKL's batched sgemm on the host: many row-major fp32 GEMMs of different sizes in one call.

Legend: G = GEMMs in the batch; each computes C_g[m_g, n_g] = A_g[m_g, k_g] @ B_g[k_g, n_g].

torch's x86 CPU builds export MKL's Fortran `SGEMM_BATCH` from libtorch_cpu.so (LP64). A loop of torch.mm hands
MKL one small GEMM at a time, each split over the intra-op threads; one batched call gives whole GEMMs to threads,
each running the sgemm a torch.mm of its size runs (the same bits: `grouped_gemm._batch_matches_mm` probes it).
Why and what it gains: docs/kernels.md.

`grouped_sgemm` takes the G operands as base tensors, per-GEMM element offsets and one pair of strides per operand
(a row-major view with one unit stride), all sizes and offsets as host integers: building the call reads nothing
back from a tensor. Where the symbol is absent (an OpenBLAS build, another architecture) `available()` is False.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

_N, _T = ord("N"), ord("T")


@functools.cache
def _sgemm_batch():
    """libtorch_cpu.so's SGEMM_BATCH (15 pointer arguments), or None where this torch does not export it."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.SGEMM_BATCH
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, [ctypes.c_void_p] * 15
    return fn


def available() -> bool:
    return _sgemm_batch() is not None


def _column_major(strides: tuple[int, int], rows: int, cols: int) -> tuple[int, int] | None:
    """(op, ld) under which Fortran reads the transpose of a row-major view of at most [rows, cols] with
    `strides`, or None where it cannot (no unit stride, or a leading dimension BLAS would refuse). The transpose
    of a row-major matrix is a column-major one: a view with unit column stride is the column-major [cols, rows]
    matrix as it lies (N, ld = row stride), one with unit row stride is the column-major [rows, cols] matrix read
    transposed (T, ld = column stride)."""
    s0, s1 = strides
    if s1 == 1 and s0 >= max(1, cols):
        return _N, s0
    if s0 == 1 and s1 >= max(1, rows):
        return _T, s1
    return None


def _most(size: int | list[int]) -> int:
    return max(size) if isinstance(size, list) else size


def _int32(values: int | list[int], count: int) -> torch.Tensor:
    if isinstance(values, list):
        return torch.tensor(values, dtype=torch.int32)
    return torch.full((count,), values, dtype=torch.int32)


def _pointers(t: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The addresses of `t`'s elements at `offsets`, as Fortran's pointer array."""
    return torch.tensor(offsets, dtype=torch.int64).mul_(t.element_size()).add_(t.data_ptr())


def grouped_sgemm(
    a: torch.Tensor, a_offsets: list[int], a_strides: tuple[int, int],
    b: torch.Tensor, b_offsets: list[int], b_strides: tuple[int, int],
    c: torch.Tensor, c_offsets: list[int], c_row_stride: int,
    m: int | list[int], n: int | list[int], k: int | list[int],
) -> bool:  # fmt: skip
    """C_g = A_g @ B_g for each g in one SGEMM_BATCH call (overwriting C_g); False, running nothing, where an
    operand does not fit (not fp32 on the host, no unit stride, a leading dimension BLAS refuses, no symbol).

    A_g is the [m_g, k_g] view of `a` at element offset `a_offsets[g]` with `a_strides`; B_g [k_g, n_g] and
    C_g [m_g, n_g] (column stride 1, row stride `c_row_stride`) likewise. m, n, k: an int (every GEMM) or G
    ints, each at least 1 (the caller leaves empty GEMMs out: k = 0 would leave C_g as it was, not zero). The
    caller owns the bounds: every view must lie inside its tensor. Row-major C = A B is column-major
    C^T = B^T A^T, so B goes in as Fortran's first operand.
    """
    fn, groups = _sgemm_batch(), len(a_offsets)
    big_m, big_n, big_k = _most(m), _most(n), _most(k)
    a_layout, b_layout = _column_major(a_strides, big_m, big_k), _column_major(b_strides, big_k, big_n)
    dtypes_fit = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (a, b, c))
    if fn is None or not dtypes_fit or a_layout is None or b_layout is None or c_row_stride < max(1, big_n):
        return False
    (a_op, a_ld), (b_op, b_ld) = a_layout, b_layout
    args = [
        torch.full((groups,), b_op, dtype=torch.uint8),
        torch.full((groups,), a_op, dtype=torch.uint8),
        _int32(n, groups),
        _int32(m, groups),
        _int32(k, groups),
        torch.ones(groups, dtype=torch.float32),  # alpha
        _pointers(b, b_offsets),
        _int32(b_ld, groups),
        _pointers(a, a_offsets),
        _int32(a_ld, groups),
        torch.zeros(groups, dtype=torch.float32),  # beta: overwrite
        _pointers(c, c_offsets),
        _int32(c_row_stride, groups),
        torch.tensor([groups], dtype=torch.int32),
        torch.ones(groups, dtype=torch.int32),  # group sizes: one GEMM per group
    ]
    fn(*(t.data_ptr() for t in args))
    return True
