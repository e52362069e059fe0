"""An expert that receives no rows gets a weight gradient of exactly zero, from every grouped kernel.

Every kernel of `KERNELS` is forced in turn, the two GPU ones (the grouped_gemm package, torch._grouped_mm) as
their GPU builds behave at this point (`gpu_like_kernels`: an empty group's output left as it was, or written
with garbage), and every uninitialised allocation made from Python is NaN, as recycled device memory can be.
Cases: experts without rows between others, at both ends, a run of experts (`GroupedMLP`'s `chunk_bytes`)
without any rows, a rank that receives nothing at all, the pipeline's empty chunks, and an output buffer full
of NaN handed to the closure (a store's `out`). In each, the empty experts' dW is exactly 0 and the others'
match a per-expert loop in float64.
"""

import pytest
import torch

from megatron_moe.activations.engine import SAVE_ALL
from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.experts import FFNExperts, GroupedMLP
from megatron_moe.moe.ffn import ffn_activation
from megatron_moe.moe.grouped_gemm import KERNELS, _kernel, forced_kernel, grouped_weight_grad
from megatron_moe.moe.pipeline import Links, pipelined_experts
from megatron_moe.moe.weight_grad import RUN_NOW
from tests.unit.gpu_like_kernels import (
    GpuLikeGroupedGemm,
    install_gpu_like_grouped_mm,
    install_grouped_gemm,
    poison_allocations,
)

# Legend: N = rows, E = experts, O, I = a weight gradient's rows and columns, H = hidden, F = ffn width.
H, F = 16, 24  # these and the row totals: multiples of 16 bytes in bf16 and fp32, so torch._grouped_mm fits
COUNTS = {
    "between": [5, 0, 9, 0, 2],
    "at_the_ends": [0, 0, 8, 0],  # with a run per expert: experts 0-1 are a run of no rows
    "nothing": [0, 0, 0, 0],  # a rank that receives no rows
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # relative, of a whole dW


@pytest.fixture
def gpu_like(monkeypatch):
    """The grouped_gemm package installed, torch._grouped_mm and the allocator as on a GPU (see the docstring)."""
    backend = GpuLikeGroupedGemm()
    install_grouped_gemm(monkeypatch, backend)
    grouped_mm_calls = install_gpu_like_grouped_mm(monkeypatch)
    poison_allocations(monkeypatch)
    yield {"grouped_gemm": backend.calls, "torch._grouped_mm": grouped_mm_calls}
    grouped_gemm._grouped_gemm_backend.cache_clear()


def _ran_a_weight_grad(gpu_like: dict, kernel: str) -> bool:
    """Whether the GPU-like `kernel` computed a weight gradient (the package: trans_a; torch's: 2-D x 2-D)."""
    calls = gpu_like.get(kernel, [])
    return any(call[1] for call in calls) if kernel == "grouped_gemm" else (2, 2) in calls


def _runs(kernel: str, a: torch.Tensor, b: torch.Tensor, counts: list[int], out) -> str:
    with forced_kernel(kernel):
        return _kernel(a, b, counts, out)


def _check_weight_grad(dw_EOI: torch.Tensor, want_EOI: torch.Tensor, counts: list[int], what) -> None:
    """Empty experts' dW exactly 0, the others' as the float64 loop's (relative to its norm: bf16 rounds the
    activations in between, which the loop does not)."""
    for e, count in enumerate(counts):
        if not count:
            assert torch.equal(dw_EOI[e], torch.zeros_like(dw_EOI[e])), (what, e, dw_EOI[e])
    error = (dw_EOI.double() - want_EOI).norm() / want_EOI.norm().clamp_min(1e-30)
    assert error < TOL[dw_EOI.dtype], (what, error.item())


def _loop_weight_grad(grad_RO: torch.Tensor, x_RI: torch.Tensor, counts: list[int]) -> torch.Tensor:
    rows = zip(torch.split(grad_RO.double(), counts), torch.split(x_RI.double(), counts))
    return torch.stack([g.t() @ x for g, x in rows])


@pytest.mark.parametrize("into", ["fresh", "nan_buffer"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_weight_grad_of_an_expert_without_rows_is_zero(gpu_like, kernel, counts, dtype, into):
    g = torch.Generator().manual_seed(0)
    grad_RO, x_RI = (torch.randn(sum(counts), n, generator=g).to(dtype) for n in (F, H))
    out = torch.full((len(counts), F, H), float("nan"), dtype=dtype) if into == "nan_buffer" else None
    gpu_like_runs = {"grouped_gemm": dtype == torch.bfloat16, "torch._grouped_mm": out is None}
    if sum(counts) and gpu_like_runs.get(kernel, False):  # the GPU-like kernel is the one tested
        assert _runs(kernel, grad_RO, x_RI, counts, out) == kernel
    with forced_kernel(kernel):
        dw_EOI = grouped_weight_grad(grad_RO, x_RI, counts, out)
    assert out is None or dw_EOI is out  # written into the buffer it was given
    _check_weight_grad(dw_EOI, _loop_weight_grad(grad_RO, x_RI, counts), counts, (kernel, into))


class NanOuts:
    """A deferring store that keeps the node's closure and runs it into output buffers full of NaN (as it would
    into a buffer that held anything), as a store that hands over main_grad-like buffers does."""

    defers = True

    def __init__(self):
        self.kept = []

    def put(self, weight_grad, outs) -> None:
        self.kept.append(weight_grad)

    def run(self, *weights: torch.Tensor) -> list[tuple]:
        results = []
        for weight_grad in self.kept:
            outs = [torch.full_like(w, float("nan")) for w in weights]
            grads = weight_grad(*outs)
            assert all(grad is out for grad, out in zip(grads, outs) if grad is not None)  # written into them
            results.append(grads)
        return results


def _experts(num: int, dtype: torch.dtype) -> FFNExperts:
    """SwiGLU experts with weights of std 0.2 (so bf16 stays near the float64 loop)."""

    def normal(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(w, std=0.2)

    sizes = {"num_local_experts": num, "hidden_size": H, "ffn_hidden_size": F, "gated": True}
    return FFNExperts(**sizes, init_method=normal, output_init_method=normal, params_dtype=dtype)


def _mlp_inputs(counts, dtype, gated=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), H, generator=g).to(dtype)
    w1 = (torch.randn(len(counts), 2 * F if gated else F, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(len(counts), H, F, generator=g) * 0.2).to(dtype)
    return x, w1, w2, torch.randn(sum(counts), H, generator=g).to(dtype)


def _loop_mlp_grads(x, w1, w2, dy, counts, gated=True):
    """(dW1, dW2) of a per-expert loop of plain matmuls in float64."""
    leaves = [t.double().requires_grad_() for t in (x, w1, w2)]
    rows = torch.split(leaves[0], counts)
    out = torch.cat([ffn_activation(r @ leaves[1][e].t(), gated) @ leaves[2][e].t() for e, r in enumerate(rows)])
    out.backward(dy.double())
    return leaves[1].grad, leaves[2].grad


@pytest.mark.parametrize("store", ["run_now", "deferred_into_nan"])
@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["one_run", "run_per_expert"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("counts", [COUNTS["between"], COUNTS["at_the_ends"]], ids=["between", "at_the_ends"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_fused_expert_mlp_gives_experts_without_rows_zero_weight_grads(
    gpu_like, kernel, counts, dtype, chunk_bytes, store
):
    """GroupedMLP over runs of experts (one, or one per expert with a run of no rows), its weight gradients run
    now or by a deferring store into NaN buffers (`_all_runs`' slices of them)."""
    x, w1, w2, dy = _mlp_inputs(counts, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    deferring = NanOuts()
    with forced_kernel(kernel):
        out = GroupedMLP.apply(
            *leaves, counts, True, chunk_bytes, SAVE_ALL, RUN_NOW if store == "run_now" else deferring
        )
        out.backward(dy)
        dw1, dw2 = (leaves[1].grad, leaves[2].grad) if store == "run_now" else deferring.run(w1, w2)[0]
    # The GPU-like kernels run where they fit: the package in bf16, torch's without an output buffer.
    fits = {"grouped_gemm": dtype == torch.bfloat16, "torch._grouped_mm": store == "run_now" and chunk_bytes is None}
    assert _ran_a_weight_grad(gpu_like, kernel) == fits.get(kernel, False)
    assert torch.isfinite(leaves[0].grad).all()
    for name, got, want in zip(("dw1", "dw2"), (dw1, dw2), _loop_mlp_grads(x, w1, w2, dy, counts)):
        _check_weight_grad(got, want, counts, (kernel, name))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_rank_that_receives_nothing_has_zero_expert_weight_grads(gpu_like, kernel):
    """FFNExperts on no rows (it runs its per-GEMM nodes then): zero dW from autograd, and from a deferring
    store's closures, written into the NaN buffers they are given."""
    counts = COUNTS["nothing"]
    experts = _experts(len(counts), torch.float32)
    rows = torch.zeros(0, H, requires_grad=True)
    with forced_kernel(kernel):
        experts(rows, counts).sum().backward()
        now = experts.weight1.grad, experts.weight2.grad
        experts.zero_grad(set_to_none=True)
        experts.weight_grad_store = NanOuts()
        experts(rows, counts).sum().backward()
        per_gemm = experts.weight_grad_store.run(experts.weight1, experts.weight2)  # each fills its weight's place
    assert experts.weight1.grad is None and experts.weight2.grad is None  # the store owns them
    later = [next(grads[i] for grads in per_gemm if grads[i] is not None) for i in (0, 1)]
    for grad, weight in zip([*now, *later], [experts.weight1, experts.weight2] * 2):
        assert torch.equal(grad, torch.zeros_like(weight)), (kernel, grad)


@pytest.mark.parametrize("degrees", [(1, 1), (4, 1), (1, 4), (8, 8)])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(  # [0, 0, 3, 5] in 8 chunks: chunk 0 has no rows, chunk 1 rows of expert 3 only
    "counts", [[3, 0, 5, 0], [0, 0, 3, 5], [0, 0, 0, 0]], ids=["between", "empty_chunks", "nothing"]
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_pipeline_gives_experts_without_rows_zero_weight_grads(gpu_like, kernel, counts, dtype, degrees):
    """FSMoE's chunked pipeline at EP = 1: experts with no rows in any chunk, chunks with no rows, no rows at all
    (forward and backward chunked alike or not); the empty experts' dW is exactly 0, the others' the loop's."""
    experts = _experts(len(counts), dtype)
    g = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(sum(counts), H, generator=g).to(dtype) for _ in range(2))
    rows = x.clone().requires_grad_()
    with forced_kernel(kernel):
        out = pipelined_experts(rows, experts, counts, [counts], degrees, Links(None, None, None, None))
        out.backward(dy)
    if sum(counts):  # the GPU-like kernels ran the weight gradients (the package in bf16 only)
        fits = {"grouped_gemm": dtype == torch.bfloat16, "torch._grouped_mm": True}
        assert _ran_a_weight_grad(gpu_like, kernel) == fits.get(kernel, False)
    want = _loop_mlp_grads(x, experts.weight1.detach(), experts.weight2.detach(), dy, counts)
    for name, got, w in zip(("dw1", "dw2"), (experts.weight1.grad, experts.weight2.grad), want):
        _check_weight_grad(got, w, counts, (kernel, name))


class _Recording:
    """A weight-gradient store that defers (Lancet's kind) and records the closures handed to it."""

    defers = True

    def __init__(self):
        self.puts = 0

    def put(self, weight_grad, outs):
        self.puts += 1
        return None


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_a_rank_without_rows_hands_its_weight_grads_over_as_a_rank_with_rows_does(gated):
    """The order in which DDP hears of weight1 and weight2, and the closures a deferring store gets, must not
    depend on this rank's rows: with per-parameter buckets (the adaptive partition) that order is the order of
    the gradient reductions, which must agree over the expert-data-parallel group. A rank without rows once ran
    two per-GEMM nodes (weight2 heard of first), every other rank one fused node."""

    def hand_over(counts: list[int]) -> tuple[list[str], int]:
        experts = FFNExperts(
            num_local_experts=4, hidden_size=H, ffn_hidden_size=F, gated=gated,
            init_method=torch.nn.init.normal_, output_init_method=torch.nn.init.normal_,
        )  # fmt: skip
        order = []
        for name in ("weight1", "weight2"):
            getattr(experts, name).register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
        experts(torch.randn(sum(counts), H, requires_grad=True), counts).sum().backward()
        recording = experts.weight_grad_store = _Recording()
        experts(torch.randn(sum(counts), H, requires_grad=True), counts).sum().backward()
        return order, recording.puts

    assert hand_over(COUNTS["nothing"]) == hand_over(COUNTS["between"][:4]) == hand_over(COUNTS["at_the_ends"])
