"""The GPU's grouped kernels as they behave where the CPU ones hide it, for unit tests on CPU.

- `GpuLikeGroupedGemm`: the `grouped_gemm` package's `backend.gmm` as its CUDA build behaves: bf16 operands
  only (csrc/grouped_gemm.cu checks a, b and c for kBFloat16; its issue #19), an output it allocates with
  torch.empty, and an empty group's part of that output never written (its issue #36).
- `gpu_like_grouped_mm`: torch._grouped_mm as on the GPUs of pytorch#172439: the weight gradient (2-D x 2-D,
  groups along K) of an empty group is not zero.
- `poison_allocations`: torch.empty, torch.empty_like and Tensor.new_empty hand back NaN (floating dtypes), as
  a block the caching allocator recycles can hold, so that memory a kernel never writes shows.
NaN stands for "anything": a value that no correct path keeps, and one that no sum hides.
"""

import itertools
import sys
import types

import torch

from megatron_moe.moe import grouped_gemm

NAN = float("nan")


class GpuLikeGroupedGemm:
    """A pure-torch `grouped_gemm.backend.gmm` with the package's signature, checks and empty-group behaviour."""

    def __init__(self):
        self.calls: list[tuple[torch.dtype, bool, bool]] = []

    def gmm(self, a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
        for name, t in (("a", a), ("b", b), ("c", c)):  # the package's order of checks, and its message
            if t is not None and t.dtype != torch.bfloat16:
                raise RuntimeError(f"Expected {name}.scalar_type() == torch::kBFloat16 to be true, but got false.")
        assert a.is_contiguous() and b.is_contiguous() and not (trans_a and trans_b)
        assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.long
        self.calls.append((a.dtype, trans_a, trans_b))
        sizes = batch_sizes.tolist()
        if c is None:  # torch.empty on the device: whatever the block held
            shape = (len(sizes), a.shape[1], b.shape[1]) if trans_a else (a.shape[0], b.shape[1 if trans_b else 2])
            c = torch.full(shape, NAN, dtype=a.dtype)
        for e, (start, size) in enumerate(zip(itertools.accumulate(sizes, initial=0), sizes)):
            if not size:  # skipped: c[e] (dW) keeps what it held
                continue
            rows = slice(start, start + size)
            if trans_a:
                torch.mm(a[rows].t(), b[rows], out=c[e])
            else:
                torch.mm(a[rows], b[e].t() if trans_b else b[e], out=c[rows])
        return c


def install_grouped_gemm(monkeypatch, backend) -> None:
    """`backend` as the `grouped_gemm` package's `backend` module (undone by `monkeypatch`; the caller clears
    `grouped_gemm._grouped_gemm_backend`'s cache again after the test)."""
    package = types.ModuleType("grouped_gemm")
    package.backend = backend
    monkeypatch.setitem(sys.modules, "grouped_gemm", package)
    grouped_gemm._grouped_gemm_backend.cache_clear()


def install_gpu_like_grouped_mm(monkeypatch) -> list[tuple[int, int]]:
    """torch._grouped_mm whose weight gradient of an empty group is NaN (the real op computes the rest); returns
    the list it records each call's operand dims in."""
    real, calls = torch._grouped_mm, []

    def gpu_like_grouped_mm(mat_a, mat_b, *args, offs=None, **kwargs):
        calls.append((mat_a.dim(), mat_b.dim()))
        out = real(mat_a, mat_b, *args, offs=offs, **kwargs)
        if mat_a.dim() == 2 and mat_b.dim() == 2:  # groups along K: out[g] = mat_a[:, group g] @ mat_b[group g]
            ends = offs.tolist()
            for g, (start, end) in enumerate(zip([0, *ends], ends)):
                if start == end:
                    out[g] = NAN
        return out

    monkeypatch.setattr(torch, "_grouped_mm", gpu_like_grouped_mm)
    return calls


def poison_allocations(monkeypatch) -> None:
    """Uninitialised floating-point allocations made from Python come back full of NaN."""

    def poisoned(allocate):
        def allocate_poisoned(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return t.fill_(NAN) if t.is_floating_point() else t

        return allocate_poisoned

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))
