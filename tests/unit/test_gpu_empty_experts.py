"""Empty experts and the kernel choice on one GPU, with the real kernels: every grouped kernel that runs here,
in fp32, fp16 and bf16, gives an expert without rows a weight gradient of exactly zero, and the grouped_gemm
package (where it is installed) runs bf16 only. Skipped without CUDA; test_empty_experts.py and
test_kernel_choice.py are the CPU tests, with fakes of these kernels.

Before each fresh output the caching allocator is handed back a block of NaN of the output's size, which the
output's torch.empty then most likely reuses (what a training step's freed activations leave there).
"""

import pytest
import torch

from megatron_moe.moe.experts import GroupedMLP
from megatron_moe.moe.grouped_gemm import KERNELS, _choose, _grouped_gemm_backend, forced_kernel, grouped_weight_grad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Legend: N = rows, E = experts, O, I = a weight gradient's rows and columns, H = hidden, F = ffn width.
H, F = 64, 128
COUNTS = {"between": [40, 0, 72, 0, 16], "at_the_ends": [0, 0, 128, 0], "nothing": [0, 0, 0, 0]}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative, of a whole dW (fp32: TF32)


def _dirty_cache(shape, dtype) -> None:
    """A freed block of NaN of this size in the caching allocator, for the next allocation to reuse."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("into", ["fresh", "nan_buffer"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_gives_an_expert_without_rows_a_zero_weight_grad(kernel, counts, dtype, into):
    g = torch.Generator(device="cuda").manual_seed(0)
    grad_RO, x_RI = (torch.randn(sum(counts), n, generator=g, device="cuda").to(dtype) for n in (F, H))
    shape = (len(counts), F, H)
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda") if into == "nan_buffer" else None
    with forced_kernel(kernel):
        ran = _choose(grad_RO, x_RI, counts, out)
        if out is None:
            _dirty_cache(shape, dtype)
        dw_EOI = grouped_weight_grad(grad_RO, x_RI, counts, out)
    assert ran != "grouped_gemm" or dtype == torch.bfloat16  # the package takes bf16 only
    for e, count in enumerate(counts):
        if not count:
            assert torch.equal(dw_EOI[e], torch.zeros_like(dw_EOI[e])), (ran, e)
    if sum(counts):
        rows = zip(torch.split(grad_RO.double(), counts), torch.split(x_RI.double(), counts))
        want = torch.stack([g.t() @ x for g, x in rows])
        assert ((dw_EOI.double() - want).norm() / want.norm()).item() < TOL[dtype], ran


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_fused_mlp_runs_in_every_dtype_with_the_kernel_the_dtype_takes(dtype):
    """With the grouped_gemm package installed or not: no GEMM of fp32 or fp16 goes to it (it would raise)."""
    counts = COUNTS["between"]
    g = torch.Generator(device="cuda").manual_seed(1)
    x, dy = (torch.randn(sum(counts), H, generator=g, device="cuda").to(dtype) for _ in range(2))
    w1 = (torch.randn(len(counts), 2 * F, H, generator=g, device="cuda") * 0.1).to(dtype).requires_grad_()
    w2 = (torch.randn(len(counts), H, F, generator=g, device="cuda") * 0.1).to(dtype).requires_grad_()
    ran = _choose(x, w1.transpose(1, 2), counts, None)
    assert (ran == "grouped_gemm") == (dtype == torch.bfloat16 and _grouped_gemm_backend() is not None), ran
    GroupedMLP.apply(x.requires_grad_(), w1, w2, counts, True, None).backward(dy)
    for grad in (x.grad, w1.grad, w2.grad):
        assert torch.isfinite(grad).all()
    for grad in (w1.grad, w2.grad):  # experts 1 and 3 have no rows
        assert torch.equal(grad[1::2], torch.zeros_like(grad[1::2]))
