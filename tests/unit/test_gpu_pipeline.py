"""FSMoE's chunked pipeline on one GPU: its's stream mechanics with an emulated transfer. Skipped without
CUDA.

One GPU cannot run an EP group, so every chunk's all-to-all (to the experts and back, forward and backward) is
`gpu_emulation.emulated_transfer`: the chunk's rows device -> pinned host -> device on a side stream, waited by the
compute stream's event wait. CUDA events on the compute stream bracket each chunk's expert work (`Links.gather`
marks where it begins, `Links.scatter` where it ends). The checks: chunk j+1's transfer is in flight while chunk j's
experts compute, forward and backward; a pipelined forward + backward makes no host sync (CUDA's sync debug mode
raises on one); outputs and gradients equal r = 1 within 1e-6 relative; and at r = 4 the layer takes less time
than at r = 1 when a chunk's transfer and its experts take about as long.
"""

import json

import pytest
import torch

from megatron_moe.moe.experts import FFNExperts
from megatron_moe.moe.pipeline import Links, pipelined_experts
from tests.unit.gpu_emulation import emulated_transfer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, HIDDEN, FFN, EXPERTS = 16384, 1024, 4096, 4
COPIES = 4  # round trips per transfer: about as long as the chunk's expert GEMMs on a current GPU


def event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


class EmulatedLinks(Links):
    """The pipeline's links on one GPU: every all-to-all an emulated transfer, the expert work of each chunk
    bracketed by events. `timeline`: (what, backward, start event, end event) in issue order."""

    def __init__(self):
        super().__init__(None, None, None, None)
        self.timeline: list[tuple[str, bool, torch.cuda.Event, torch.cuda.Event]] = []
        self._computing: torch.cuda.Event | None = None

    def _transfer(self, rows, what: str, backward: bool):
        handle, start, end = emulated_transfer(rows, COPIES)
        self.timeline.append((what, backward, start, end))
        return handle

    def to_experts(self, rows_RH, chunk, *, backward):
        return self._transfer(rows_RH, "to_experts", backward)

    def from_experts(self, rows_RH, chunk, *, backward):
        return self._transfer(rows_RH, "from_experts", backward)

    def gather(self, rows, chunk, *, backward):
        self._computing = event()
        return super().gather(rows, chunk, backward=backward)

    def scatter(self, rows, chunk, *, backward):
        rows = super().scatter(rows, chunk, backward=backward)
        self.timeline.append(("experts", backward, self._computing, event()))
        return rows


def run(degrees: tuple[int, int]):
    torch.manual_seed(0)
    normal = torch.nn.init.normal_
    experts = FFNExperts(
        num_local_experts=EXPERTS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        gated=False,
        init_method=lambda w: normal(w, std=0.02),
        output_init_method=lambda w: normal(w, std=0.02),
    ).cuda()
    counts = [ROWS // EXPERTS] * EXPERTS
    x = torch.randn(ROWS, HIDDEN, device="cuda", requires_grad=True)
    grad = torch.randn(ROWS, HIDDEN, device="cuda")
    for _ in range(2):  # the first warms up kernels and the allocator
        links = EmulatedLinks()
        for p in (x, experts.weight1, experts.weight2):
            p.grad = None
        torch.cuda.synchronize()
        begin = event()
        torch.cuda.set_sync_debug_mode("error")  # a host sync anywhere in the pipeline raises
        try:
            y = pipelined_experts(x, experts, counts, [counts], degrees, links)
            y.backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        done = event()
        torch.cuda.synchronize()
    outputs = [t.detach().clone() for t in (y, x.grad, experts.weight1.grad, experts.weight2.grad)]
    return outputs, links.timeline, begin.elapsed_time(done)


def close(a, b, rtol=1e-6) -> bool:
    return (a - b).abs().max().item() <= rtol * b.abs().max().item()


def overlaps(a: tuple, b: tuple) -> bool:
    """Whether the spans of two (start, end) event pairs intersect."""
    (a0, a1), (b0, b1) = a, b
    return a0.elapsed_time(b1) > 0 and b0.elapsed_time(a1) > 0


def test_each_chunks_transfer_runs_under_the_previous_chunks_experts_and_changes_nothing():
    plain, _, plain_ms = run((1, 1))
    pipelined, timeline, pipelined_ms = run((4, 4))
    assert all(close(got, want) for got, want in zip(pipelined, plain))
    report = {"r1_ms": plain_ms, "r4_ms": pipelined_ms}
    for backward in (False, True):
        arriving = [(s, e) for what, b, s, e in timeline if b == backward and what == "to_experts"]
        computing = [(s, e) for what, b, s, e in timeline if b == backward and what == "experts"]
        assert len(arriving) == len(computing) == 4
        # chunk j + 1's rows travel while chunk j's experts compute
        hidden = [overlaps(arriving[j + 1], computing[j]) for j in range(3)]
        report["backward" if backward else "forward"] = {
            "transfer_ms": [s.elapsed_time(e) for s, e in arriving],
            "experts_ms": [s.elapsed_time(e) for s, e in computing],
            "next_transfer_under_experts": hidden,
        }
        assert all(hidden), report
    print(json.dumps(report))
    assert pipelined_ms < plain_ms, report
