"""MKL's batched sgemm (`megatron_moe.moe.mkl_batch`): each GEMM of a batch gets the bits torch.mm gives it
alone, whatever the operands' layouts, and `mm-loop` (and the dW loop) issue their experts' GEMMs through it
without changing a bit of the layer's results.

Legend: R = rows, E = experts, I = input width, O = output width.
"""

import pytest
import torch

from megatron_moe.moe import grouped_gemm, mkl_batch
from megatron_moe.moe.grouped_gemm import forced_kernel, grouped_mm, grouped_weight_grad

pytestmark = pytest.mark.skipif(not mkl_batch.available(), reason="this torch exports no MKL SGEMM_BATCH")

COUNTS = [130, 0, 7, 16, 200, 1, 90, 33]  # empty, small (padded by mm-loop) and big experts


@pytest.fixture(autouse=True)
def two_threads():
    """The experts batch their GEMMs only with more than one intra-op thread (`_batching_pays`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _views(t: torch.Tensor, unit_rows: bool) -> torch.Tensor:
    """`t` as a view with unit column stride (as it is) or unit row stride (a transposed copy's transpose)."""
    return t.t().contiguous().t() if unit_rows else t


@pytest.mark.parametrize("a_unit_rows", [False, True])
@pytest.mark.parametrize("b_unit_rows", [False, True])
def test_each_gemm_of_a_batch_has_torch_mms_bits_in_every_layout(a_unit_rows, b_unit_rows):
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 448, 256), (128, 448, 256), (16, 448, 256), (301, 448, 256)]  # (m, k, n) per GEMM
    a_parts = [_views(torch.randn(m, k, generator=g), a_unit_rows) for m, k, _ in shapes]
    b_parts = [_views(torch.randn(k, n, generator=g), b_unit_rows) for _, k, n in shapes]
    # The operands at offsets in one storage each, as the experts' rows and weights lie; C a slice of a wider buffer.
    a_store = torch.cat([p.t().reshape(-1) if a_unit_rows else p.reshape(-1) for p in a_parts])
    b_store = torch.cat([p.t().reshape(-1) if b_unit_rows else p.reshape(-1) for p in b_parts])
    sizes_a, sizes_b = [p.numel() for p in a_parts], [p.numel() for p in b_parts]
    a_offsets = [sum(sizes_a[:g]) for g in range(len(shapes))]
    b_offsets = [sum(sizes_b[:g]) for g in range(len(shapes))]
    m = [s[0] for s in shapes]
    c = torch.full((sum(m), 300), float("nan"))
    c_offsets = [sum(m[:g]) * 300 for g in range(len(shapes))]
    k, n = 448, 256
    a_strides = (1, max(m)) if a_unit_rows else (k, 1)
    b_strides = (1, k) if b_unit_rows else (n, 1)
    if a_unit_rows:  # one leading dimension for the batch: each A part stored as a [k, m_max] column block
        pad = torch.nn.functional.pad
        a_store = torch.cat([pad(p.t(), (0, max(m) - p.shape[0])).reshape(-1) for p in a_parts])
        a_offsets = [g * k * max(m) for g in range(len(shapes))]
    ran = mkl_batch.grouped_sgemm(
        a_store, a_offsets, a_strides, b_store, b_offsets, b_strides, c, c_offsets, 300, m=m, n=n, k=k
    )
    assert ran
    start = 0
    for a_part, b_part, rows in zip(a_parts, b_parts, m):
        assert torch.equal(c[start : start + rows, :n], torch.mm(a_part, b_part))
        start += rows
    assert c[:, n:].isnan().all()  # the columns beyond n untouched


def test_operands_it_cannot_take_are_refused_and_nothing_is_written():
    a, b, c = torch.randn(8, 6), torch.randn(6, 4), torch.zeros(8, 4)
    one = [0]
    strided = (2, 2)  # no unit stride: not a BLAS operand
    assert not mkl_batch.grouped_sgemm(a, one, strided, b, one, (4, 1), c, one, 4, m=4, n=4, k=3)
    assert not mkl_batch.grouped_sgemm(a.double(), one, (6, 1), b, one, (4, 1), c, one, 4, m=8, n=4, k=6)
    assert not mkl_batch.grouped_sgemm(a, one, (6, 1), b, one, (4, 1), c, one, 3, m=8, n=4, k=6)  # ldc < n
    assert torch.equal(c, torch.zeros(8, 4))
    assert mkl_batch.grouped_sgemm(a, one, (6, 1), b, one, (4, 1), c, one, 4, m=8, n=4, k=6)
    assert torch.equal(c, torch.mm(a, b))


def _expert_gemms(hidden: int, ffn: int):
    g = torch.Generator().manual_seed(1)
    rows = sum(COUNTS)
    x, grad = torch.randn(rows, hidden, generator=g), torch.randn(rows, ffn, generator=g)
    w_EOI = torch.randn(len(COUNTS), ffn, hidden, generator=g)
    main_grad = torch.full((len(COUNTS) + 2, ffn, hidden), 7.0)  # dW into a slice of a bigger buffer
    with forced_kernel("mm-loop"):
        y = grouped_mm(x, w_EOI.transpose(1, 2), COUNTS)  # fc1: a transposed weight view
        dx = grouped_mm(grad, w_EOI, COUNTS)  # its input gradient: the weight as it lies
        dw = grouped_weight_grad(grad, x, COUNTS).clone()
        grouped_weight_grad(grad, x, COUNTS, out=main_grad[1:-1])
    return y, dx, dw, main_grad


@pytest.mark.parametrize("hidden,ffn", [(448, 256), (512, 352), (32, 24)])
def test_the_experts_gemms_through_the_batch_equal_the_loop_bit_for_bit(hidden, ffn, monkeypatch):
    calls = []
    real = mkl_batch.grouped_sgemm

    def counted(*args, **kwargs):
        calls.append(kwargs["m"])
        return real(*args, **kwargs)

    monkeypatch.setattr(mkl_batch, "grouped_sgemm", counted)
    batched = _expert_gemms(hidden, ffn)
    assert len(calls) >= 4, "the batch did not run"  # y, dX, dW twice (and the probes)
    monkeypatch.setattr(mkl_batch, "_sgemm_batch", lambda: None)  # no batch: torch.mm per expert
    looped = _expert_gemms(hidden, ffn)
    for name, got, want in zip(("y", "dx", "dw", "main_grad"), batched, looped):
        assert torch.equal(got, want), name
    main_grad = batched[3]
    assert (main_grad[[0, -1]] == 7.0).all() and (main_grad[1 + 1] == 0).all()  # neighbours kept, empty expert 0


def test_a_batch_that_differs_from_torch_mm_is_not_used(monkeypatch):
    """The probe compares the batch with torch.mm per expert: a batch that rounds otherwise (here one adding an
    ulp) fails it, and the loop runs."""
    real = mkl_batch.grouped_sgemm

    def off_by_an_ulp(*args, **kwargs):
        ran = real(*args, **kwargs)
        c = args[6]
        c.mul_(1 + 2**-23)
        return ran

    monkeypatch.setattr(mkl_batch, "grouped_sgemm", off_by_an_ulp)
    grouped_gemm._batch_matches_mm.cache_clear()
    try:
        assert not grouped_gemm._batch_matches_mm("y", torch.float32, 448, 256, True)
        assert not grouped_gemm._batch_matches_mm("dw", torch.float32, 448, 256, False)
        y, dx, dw, _ = _expert_gemms(448, 256)
        monkeypatch.setattr(mkl_batch, "_sgemm_batch", lambda: None)
        want = _expert_gemms(448, 256)
        assert torch.equal(y, want[0]) and torch.equal(dx, want[1]) and torch.equal(dw, want[2])
    finally:
        grouped_gemm._batch_matches_mm.cache_clear()


def test_one_thread_runs_the_loop(monkeypatch):
    """With one intra-op thread the batch has nothing to share out: the loop runs, with the same bits."""
    calls = []
    monkeypatch.setattr(mkl_batch, "grouped_sgemm", lambda *a, **k: calls.append(1))
    torch.set_num_threads(1)
    looped = _expert_gemms(448, 256)
    assert not calls
    monkeypatch.undo()
    torch.set_num_threads(2)
    for got, want in zip(looped, _expert_gemms(448, 256)):
        assert torch.equal(got, want)
