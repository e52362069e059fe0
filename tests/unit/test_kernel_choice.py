"""The grouped GEMM kernel is chosen by dtype too: the grouped_gemm package only for bf16, the one
chosen logged once per (device type, dtype, kernel), and `kernel_name` saying what runs.

The package is a fake whose gmm refuses what its CUDA build refuses (`gpu_like_kernels.GpuLikeGroupedGemm`).
On CPU the package is never in the order tried, so the tests that ask what an accelerator would run put CPU
tensors through the accelerator's order (`_CPU_ORDER` and `_CPU_SMALL_ORDER` set to `KERNELS`); on CPU `onednn`
still fits fp32 there.
"""

import logging
import sys

import pytest
import torch

from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.experts import GroupedMLP
from megatron_moe.moe.ffn import ffn_activation
from megatron_moe.moe.grouped_gemm import KERNELS, _kernel, forced_kernel, grouped_linear, kernel_name, onednn_works
from tests.unit.gpu_like_kernels import GpuLikeGroupedGemm, install_grouped_gemm

# Legend: N = rows, E = experts, H = hidden, F = ffn width.
H, F = 16, 24  # multiples of 16 bytes in every dtype here, so torch._grouped_mm fits where it runs
COUNTS = [5, 3, 9, 7]  # unequal (no bmm), every expert with rows (empty experts are test_empty_experts)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative, of a whole gradient


@pytest.fixture
def package(monkeypatch):
    """The grouped_gemm package installed, refusing all but bf16 as its CUDA build does."""
    backend = GpuLikeGroupedGemm()
    install_grouped_gemm(monkeypatch, backend)
    yield backend
    grouped_gemm._grouped_gemm_backend.cache_clear()


@pytest.fixture
def accelerator_order(monkeypatch):
    """CPU tensors go through the kernel order of an accelerator (the package first)."""
    monkeypatch.setattr(grouped_gemm, "_CPU_ORDER", KERNELS)
    monkeypatch.setattr(grouped_gemm, "_CPU_SMALL_ORDER", KERNELS)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), H, generator=g).to(dtype)
    w1 = (torch.randn(len(COUNTS), 2 * F, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(len(COUNTS), H, F, generator=g) * 0.2).to(dtype)
    return x, w1, w2, torch.randn(sum(COUNTS), H, generator=g).to(dtype)


def _mlp(x, w1, w2, dy) -> list[torch.Tensor]:
    """(out, dX, dW1, dW2) of the fused SwiGLU expert MLP over one run of experts."""
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    out = GroupedMLP.apply(*leaves, COUNTS, True, None)
    out.backward(dy)
    return [out.detach()] + [t.grad for t in leaves]


def _loop(x, w1, w2, dy) -> list[torch.Tensor]:
    leaves = [t.double().requires_grad_() for t in (x, w1, w2)]
    rows = torch.split(leaves[0], COUNTS)
    out = torch.cat([ffn_activation(r @ leaves[1][e].t(), True) @ leaves[2][e].t() for e, r in enumerate(rows)])
    out.backward(dy.double())
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("how", ["forced", "accelerator_order"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_grouped_gemm_package_runs_bf16_only(package, monkeypatch, dtype, how):
    """Asked for (forced) or first in the order: the package runs the bf16 GEMMs and no other dtype's, which
    another kernel computes correctly."""
    if how == "accelerator_order":
        monkeypatch.setattr(grouped_gemm, "_CPU_ORDER", KERNELS)
        monkeypatch.setattr(grouped_gemm, "_CPU_SMALL_ORDER", KERNELS)
    x, w1, w2, dy = _inputs(dtype)
    with forced_kernel("grouped_gemm" if how == "forced" else None):
        chosen = _kernel(x, w1.transpose(1, 2), COUNTS, None)
        got = _mlp(x, w1, w2, dy)
    assert (chosen == "grouped_gemm") == (dtype == torch.bfloat16), chosen
    assert {call[0] for call in package.calls} == ({torch.bfloat16} if dtype == torch.bfloat16 else set())
    if dtype == torch.bfloat16:  # every GEMM of the node: y of fc1 and fc2, dA, dX, dW2, dW1
        assert [call[1:] for call in package.calls] == [(False, True)] * 2 + [(False, False)] * 2 + [(True, False)] * 2
    for name, g, want in zip(("out", "dx", "dw1", "dw2"), got, _loop(x, w1, w2, dy)):
        error = (g.double() - want).norm() / want.norm()
        assert error < TOL[dtype], (name, error.item())


def after_the_package(dtype: torch.dtype) -> str:
    """The kernel after the package in the accelerator order for unequal rows (bmm needs equal ones): oneDNN where
    this CPU's oneDNN computes `dtype` (bf16 on a CPU with AVX512-BF16 or AMX; fp16 with AVX512-FP16), else
    torch._grouped_mm."""
    return "onednn" if onednn_works(dtype) else "torch._grouped_mm"


@pytest.mark.usefixtures("package", "accelerator_order")
def test_kernel_name_reports_the_kernel_of_the_dtype():
    assert kernel_name("cpu", torch.bfloat16) == "grouped_gemm"
    assert kernel_name("cpu", torch.float16) == after_the_package(torch.float16)
    assert kernel_name("cpu", torch.float32) not in ("grouped_gemm", "torch._grouped_mm")  # onednn where it runs
    grouped_gemm._grouped_gemm_backend.cache_clear()
    with pytest.MonkeyPatch.context() as mp:  # not installed: the bf16 GEMMs go to the next kernel that fits
        mp.setitem(sys.modules, "grouped_gemm", None)
        assert kernel_name("cpu", torch.bfloat16) == after_the_package(torch.bfloat16)
    grouped_gemm._grouped_gemm_backend.cache_clear()


@pytest.mark.usefixtures("package", "accelerator_order")
def test_the_kernel_that_runs_is_logged_once_per_device_type_dtype_and_kernel(caplog):
    grouped_gemm._log_kernel.cache_clear()  # what earlier tests logged
    caplog.set_level(logging.INFO, logger=grouped_gemm.__name__)
    for _ in range(2):
        for dtype in (torch.bfloat16, torch.float16):
            x, w1, _, _ = _inputs(dtype)
            grouped_linear(x.requires_grad_(), w1.requires_grad_(), COUNTS).sum().backward()  # y, dX, dW
    lines = [record.getMessage() for record in caplog.records if record.name == grouped_gemm.__name__]
    assert lines == [
        "grouped GEMM on cpu for bfloat16: grouped_gemm",
        f"grouped GEMM on cpu for float16: {after_the_package(torch.float16)} (grouped_gemm takes bfloat16 only)",
    ]
    grouped_gemm._log_kernel.cache_clear()


def test_torch_grouped_mm_is_probed_per_dtype(monkeypatch):
    """torch._grouped_mm where it takes bf16 only (CUDA before torch 2.9): chosen for bf16, not for fp16, which
    runs another kernel, correctly."""
    real = torch._grouped_mm

    def bf16_only(mat_a, mat_b, *args, **kwargs):
        if mat_a.dtype != torch.bfloat16:  # torch 2.8's check on CUDA, and its message
            raise RuntimeError(f"Expected mat_a to be BFloat16 matrix got {mat_a.dtype}")
        return real(mat_a, mat_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", bf16_only)
    monkeypatch.setitem(sys.modules, "grouped_gemm", None)  # the package not installed
    grouped_gemm._grouped_gemm_backend.cache_clear()
    grouped_gemm._torch_grouped_mm_works.cache_clear()
    try:
        with forced_kernel("torch._grouped_mm"):
            for dtype in (torch.bfloat16, torch.float16):
                x, w1, w2, dy = _inputs(dtype)
                assert (_kernel(x, w1.transpose(1, 2), COUNTS, None) == "torch._grouped_mm") == (
                    dtype == torch.bfloat16
                )
                for name, g, want in zip(("out", "dx", "dw1", "dw2"), _mlp(x, w1, w2, dy), _loop(x, w1, w2, dy)):
                    error = (g.double() - want).norm() / want.norm()
                    assert error < TOL[dtype], (dtype, name, error.item())
    finally:
        grouped_gemm._torch_grouped_mm_works.cache_clear()  # the real op's answers again
        grouped_gemm._grouped_gemm_backend.cache_clear()


def test_small_experts_run_as_one_run():
    """Below SMALL_EXPERT_WEIGHT FFNExperts runs every expert in one run (CPU too); larger ones keep the platform's."""
    from megatron_moe.moe.experts import SMALL_EXPERT_WEIGHT, FFNExperts
    from megatron_moe.platform import current_platform

    def experts(hidden, ffn):
        init = torch.nn.init.zeros_
        kw = dict(num_local_experts=2, gated=False, init_method=init, output_init_method=init)
        return FFNExperts(hidden_size=hidden, ffn_hidden_size=ffn, **kw)

    assert 32 * 24 < SMALL_EXPERT_WEIGHT and experts(32, 24).chunk_bytes is None
    assert experts(1024, 1024).chunk_bytes == current_platform().expert_chunk_bytes


def test_small_experts_run_mm_loop_on_cpu_where_its_rows_are_independent():
    """Below SMALL_EXPERT_WEIGHT the CPU runs torch.mm per expert into the output (`mm-loop`) where the probe finds
    a row's bits independent of the rows beside it; larger experts, or a torch.mm whose rows depend on the call,
    run oneDNN."""
    small, large = torch.empty(4, 32, 24).transpose(1, 2), torch.empty(1, 1024, 1024)
    x_small, x_large = torch.empty(9, 24), torch.empty(9, 1024)
    if not grouped_gemm.mm_rows_independent(torch.float32, 24, 32, True):
        pytest.skip("this CPU's torch.mm gives rows bits that depend on the call: oneDNN runs (the next test)")
    assert _kernel(x_small, small, [3, 0, 4, 2], None) == "mm-loop"
    assert _kernel(x_large, large, [9], None) == "onednn"
    assert kernel_name("cpu", torch.float32) == "mm-loop"  # what the logs and the benchmark report


def test_a_torch_mm_whose_rows_depend_on_the_call_leaves_the_experts_on_onednn(monkeypatch):
    """The probe compares rows computed in calls of other sizes: a BLAS that rounds by the call's row count (here a
    stand-in adding an ulp per row of the call) fails it, and the kernel is oneDNN."""
    real = grouped_gemm._mm_rows

    def row_count_dependent(x, w, out):
        return real(x, w, out).mul_(1 + x.shape[0] * 2**-23)

    monkeypatch.setattr(grouped_gemm, "_mm_rows", row_count_dependent)
    grouped_gemm.mm_rows_independent.cache_clear()
    try:
        assert not grouped_gemm.mm_rows_independent(torch.float32, 24, 32, True)
        assert _kernel(torch.empty(9, 24), torch.empty(4, 32, 24).transpose(1, 2), [3, 0, 4, 2], None) == "onednn"
    finally:
        grouped_gemm.mm_rows_independent.cache_clear()


def test_mm_loop_pads_an_expert_of_few_rows_so_its_rows_match_a_bigger_call():
    """MKL takes another path for a few rows: each expert's rows, 1 to 40 of them, give the bits they get in one
    call over all 67 (the pipelined experts' chunks rely on it; oneDNN's 1-row path differs, see its test)."""
    g = torch.Generator().manual_seed(1)
    x, w_EOI = torch.randn(67, 512, generator=g), torch.randn(1, 352, 512, generator=g)
    whole = torch.mm(x, w_EOI[0].t())
    if not all(torch.equal(torch.mm(x[:n], w_EOI[0].t()), whole[:n]) for n in (16, 24, 40)):
        pytest.skip("this CPU's torch.mm gives rows bits that depend on the call even at 16 rows and more")
    with forced_kernel("mm-loop"):
        for count in range(1, 41):
            got = grouped_gemm.grouped_mm(x[:count], w_EOI.transpose(1, 2), [count])
            assert torch.equal(got, whole[:count]), count
