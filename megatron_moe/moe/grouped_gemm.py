"""Grouped GEMM: rows grouped by expert times each expert's own weight, in one call.

Legend: R = rows (all experts), E = experts, I = input width, O = output width.

`GroupedLinear.apply(x_RI, w_EOI, counts)` computes y[rows of e] = x[rows of e] @ w[e].T with the first of
`KERNELS` that fits the operands (`grouped_gemm`, `bmm`, `onednn`, `torch._grouped_mm`, `mm-loop`; each that runs
is logged once; `forced_kernel(name)` pins one). The backward is two steps, dX = `grouped_mm(dY, w)` (on the
critical path) and `grouped_weight_grad` (dW, a closure handed to the node's `WeightGradStore`). Invariant: an
expert without rows gets a weight gradient of exactly zero from every kernel. On CPU `mm-loop` and the dW loop
hand their per-expert sgemms to MKL as one batch where it gives the same bits (`mkl_batch`). Each kernel and why:
docs/internals/moe.md and docs/kernels.md.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging

import torch

from megatron_moe.moe import mkl_batch
from megatron_moe.moe.weight_grad import RUN_NOW, WeightGrad, WeightGradStore
from megatron_moe.platform import from_host

log = logging.getLogger(__name__)

KERNELS = ("grouped_gemm", "bmm", "onednn", "torch._grouped_mm", "mm-loop")
"""In the order tried on an accelerator; on CPU `onednn` goes first, before bmm too (its per-group GEMMs beat
MKL's batched one), but `mm-loop` before it for small experts (`SMALL_EXPERT_WEIGHT`), and the grouped_gemm
package (a GPU build) runs only where forced."""
_CPU_ORDER = ("onednn", "bmm", "torch._grouped_mm", "mm-loop")
_CPU_SMALL_ORDER = ("mm-loop", *_CPU_ORDER)
SMALL_EXPERT_WEIGHT = 1 << 20
"""Experts whose weight has fewer elements than this run `mm-loop` on CPU (where `mm_rows_independent`): MKL
writes each expert's rows in place, where oneDNN's fresh output is copied in, and its GEMMs are no slower at
these sizes (docs/kernels.md: fine-grained layers 10-13% faster)."""
MM_MIN_ROWS = 16
"""`mm-loop` on CPU runs an expert of fewer rows through a zero-padded block of this many: MKL's sgemm takes
another path for 1-3, 5-7 and 9-11 rows, whose bits differ from the same rows' in a bigger call."""
GROUPED_GEMM_DTYPES = (torch.bfloat16,)
"""What the `grouped_gemm` package's gmm takes: its csrc/grouped_gemm.cu checks a, b and c for kBFloat16, in the
tgale96 release and in the fanshiqing fork megatron-core's install hint names (its issue #19: the fp16 error)."""
_forced: str | None = None


@contextlib.contextmanager
def forced_kernel(name: str | None):
    """Run every grouped GEMM in this block with kernel `name` (one of `KERNELS`), where it can run."""
    global _forced
    if name is not None and name not in KERNELS:
        raise ValueError(f"grouped GEMM kernel {name!r} is not one of {', '.join(KERNELS)}")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


@functools.cache
def _torch_grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Probe torch._grouped_mm for the two shapes we use (3-D weights; 2-D x 2-D weight grad), per device type
    and dtype: on CUDA torch took bf16 only before 2.9, then fp16 and fp32 too (pytorch#162059: a per-group
    fallback; the fast path stays bf16), so a dtype it refuses is a False here, not an error in a step."""
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
def mm_rows_independent(dtype: torch.dtype, width_in: int, width_out: int, transposed: bool) -> bool:
    """Probe CPU torch.mm (MKL) at one weight shape and layout for the invariant `mm-loop` needs to stand in for
    oneDNN: a row's result is the same bits whatever the call's row count (small ones padded to `MM_MIN_ROWS`)
    and the row's place in it, so the pipelined experts and the EP layouts equal the single process bit for bit.
    It holds at the experts' sizes measured (hidden 128-3072 by FFN 128-3072); not at some tiny ones (8 x 6)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(67, width_in, generator=g).to(dtype)
    w = torch.randn(width_in, width_out, generator=g).to(dtype)
    w = w.t().contiguous().t() if transposed else w
    whole = torch.mm(x, w)
    for count in (1, 3, 5, 11, 16, 17, 31, 40, 67):
        rows = torch.randperm(67, generator=g)[:count]
        if not torch.equal(_mm_rows(x[rows], w, whole.new_empty(count, width_out)), whole[rows]):
            return False
    return True


def _mm_rows(x_RI: torch.Tensor, w_IO: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w by torch.mm, fewer than `MM_MIN_ROWS` rows on CPU through a zero-padded block."""
    if x_RI.shape[0] >= MM_MIN_ROWS or x_RI.device.type != "cpu":
        return torch.mm(x_RI, w_IO, out=out)
    padded = x_RI.new_zeros(MM_MIN_ROWS, x_RI.shape[1])
    padded[: x_RI.shape[0]] = x_RI
    return out.copy_(torch.mm(padded, w_IO)[: x_RI.shape[0]])


def _small_on_cpu(a: torch.Tensor, b: torch.Tensor) -> bool:
    """An expert GEMM of `mm-loop`'s sizes on a CPU whose torch.mm keeps its rows independent (b: [E, I, O])."""
    if b.dim() != 3 or b.shape[1] * b.shape[2] >= SMALL_EXPERT_WEIGHT or a.device.type != "cpu":
        return False
    return mm_rows_independent(a.dtype, b.shape[1], b.shape[2], b.stride(1) < b.stride(2))


def onednn_linear(x_RI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """x @ w.T by oneDNN; either operand may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x_RI, w_OI, None, "none", [], "")


@functools.cache
def onednn_works(dtype: torch.dtype) -> bool:
    """Probe oneDNN's CPU linear as we call it (y; dX with a transposed weight) against torch.mm."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(24, 40, generator=g).to(dtype), torch.randn(56, 40, generator=g).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        y, dx = onednn_linear(a, b), onednn_linear(a @ b.t(), b.t())
        return bool(
            torch.allclose(y, a @ b.t(), rtol=tol, atol=tol * 40)
            and torch.allclose(dx, y @ b, rtol=tol, atol=tol * 2000)
        )
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def _grouped_gemm_backend():
    """The `grouped_gemm` package's `backend` module (`gmm`), or None where it is not installed."""
    try:
        from grouped_gemm import backend
    except ImportError:
        return None
    return backend


def _batch_sizes(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.long)  # the package reads them on the host


def _package_fits(a: torch.Tensor, b: torch.Tensor, out) -> bool:
    """gmm takes contiguous bf16 operands only: `b` is 2-D rows (dW) or 3-D weights, either way round."""
    b_fits = b.is_contiguous() or (b.dim() == 3 and b.transpose(1, 2).is_contiguous())
    out_fits = out is None or (out.is_contiguous() and out.dtype in GROUPED_GEMM_DTYPES)
    dtypes_fit = all(t.dtype in GROUPED_GEMM_DTYPES for t in (a, b))
    return dtypes_fit and a.is_contiguous() and b_fits and out_fits


def _offsets(counts: list[int], device) -> torch.Tensor:
    """Each group's end row, on `device` (copied without waiting for the device)."""
    return from_host(list(itertools.accumulate(counts)), torch.int32, device)


def _equal_groups(counts: list[int]) -> bool:
    """Every expert has the same number of rows, at least one (capacity-padded): one batched GEMM fits."""
    return bool(counts) and counts[0] > 0 and all(c == counts[0] for c in counts)


def _fits(kernel: str, a: torch.Tensor, b: torch.Tensor, counts: list[int], out) -> bool:
    if kernel == "grouped_gemm":
        return _grouped_gemm_backend() is not None and _package_fits(a, b, out)
    if kernel == "bmm":
        return _equal_groups(counts)
    if kernel == "onednn":
        return a.device.type == "cpu" and onednn_works(a.dtype)
    if kernel == "torch._grouped_mm":  # no out=; every stride 16-byte aligned (its requirement)
        aligned = all(n * a.element_size() % 16 == 0 for n in (a.shape[-1], b.shape[-1], b.shape[-2]))
        return out is None and aligned and _torch_grouped_mm_works(a.device.type, a.dtype)
    return kernel == "mm-loop"


def _choose(a: torch.Tensor, b: torch.Tensor, counts: list[int], out) -> str:
    """The kernel for the groups of `a` times `b`: the forced one if it fits, else the first that does."""
    order = KERNELS
    if a.device.type == "cpu":
        order = _CPU_SMALL_ORDER if _small_on_cpu(a, b) else _CPU_ORDER
    return next(k for k in ((_forced,) if _forced else ()) + order if _fits(k, a, b, counts, out))


def _kernel(a: torch.Tensor, b: torch.Tensor, counts: list[int], out) -> str:
    """`_choose`'s kernel, which is about to run (logged once per device type, dtype and kernel)."""
    kernel = _choose(a, b, counts, out)
    _log_kernel(a.device.type, a.dtype, kernel)
    return kernel


@functools.cache
def _log_kernel(device_type: str, dtype: torch.dtype, kernel: str) -> None:
    """Once per (device type, dtype, kernel): which kernel the grouped GEMMs run (the forward's and the weight
    gradient's may differ: an `out` buffer or a transposed operand rules some out)."""
    why = ""
    if kernel != "grouped_gemm" and dtype not in GROUPED_GEMM_DTYPES and _grouped_gemm_backend() is not None:
        why = f" (grouped_gemm takes {', '.join(_dtype_name(t) for t in GROUPED_GEMM_DTYPES)} only)"
    log.info("grouped GEMM on %s for %s: %s%s", device_type, _dtype_name(dtype), kernel, why)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _groups(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, its rows) of every expert with rows."""
    starts = itertools.accumulate(counts, initial=0)
    return [(e, slice(start, start + count)) for e, (start, count) in enumerate(zip(starts, counts)) if count]


def _zero_empty_experts(dw_EOI: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """dW of every expert without rows set to exactly 0 (each run of such experts one fill), whatever was there.

    The kernels leave them as their output held: the grouped_gemm package skips an empty group and allocates
    its output with torch.empty (its issue #36), torch._grouped_mm has written non-zero values there on some
    GPUs (pytorch#172439), and an `out` handed in (a slice of a fresh buffer, main_grad) holds anything."""
    start = 0
    for empty, run in itertools.groupby(counts, key=lambda count: count == 0):
        size = len(list(run))
        if empty:
            dw_EOI[start : start + size].zero_()
        start += size
    return dw_EOI


def grouped_mm(x_RI: torch.Tensor, w_EIO: torch.Tensor, counts: list[int], out=None) -> torch.Tensor:
    """y = x @ w[e] per group; w_EIO may be a transposed view. With `out`, written into it."""
    if x_RI.shape[0] == 0:  # no rows (a run of empty experts, a rank that received nothing): no kernel to run
        return x_RI.new_empty(0, w_EIO.shape[2]) if out is None else out
    kernel = _kernel(x_RI, w_EIO, counts, out)
    if kernel == "grouped_gemm":
        trans_b = not w_EIO.is_contiguous()  # w_EIO as the transposed view of contiguous [E, O, I] weights
        w = w_EIO.transpose(1, 2) if trans_b else w_EIO
        return _grouped_gemm_backend().gmm(x_RI, w, _batch_sizes(counts), trans_a=False, trans_b=trans_b, c=out)
    if kernel == "bmm":
        groups, rows = len(counts), counts[0]
        y = torch.bmm(x_RI.reshape(groups, rows, -1), w_EIO, out=None if out is None else out.view(groups, rows, -1))
        return y.view(groups * rows, -1)
    if kernel == "torch._grouped_mm":
        return torch._grouped_mm(x_RI, w_EIO, offs=_offsets(counts, x_RI.device))
    groups = _groups(counts)
    if kernel == "onednn" and out is None and len(groups) == 1:
        return onednn_linear(x_RI, w_EIO[groups[0][0]].t())  # one expert has all the rows: no copy
    out = x_RI.new_empty(x_RI.shape[0], w_EIO.shape[2]) if out is None else out
    if kernel == "mm-loop":
        return _mm_loop(x_RI, w_EIO, groups, out)
    for e, rows in groups:
        out[rows].copy_(onednn_linear(x_RI[rows], w_EIO[e].t()))
    return out


def _mm_loop(x_RI: torch.Tensor, w_EIO: torch.Tensor, groups: list[tuple[int, slice]], out: torch.Tensor):
    """`mm-loop`'s GEMMs: torch.mm per expert (`_mm_rows`); those of `MM_MIN_ROWS` rows or more as one MKL
    batch (`mkl_batch`) where the probe finds it gives each expert torch.mm's bits."""
    big = [(e, rows) for e, rows in groups if rows.stop - rows.start >= MM_MIN_ROWS]
    if (
        len(big) > 1
        and _batching_pays()
        and _batch_matches_mm("y", x_RI.dtype, w_EIO.shape[1], w_EIO.shape[2], w_EIO.stride(1) == 1)
    ):
        if _batched_mm(x_RI, w_EIO, big, out):
            groups = [(e, rows) for e, rows in groups if rows.stop - rows.start < MM_MIN_ROWS]
    for e, rows in groups:
        _mm_rows(x_RI[rows], w_EIO[e], out[rows])
    return out


def _batched_mm(x_RI: torch.Tensor, w_EIO: torch.Tensor, groups: list[tuple[int, slice]], out: torch.Tensor) -> bool:
    """out[rows of e] = x[rows of e] @ w[e] for `groups`, in one MKL batch (False: the operands do not fit it)."""
    if out.stride(1) != 1:
        return False
    starts = [rows.start for _, rows in groups]
    return mkl_batch.grouped_sgemm(
        x_RI, [r * x_RI.stride(0) for r in starts], x_RI.stride(),
        w_EIO, [e * w_EIO.stride(0) for e, _ in groups], (w_EIO.stride(1), w_EIO.stride(2)),
        out, [r * out.stride(0) for r in starts], out.stride(0),
        m=[rows.stop - rows.start for _, rows in groups], n=w_EIO.shape[2], k=w_EIO.shape[1],
    )  # fmt: skip


def _batched_weight_grad(grad_RO: torch.Tensor, x_RI: torch.Tensor, counts: list[int], dw_EOI: torch.Tensor) -> bool:
    """dw[e] = grad[rows of e].T @ x[rows of e] for every expert with rows, in one MKL batch (False: the operands
    do not fit it; an expert without rows is left as it was)."""
    groups = _groups(counts)
    if len(groups) < 2 or dw_EOI.stride(2) != 1:
        return False
    starts = [rows.start for _, rows in groups]
    return mkl_batch.grouped_sgemm(
        grad_RO, [r * grad_RO.stride(0) for r in starts], (grad_RO.stride(1), grad_RO.stride(0)),
        x_RI, [r * x_RI.stride(0) for r in starts], x_RI.stride(),
        dw_EOI, [e * dw_EOI.stride(0) for e, _ in groups], dw_EOI.stride(1),
        m=grad_RO.shape[1], n=x_RI.shape[1], k=[rows.stop - rows.start for _, rows in groups],
    )  # fmt: skip


def _batching_pays() -> bool:
    """The batch gains by giving whole GEMMs to threads: with one intra-op thread it only adds its set-up (some
    100 us a call; the shared jobs' ranks run one thread each). The bits are the same either way."""
    return torch.get_num_threads() > 1


@functools.cache
def _batch_matches_mm(kind: str, dtype: torch.dtype, width_in: int, width_out: int, transposed: bool) -> bool:
    """Probe, per GEMM kind (`y`: x @ w[e]; `dw`: grad.T @ x) and weight shape and layout, that MKL's batch gives
    every expert the bits torch.mm gives it alone: then `mm-loop` may issue its GEMMs as one batch and every
    invariant of the loop (`mm_rows_independent`, dW as torch.mm's) holds unchanged."""
    if dtype != torch.float32 or not mkl_batch.available():
        return False
    g = torch.Generator().manual_seed(0)
    counts = [16, 17, 31, 67, 40] + ([1, 5] if kind == "dw" else [])  # `mm-loop` pads small ones for y
    x = torch.randn(sum(counts), width_in, generator=g)
    w = torch.randn(len(counts), width_in, width_out, generator=g)
    w = w.transpose(1, 2).contiguous().transpose(1, 2) if transposed else w
    groups = _groups(counts)
    if kind == "y":
        batched, want = x.new_zeros(x.shape[0], width_out), [torch.mm(x[rows], w[e]) for e, rows in groups]
        if not _batched_mm(x, w, groups, batched):
            return False
        got = [batched[rows] for _, rows in groups]
    else:
        grad = torch.randn(x.shape[0], width_out, generator=g)
        batched, want = x.new_zeros(len(counts), width_out, width_in), [grad[r].t() @ x[r] for _, r in groups]
        if not _batched_weight_grad(grad, x, counts, batched):
            return False
        got = [batched[e] for e, _ in groups]
    for a, b in zip(got, want):  # a loop, not a generator: the reads are this probe's own (test_host_read_spans)
        if not torch.equal(a, b):
            return False
    return True


def grouped_weight_grad(grad_RO: torch.Tensor, x_RI: torch.Tensor, counts: list[int], out=None) -> torch.Tensor:
    """dW[e] = grad[rows of e].T @ x[rows of e]  -> [E, O, I] (zero for an expert without rows).

    Under `onednn` this is the mm loop: both operands are transposed views, and
    oneDNN's linear first copies its left one into rows, while torch.mm takes
    them as they are and writes into `out`. Measured per expert on the CI
    machine (fp32, 2 threads), mm vs oneDNN: 221 vs 261 ms for fc1's dW at
    hidden 768 / ffn 3072 / 16 experts / 8192 rows, 13.5 vs 16.4 ms at 256 /
    1024 / 8 / 4096.
    """
    if x_RI.shape[0] == 0:  # no expert has rows: zeros, without a zero-size kernel
        return x_RI.new_zeros(len(counts), grad_RO.shape[1], x_RI.shape[1]) if out is None else out.zero_()
    # Each kernel leaves an empty expert's dW undefined: zeroed at the end.
    kernel = _kernel(grad_RO, x_RI, counts, out)
    if kernel == "grouped_gemm":
        dw = _grouped_gemm_backend().gmm(grad_RO, x_RI, _batch_sizes(counts), trans_a=True, trans_b=False, c=out)
    elif kernel == "bmm":
        groups, rows = len(counts), counts[0]
        dw = torch.bmm(grad_RO.reshape(groups, rows, -1).transpose(1, 2), x_RI.reshape(groups, rows, -1), out=out)
    elif kernel == "torch._grouped_mm":
        dw = torch._grouped_mm(grad_RO.t(), x_RI, offs=_offsets(counts, x_RI.device))
    else:
        dw = x_RI.new_empty(len(counts), grad_RO.shape[1], x_RI.shape[1]) if out is None else out
        shape = (x_RI.dtype, x_RI.shape[1], grad_RO.shape[1], False)
        batched = _batching_pays() and _batch_matches_mm("dw", *shape)
        if not (batched and _batched_weight_grad(grad_RO, x_RI, counts, dw)):
            for e, rows in _groups(counts):
                torch.mm(grad_RO[rows].t(), x_RI[rows], out=dw[e])
    return _zero_empty_experts(dw, counts)


def linear_weight_grad(grad_RO: torch.Tensor, x_RI: torch.Tensor, counts: list[int]) -> WeightGrad:
    """The weight-gradient GEMM of one `GroupedLinear` as a closure over the tensors it reads: out -> (dW,)."""

    def weight_grad(out_w=None):
        with torch.no_grad():  # also when a store runs it after backward (x may be an input that requires grad)
            return (grouped_weight_grad(grad_RO, x_RI, counts, out_w),)

    return weight_grad


class GroupedLinear(torch.autograd.Function):
    """y_RO = grouped x_RI @ w_EOI[e].T, rows of expert e contiguous (`counts[e]` of them).

    Backward: dX here, dW through `store` (`megatron_moe.moe.weight_grad`).
    """

    @staticmethod
    def forward(ctx, x_RI, w_EOI, counts, store: WeightGradStore = RUN_NOW):
        ctx.save_for_backward(x_RI, w_EOI)
        ctx.counts, ctx.store = counts, store
        return grouped_mm(x_RI, w_EOI.transpose(1, 2), counts)

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, w_EOI = ctx.saved_tensors
        grad_RO = grad_RO.contiguous()
        grad_x = grouped_mm(grad_RO, w_EOI, ctx.counts) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:  # without rows too: a zero dW, written into the store's output if it gives one
            grads = ctx.store.put(linear_weight_grad(grad_RO, x_RI, ctx.counts), (None,))
            grad_w = None if grads is None else grads[0]
        return grad_x, grad_w, None, None


def grouped_linear(
    x_RI: torch.Tensor, w_EOI: torch.Tensor, counts: list[int], store: WeightGradStore = RUN_NOW
) -> torch.Tensor:
    """Differentiable grouped GEMM; picks the fastest kernel this device has."""
    return GroupedLinear.apply(x_RI, w_EOI, counts, store)


def kernel_name(device_type: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Which grouped kernel runs here in `dtype` for experts with unequal rows (for logs and the benchmark)."""
    x = torch.empty(3, 16, dtype=dtype, device=device_type)
    return _choose(x, torch.empty(2, 16, 16, dtype=dtype, device=device_type), [1, 2], None)
